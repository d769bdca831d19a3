"""Stopping a consumer cleanly when asked: Ctrl-C, SIGTERM, or the process that started it gone.

A request only sets a flag that the loop reads between cycles, so it never lands in the middle of the state
machine's bookkeeping (an exception raised there could leave a record counted but not held, and a commit
past it). The loop then applies what is resolved, commits, and returns. A second Ctrl-C or SIGTERM, for a
consumer stuck in a long write, interrupts at once (KeyboardInterrupt): nothing is committed past what was
applied, so the records after it are read again on restart.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A flag a pipeline loop checks once per cycle."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason = ""

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, cut short by a request; whether one was made."""
        return self._event.wait(timeout)

    def request(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    @classmethod
    @contextlib.contextmanager
    def on_signals(cls, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[StopRequest]:
        """A request set by the first of `signals` (the second interrupts), while the block runs. Signal
        handlers belong to the main thread: elsewhere the request can only be set by hand."""
        stop = cls()
        if threading.current_thread() is not threading.main_thread():
            yield stop
            return

        def handle(signum: int, _frame: FrameType | None) -> None:
            if stop.requested:
                raise KeyboardInterrupt
            name = signal.Signals(signum).name
            log.warning("%s: stopping after this cycle (applying what is resolved, then committing)", name)
            stop.request(name)

        previous = {sig: signal.signal(sig, handle) for sig in signals}
        try:
            yield stop
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
