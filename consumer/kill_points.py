"""Deterministic crashes and stops for tests: a process signals itself at a named point of its work, when
`TICDC_TEST_KILL_POINT` names it.

`TICDC_TEST_KILL_POINT=<point>[:<n>[:TERM]]`: at the n-th time (default the first) this process reaches
`<point>`, it SIGKILLs its process group (a Spark driver's JVM and Python workers too) or, with `TERM`, sends
itself the SIGTERM that asks for a clean stop. Either at a chosen point is what tests cannot get from
outside without a race (two commits milliseconds apart, or a run that ends before the signal comes); the
lake must be exact after a restart from any of them. Unset, a point costs a dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "TICDC_TEST_KILL_POINT"
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
