"""`consumer.kill_points`: a process (in its own group, as the commands tests kill) SIGKILLs its group, or
sends itself SIGTERM, at the chosen pass of the named point, and nowhere else; a start gate holds until its
file exists or a stop is requested."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from consumer.kill_points import ENV, GATE_ENV, start_gate

PASSES = """
import signal
from consumer.kill_points import kill_point
signal.signal(signal.SIGTERM, lambda *_: print("asked to stop", flush=True))
for n in range(3):
    kill_point("x")
    print(n, flush=True)
"""


def _run(point: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PASSES],
        env={**os.environ, ENV: point},
        capture_output=True,
        text=True,
        start_new_session=True,  # the kill takes its process group: not this one
        timeout=60,
    )


def test_the_named_point_kills_at_its_chosen_pass() -> None:
    killed = _run("x:2")
    assert (killed.returncode, killed.stdout.split()) == (-signal.SIGKILL, ["0"])
    assert _run("x").stdout == ""


def test_term_asks_the_process_itself_to_stop_and_it_goes_on_as_its_handler_says() -> None:
    asked = _run("x:2:TERM")
    assert (asked.returncode, asked.stdout.splitlines()) == (0, ["0", "asked to stop", "1", "2"])


def test_other_points_and_passes_past_the_end_do_nothing() -> None:
    for point in ("y", "x:4", ""):
        ran = _run(point)
        assert (ran.returncode, ran.stdout.split()) == (0, ["0", "1", "2"])


def test_the_start_gate_holds_until_its_file_exists_or_a_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = tmp_path / "gate"
    monkeypatch.setenv(GATE_ENV, str(gate))
    pauses: list[float] = []

    def pause(seconds: float) -> bool:
        pauses.append(seconds)
        if len(pauses) == 3:
            gate.touch()  # the test opens the gate during the third pause
        return False

    start_gate(pause)
    assert len(pauses) == 3
    gate.unlink()
    start_gate(lambda _: True)  # a stop was requested: it goes on without the file
    monkeypatch.delenv(GATE_ENV)
    start_gate(lambda _: pytest.fail("paused without a gate"))
