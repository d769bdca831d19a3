"""The package's own import surface: exactly `__all__`, every name resolving, and light to import."""

from __future__ import annotations

import importlib.resources
import subprocess
import sys
from importlib.metadata import version

import consumer


def test_import_consumer_loads_no_heavy_dependency_and_shows_exactly_all() -> None:
    script = (
        "import sys, consumer\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'pyspark', 'deltalake', 'hypothesis'})\n"
        "assert not heavy, heavy\n"
        "assert dir(consumer) == sorted(consumer.__all__), dir(consumer)\n"
        "namespace = {}\n"
        "exec('from consumer import *', namespace)\n"
        "assert set(namespace) - {'__builtins__'} == set(consumer.__all__), sorted(namespace)\n"
    )
    _passes_in_a_fresh_interpreter(script)


def test_every_public_name_resolves_to_its_home() -> None:
    assert consumer.__version__ == version("ticdc-consumer")
    assert consumer.MessageDecoder.__module__ == "consumer.protocol.simple.decoder"
    assert consumer.MessageEncoder.__module__ == "consumer.protocol.simple.encoder"
    assert consumer.TableCodec.__module__ == "consumer.protocol.table"
    assert consumer.DeltaSink.__module__ == "consumer.sinks.delta"
    assert consumer.strategies.__name__ == "consumer.testing.strategies"
    assert issubclass(consumer.SourceError, consumer.ConsumerError)
    assert issubclass(consumer.ConfigError, consumer.ConsumerError)
    assert issubclass(consumer.ConfigError, ValueError)  # what it was before: `except ValueError` still works
    for name in consumer.__all__:
        assert getattr(consumer, name) is not None
    assert importlib.resources.files("consumer").joinpath("py.typed").is_file()


def test_the_spark_surface_is_one_import_and_tasks_load_no_engine() -> None:
    script = (
        "import sys, consumer.spark, consumer.spark.source\n"
        "assert 'consumer.spark.engine' not in sys.modules\n"
        "assert 'consumer.pipeline' not in sys.modules\n"
        "assert dir(consumer.spark) == sorted(consumer.spark.__all__), dir(consumer.spark)\n"
        "for name in consumer.spark.__all__:\n"
        "    assert getattr(consumer.spark, name).__name__ == name, name\n"
    )
    _passes_in_a_fresh_interpreter(script)


def test_the_large_message_names_load_on_first_use() -> None:
    script = (
        "import sys, consumer.large_messages as large\n"
        "assert 'consumer.large_messages.upstream' not in sys.modules  # nor the MySQL client\n"
        "assert dir(large) == sorted(large.__all__), dir(large)\n"
        "for name in large.__all__:\n"
        "    assert getattr(large, name).__name__ == name, name\n"
        "from consumer.large_messages import UpstreamLookup\n"
        "assert UpstreamLookup.__module__ == 'consumer.large_messages.upstream'\n"
        "try:\n"
        "    large.Missing\n"
        "except AttributeError as exc:\n"
        "    assert str(exc) == \"module 'consumer.large_messages' has no attribute 'Missing'\", exc\n"
        "else:\n"
        "    raise AssertionError('an unknown name resolved')\n"
    )
    _passes_in_a_fresh_interpreter(script)


def _passes_in_a_fresh_interpreter(script: str) -> None:
    """Imports are process-wide: what a module loads is only seen in an interpreter that loaded nothing."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
