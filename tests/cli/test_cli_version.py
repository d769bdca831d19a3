"""`ticdc-consumer --version`: the installed distribution's version, as a bug report should quote it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version


def test_version_prints_the_installed_distribution_version() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "consumer", "--version"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"ticdc-consumer {version('ticdc-consumer')}\n"
