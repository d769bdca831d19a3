"""The code type-checks and is lint-clean: `./dev test` (and so CI) runs mypy and ruff with the settings in
pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_package_type_checks() -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checked.returncode == 0, checked.stdout[-5000:]
    assert checked.stdout.startswith("Success: no issues found")


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_the_code_is_ruff_clean(command: list[str]) -> None:
    checked = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert checked.returncode == 0, checked.stdout[-5000:]
