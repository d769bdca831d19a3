"""Operations on sinks and stores told while they hang: a frozen object store otherwise looks, from outside,
exactly like a quiet topic (the loop logs nothing until the write returns, or forever).

Code about to wait on a store wraps the call in `Watchdog.watching("what")`. An operation in progress for
longer than `after` seconds is a stall: a thread of the watchdog's own (the one doing the operation is
blocked) logs a warning every `after` seconds while it lasts, the metrics endpoint lists it when scraped
(`stalls`), and once over, its wait is kept for the run's totals (`longest`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_STALL_AFTER_S = 10.0


@dataclass(frozen=True, slots=True)
class Stall:
    """An operation in progress for longer than the watchdog's `after`: what, and since how long."""

    operation: str
    seconds: float


@dataclass(slots=True)
class _Watched:
    operation: str
    started: float
    warned: int = 0  # warnings logged so far: the next is due at `started + after * (warned + 1)`


class Watchdog:
    """Watches operations from any thread. Its thread runs only while something is watched, so a watchdog
    needs no closing."""

    def __init__(self, after: float = DEFAULT_STALL_AFTER_S) -> None:
        if not after > 0:
            raise ValueError(f"a stall is longer than a positive time, not {after!r} s")
        self.after = after
        self._changed = threading.Condition()
        self._watched: dict[int, _Watched] = {}
        self._tokens = itertools.count()
        self._thread: threading.Thread | None = None
        self._longest: dict[str, float] = {}

    @contextmanager
    def watching(self, operation: str) -> Iterator[None]:
        """Watch the block's operation, e.g. "DeltaSink.write shop.orders"."""
        token, started = next(self._tokens), time.monotonic()
        with self._changed:
            self._watched[token] = _Watched(operation, started)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)
                self._thread.start()
            self._changed.notify()
        try:
            yield
        finally:
            waited = time.monotonic() - started
            with self._changed:
                warned = self._watched.pop(token).warned
                if waited > self.after:
                    self._longest[operation] = max(waited, self._longest.get(operation, 0.0))
            if warned:
                log.warning("%s finished after %.1f s", operation, waited)

    def stalls(self) -> list[Stall]:
        """The operations in progress for longer than `after`, longest first."""
        now = time.monotonic()
        with self._changed:
            waits = [Stall(w.operation, now - w.started) for w in self._watched.values()]
        return sorted((s for s in waits if s.seconds > self.after), key=lambda s: -s.seconds)

    def longest(self) -> dict[str, float]:
        """Per operation that stalled and finished, its longest wait in seconds."""
        with self._changed:
            return dict(self._longest)

    def _watch(self) -> None:
        """Warn of each stall when due; end once nothing is watched (a new operation starts a new thread)."""
        with self._changed:
            while self._watched:
                now = time.monotonic()
                for watched in self._watched.values():
                    if now >= self._due(watched):
                        watched.warned = int((now - watched.started) // self.after)  # late: no burst
                        log.warning(
                            "stalled: %s has been waiting %.1f s", watched.operation, now - watched.started
                        )
                self._changed.wait(min(self._due(w) for w in self._watched.values()) - now)
            self._thread = None

    def _due(self, watched: _Watched) -> float:
        return watched.started + self.after * (watched.warned + 1)
