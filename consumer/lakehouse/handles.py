"""Delta table handles kept across the process's `LakeRoot`s. Loading a table's log costs far more than
bringing a loaded handle up to date (here, locally, 0.5-0.9 ms of CPU against ~0.15 ms; on an object store
a listing of the new commits instead of reading every commit since the last checkpoint), and every read
through a root of its own (`read_mirror(path, ...)`, `consistent_ts(path)`) opens the same few tables: the
catalog, the DDL log, the progress records, the table's mirror and changelog.

A handle belongs to one root at a time (one thread at a time, as `LakeRoot.open` says): a root takes an
idle handle from here, else opens the table, and gives its handles back once it is gone. An idle handle is
used again only while its table is the one it loaded: the commit file of the version it holds still has
the bytes it had. A Delta log's commit files are never rewritten, so a table deleted and made again at the
same place (another table id, other files), or a log cleaned past that version, shows as another file or
none, and the handle is dropped for a fresh open. Bringing it up to date without that check could apply the
new table's commits to the old one's state, or keep reading a table that is gone.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from deltalake import DeltaTable
from deltalake.exceptions import TableNotFoundError

IDLE = 32  # idle handles kept for the process, the one idle longest dropped first
Key = tuple[str, tuple[tuple[str, str], ...]]  # a table's URI and the storage options it was opened with
Read = Callable[[str], bytes]  # a file's bytes, by URI (OSError: none there, or none the root reaches)


@dataclass(frozen=True)
class Held:
    """A handle and the digest of its loaded version's commit file (None: unknown, not kept idle)."""

    table: DeltaTable
    version: int
    digest: bytes | None


class Handles:
    """The handles one root holds, by table URI, given back to the process's idle handles once `owner`
    (the root) is gone; nothing here refers to the root, so it goes once its last user lets it go."""

    def __init__(self, owner: object, options: dict[str, str] | None) -> None:
        self._options, self._sorted_options = options, tuple(sorted((options or {}).items()))
        self._held: dict[str, Held] = {}
        # not at exit: the process is ending, and a handle given back then is never used again
        weakref.finalize(owner, _give_back, os.getpid(), self._sorted_options, self._held).atexit = False

    def open(self, uri: str, read: Read) -> DeltaTable | None:
        """The table at `uri` brought up to date: the handle this root holds, an idle one still loading
        the same table, else a fresh one; None when there is no table there. `read` reads its commit
        files through the root's filesystem."""
        held = self._held.get(uri)
        if held is not None:
            held.table.update_incremental()
            return held.table
        found = _reused(_idle_handle((uri, self._sorted_options)), uri, read) or self._fresh(uri, read)
        if found is not None:
            self._held[uri] = found
        return None if found is None else found.table

    def _fresh(self, uri: str, read: Read) -> Held | None:
        try:
            table = DeltaTable(uri, storage_options=self._options)
        except TableNotFoundError:
            return None
        return Held(table, table.version(), _digest(uri, table.version(), read))


def _reused(idle: Held | None, uri: str, read: Read) -> Held | None:
    """`idle` brought up to date when its table is still the one it loaded, else None (dropped)."""
    if idle is None or _digest(uri, idle.version, read) != idle.digest:
        return None
    idle.table.update_incremental()
    version = idle.table.version()
    return idle if version == idle.version else Held(idle.table, version, _digest(uri, version, read))


def _digest(uri: str, version: int, read: Read) -> bytes | None:
    """The digest of the table's commit file of `version`; None when it cannot be read."""
    try:
        data = read(f"{uri}/_delta_log/{version:020d}.json")
    except OSError:
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


_idle: list[tuple[Key, Held]] = []  # oldest first
_lock = threading.Lock()
# Given back by finalizers, which may run in the middle of anything (a garbage collection), even while
# this thread holds `_lock`: they only put here (reentrant), `_idle_handle` moves them to `_idle`.
_returned: queue.SimpleQueue[tuple[int, Key, Held]] = queue.SimpleQueue()


def _give_back(pid: int, options: tuple[tuple[str, str], ...], held: dict[str, Held]) -> None:
    """A gone root's handles, idle from now: those whose digest is of the version they hold (a handle its
    root brought up to date again, or wrote through, is at a version not checked: dropped)."""
    if pid != os.getpid():  # a forked child's copy of its parent's root: its handles are not the child's
        return
    for uri, each in held.items():
        if each.digest is not None and each.table.version() == each.version:
            _returned.put((pid, (uri, options), each))


def _idle_handle(key: Key) -> Held | None:
    """The idle handle of `key` given back last, taken out (None: none)."""
    with _lock:
        while True:
            try:
                pid, returned, each = _returned.get_nowait()
            except queue.Empty:
                break
            if pid == os.getpid():
                _idle.append((returned, each))
        del _idle[:-IDLE]
        for index in range(len(_idle) - 1, -1, -1):
            if _idle[index][0] == key:
                return _idle.pop(index)[1]
    return None


def _forget() -> None:
    """In a forked child: nothing its parent kept (a handle's runtime does not survive the fork), and a
    lock no thread of the parent holds any longer."""
    global _lock
    _idle.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget)
