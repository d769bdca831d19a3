"""Deterministic crashes for tests: a process SIGKILLs itself, with its process group (a Spark driver's JVM
and Python workers), at a named point of its work, when `TICDC_TEST_KILL_POINT` names it.

`TICDC_TEST_KILL_POINT=<point>[:<n>]`: at the n-th time (default the first) this process reaches `<point>`.
A SIGKILL at a chosen point is what tests cannot get from outside without a race (two commits milliseconds
apart); the lake must be exact after a restart from any of them. Unset, a point costs a dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "TICDC_TEST_KILL_POINT"
_reached: dict[str, int] = {}


def kill_point(name: str) -> None:
    """SIGKILL this process's group if the environment names this point, and this is its chosen pass."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _reached[name] = _reached.get(name, 0) + 1
    if _reached[name] == int(nth or 1):
        os.killpg(os.getpgrp(), signal.SIGKILL)
