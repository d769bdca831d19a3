"""Which processes are alive, and how much memory one took, from /proc (Linux): what a test needs to prove
that nothing a consumer started outlives it (decode workers, their forkserver, the resource tracker, group
members), however it ended, and that a child stayed within its memory bound."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

_PROC = Path("/proc")


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces): state, parent, ..."""
    try:
        stat = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return []
    return stat[stat.rindex(")") + 2 :].split()


def alive(pid: int) -> bool:
    """Running or sleeping: an exited process its parent has not reaped yet (a zombie) does not count."""
    fields = _stat(pid)
    return bool(fields) and fields[0] not in "ZX"


def parent(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def command_line(pid: int) -> str:
    try:
        return (
            (_PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        )
    except OSError:
        return ""


def descendants(pid: int) -> set[int]:
    """Every living process below `pid` (children, their children...)."""
    found: set[int] = set()
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in (_PROC / str(parent) / "task").glob("*/children"):
            try:
                children = {int(child) for child in task.read_text().split()}
            except OSError:
                continue
            pending += children - found
            found |= children
    return {child for child in found if alive(child)}


def with_environment(name: str, value: str) -> set[int]:
    """Living processes whose environment holds `name=value`: a session marks its environment so that every
    process it starts, even one re-parented to init, can be found again."""
    wanted = f"{name}={value}".encode()
    found = set()
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if wanted in environment and alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def wait_gone(pids: Iterable[int], timeout: float) -> set[int]:
    """Wait up to `timeout` seconds for `pids` to end; the ones still alive."""
    left = set(pids)
    deadline = time.monotonic() + timeout
    while True:
        left = {pid for pid in left if alive(pid)}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def peak_rss_mib() -> float:
    """This process's peak resident memory since it started its program (VmHWM). Not `ru_maxrss`: Linux
    carries the spawning process's peak across `exec`, so a child of a large test run would report the
    runner's peak as its own."""
    for line in (_PROC / "self" / "status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise OSError("no VmHWM in /proc/self/status")
