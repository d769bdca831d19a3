"""What the project's many short-lived processes import: Spark's planner processes and Python workers, the
CLI, decode workers. Each entry point must not load a heavy module only some of its paths need (pandas
alone costs 0.1-0.2 s of CPU a process; BENCHMARKS.md, "The test suite")."""

from __future__ import annotations

import subprocess
import sys

import pytest

# pandas comes with `pyarrow.dataset`, and with pyarrow's first Arrow array built from Python objects;
# importlib.metadata with `consumer.__version__`, which only the CLI asks for.
ENGINE_EXTRAS = ("pandas", "pyarrow.dataset", "pymysql", "rich", "prometheus_client", "importlib.metadata")
CLI_EXTRAS = (
    "pandas",
    "pyarrow.dataset",
    "pymysql",
    "rich",
    "prometheus_client",
    "confluent_kafka.schema_registry",
    "consumer.app",
    "consumer.lakehouse",
    "consumer.redrive",
    "consumer.simulate.workload",
    "consumer.sinks.delta",
)

ENTRY_POINTS = {
    # Spark's planner processes and the source's tasks unpickle the data source's classes
    "import consumer.spark.source": (*ENGINE_EXTRAS, "consumer.lakehouse.status"),
    # the executors' changelog appends and mirror MERGEs
    "import consumer.spark.merges": ENGINE_EXTRAS,
    # the decode pool's forkserver
    "import consumer.batches.decode_pool": ENGINE_EXTRAS,
    # the configuration checks an upstream DSN without the MySQL client
    "import consumer.config": (*ENGINE_EXTRAS, "consumer.large_messages.upstream"),
    "import consumer.cli": CLI_EXTRAS,
}


@pytest.mark.parametrize("code", list(ENTRY_POINTS))
def test_an_entry_point_loads_no_module_only_other_paths_need(code: str) -> None:
    unwanted = ENTRY_POINTS[code]
    script = f"import sys\n{code}\nprint(' '.join(sorted(m for m in {unwanted!r} if m in sys.modules)))\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [], f"{code} loaded {result.stdout.strip()}"


def test_the_help_of_run_loads_no_engine() -> None:
    script = (
        "import sys\n"
        "from consumer.cli import main\n"
        "try:\n"
        "    main(['run', '--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(' '.join(sorted(m for m in {CLI_EXTRAS!r} if m in sys.modules)), file=sys.stderr)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "--config" in result.stdout
    assert result.stderr.split() == [], f"run --help loaded {result.stderr.strip()}"
