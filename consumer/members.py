"""The other members of the consumer group one `run` command runs (`parallelism.processes` > 1).

A process per member, each with its own Kafka consumer, loop and sinks, sharing the topic's partitions
through the group: the cheapest way to use several cores, since nothing crosses a process boundary (decode
workers copy every payload to a worker and its typed rows back). They start from `spawn`: librdkafka and
JVM threads must not be forked.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
from collections.abc import Callable
from multiprocessing.synchronize import Event
from typing import Any

from consumer.errors import ConsumerError
from consumer.pipeline import PipelineStats
from consumer.stopping import StopRequest

_REPORT_WAIT_SECONDS = 1.0


class MemberFailed(ConsumerError):
    """Another member of this command's group stopped on an error (its message says which)."""

    code = "member-failed"


class GroupMembers:
    """`count` processes each running `target(*args, asked, reports)`, which stops once the event `asked` is
    set and then puts `(its name, its PipelineStats or MemberFailed)` on `reports`.

    Stopping goes through that event, not a signal: a member still importing when asked would die of a
    signal without a word; the event waits for it to look.
    """

    def __init__(self, count: int, target: Callable[..., None], args: tuple[Any, ...]) -> None:
        context = multiprocessing.get_context("spawn")
        self._reports = context.Queue()
        self._asked = context.Event()
        self._processes = [
            context.Process(target=target, args=(*args, self._asked, self._reports), name=f"member-{n + 1}")
            for n in range(count)
        ]
        self._outcomes: dict[str, PipelineStats | MemberFailed] = {}
        for process in self._processes:
            process.start()

    def check(self) -> None:
        """Raise the failure of a member that stopped on an error, or died without a word."""
        self._collect(timeout=None)
        for process in self._processes:
            outcome = self._outcomes.get(process.name)
            if isinstance(outcome, MemberFailed):
                raise outcome
            if outcome is None and process.exitcode is not None:
                self._collect(timeout=_REPORT_WAIT_SECONDS)  # its last words may still be in the pipe
                if process.name not in self._outcomes:
                    raise MemberFailed(f"{process.name} exited with code {process.exitcode} and no report")

    def stop(self, *, interrupt: bool) -> list[PipelineStats]:
        """Wait for every member to stop (asked to first, if `interrupt`: each applies and commits what it
        resolved) and return their totals; a member's failure is raised."""
        if interrupt:
            self._asked.set()
        while any(process.is_alive() for process in self._processes):
            self._collect(timeout=_REPORT_WAIT_SECONDS)
        for process in self._processes:
            process.join()
        self.check()
        return [outcome for outcome in self._outcomes.values() if isinstance(outcome, PipelineStats)]

    def _collect(self, *, timeout: float | None) -> None:
        """Take the reports that arrived; with `timeout`, wait that long for the first."""
        try:
            while True:
                if timeout is None:
                    name, outcome = self._reports.get_nowait()
                else:
                    name, outcome = self._reports.get(timeout=timeout)
                    timeout = None
                self._outcomes[name] = outcome
        except queue.Empty:
            return


class MemberProcess:
    """What a member process does besides running its pipeline: it logs warnings only (one progress
    display, one info log: the command's), leaves Ctrl-C to the command, and stops cleanly (like Ctrl-C)
    when the command asks (`asked`), on SIGTERM, or when the command's process is gone."""

    def __init__(self, asked: Event) -> None:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.stop = StopRequest()
        signal.signal(signal.SIGTERM, lambda _signum, _frame: self.stop.request("SIGTERM"))
        self._asked = asked
        self._parent = os.getppid()
        self.name = multiprocessing.current_process().name

    def on_cycle(self, _pipeline: object) -> None:
        if self._asked.is_set():
            self.stop.request(f"{self.name}: asked by the command")
        elif os.getppid() != self._parent:
            self.stop.request(f"{self.name}: the command's process is gone")
