"""Deterministic crashes and stops for tests: a process signals itself at a named point of its work, when
`TICDC_TEST_KILL_POINT` names it.

`TICDC_TEST_KILL_POINT=<point>[:<n>[:TERM]]`: at the n-th time (default the first) this process reaches
`<point>`, it SIGKILLs its process group (a Spark driver's JVM and Python workers too) or, with `TERM`, sends
itself the SIGTERM that asks for a clean stop. Either at a chosen point is what tests cannot get from
outside without a race (two commits milliseconds apart, or a run that ends before the signal comes); the
lake must be exact after a restart from any of them. Unset, a point costs a dictionary lookup.

`TICDC_TEST_START_GATE=<path>`: a Spark driver waits, its session up, until `<path>` exists, before it reads
its checkpoint, the lake or Kafka: a test starts the restart of a run while that run still works toward its
kill point and opens the gate once the run is dead, so the restart's start-up (Python, the JVM) overlaps
the run instead of following it. Unset, the gate costs a lookup.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

ENV = "TICDC_TEST_KILL_POINT"
GATE_ENV = "TICDC_TEST_START_GATE"
GATE_POLL_SECONDS = 0.01
_reached: dict[str, int] = {}


def kill_point(name: str) -> None:
    """Signal as the environment says if it names this point, and this is its chosen pass."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, when = wanted.partition(":")
    if point != name:
        return
    nth, _, how = when.partition(":")
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] != int(nth or 1):
        return
    if how == "TERM":
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        os.killpg(os.getpgrp(), signal.SIGKILL)


def start_gate(wait: Callable[[float], bool]) -> None:
    """Return once the file `TICDC_TEST_START_GATE` names exists (at once when unset), or `wait` (a pause
    that says whether a stop was requested meanwhile) reports a stop."""
    gate = os.environ.get(GATE_ENV)
    while gate and not os.path.exists(gate) and not wait(GATE_POLL_SECONDS):
        pass
