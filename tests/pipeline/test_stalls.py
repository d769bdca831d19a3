"""Stalls told while they last (issue 25): a sink write or a dead-letter write that hangs is logged every
`stall_after_s` and shown by the metrics endpoint while it does, and clears once it returns."""

from __future__ import annotations

import logging
import queue
import re
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from consumer.batches.changes import TableChanges
from consumer.errors import DeadLetter
from consumer.pipeline import Pipeline, PipelineStats
from consumer.progress import ProgressReporter
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import write_capture_file
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.base import CommitContext
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sinks.jsonl import JsonLinesSink
from consumer.sources.capture import read_capture, write_capture
from consumer.sources.files import FileSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.state.machine import ConsumerState
from consumer.testing.ports import free_port
from consumer.watchdog import Watchdog

AFTER = 0.2  # the watchdog's period in these tests
WAIT = 30.0  # the longest any event is waited for


class _Gate:
    """Blocks the first call through it until `release`; says when that call `entered`."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def pass_through(self) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(WAIT)


class FrozenSink(JsonLinesSink):
    """A JSON-lines sink whose first write hangs until its gate opens."""

    def __init__(self, root: Path, gate: _Gate) -> None:
        super().__init__(root)
        self.gate = gate

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        self.gate.pass_through()
        super().write(changes, context)


class FrozenLetters(DeadLetterFile):
    """A dead-letter file whose first write hangs until its gate opens."""

    def __init__(self, path: Path, gate: _Gate) -> None:
        super().__init__(path)
        self.gate = gate

    def write(self, letter: DeadLetter) -> None:
        self.gate.pass_through()
        super().write(letter)


class FrozenCommits(FileSource):
    """A capture file served as a Kafka assignment, whose first offset commit hangs until its gate opens (a
    broker that leaves an OffsetCommit unanswered)."""

    def __init__(self, path: Path, gate: _Gate, *, listener: Pipeline) -> None:
        super().__init__(path, listener=listener)
        self.gate = gate

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        self.gate.pass_through()
        super().commit(offsets)


@pytest.fixture
def warnings() -> Iterator[queue.Queue[str]]:
    """The watchdog's log lines, as they come (from its own thread)."""
    lines: queue.Queue[str] = queue.Queue()
    handler = logging.Handler()
    handler.emit = lambda record: lines.put(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("consumer.watchdog")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _rows_capture(path: Path) -> Path:
    workload = Workload(WorkloadConfig(rows=30, tables=1, partitions=1, seed=3, ddl=False))
    write_capture_file(workload, MessageEncoder("json"), "cdc", path)
    return path


def _garbage_capture(path: Path) -> Path:
    with path.open("wb") as out:
        write_capture([SourceRecord("cdc", 0, 0, None, None, b"not a TiCDC message")], out)
    return path


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """The stall gauges the endpoint serves: per metric, per label set, the value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
        if family.name.startswith(("ticdc_stall", "ticdc_stalled"))
    }


def _next_warning(lines: queue.Queue[str], operation: str) -> float:
    """The seconds the next "stalled" warning says `operation` has been waiting."""
    line = lines.get(timeout=WAIT)
    found = re.fullmatch(rf"stalled: {re.escape(operation)} has been waiting (\d+\.\d) s", line)
    assert found, line
    return float(found.group(1))


def _finished(lines: queue.Queue[str], operation: str) -> float:
    """The seconds the "finished" line says `operation` took (the warnings before it are of it too)."""
    while True:
        line = lines.get(timeout=WAIT)
        found = re.fullmatch(rf"{re.escape(operation)} finished after (\d+\.\d) s", line)
        if found:
            return float(found.group(1))
        assert line.startswith(f"stalled: {operation} has been waiting "), line


@pytest.mark.parametrize("frozen", ["sink", "dead letters", "offset commit"])
def test_a_frozen_write_is_warned_of_and_gauged_while_it_lasts_and_clears_after(
    tmp_path: Path, warnings: queue.Queue[str], frozen: str
) -> None:
    gate, lake, letters_path = _Gate(), tmp_path / "lake", tmp_path / "letters.jsonl"
    sink: JsonLinesSink
    letters: DeadLetterFile
    if frozen == "sink":
        sink, letters = FrozenSink(lake, gate), DeadLetterFile(letters_path)
        capture, operation = _rows_capture(tmp_path / "c.jsonl"), "FrozenSink.write shop.t0"
    elif frozen == "offset commit":
        sink, letters = JsonLinesSink(lake), DeadLetterFile(letters_path)
        capture = _rows_capture(tmp_path / "c.jsonl")
        operation = f"FrozenCommits.commit cdc[0]@{len(list(read_capture(capture)))}"
    else:
        sink, letters = JsonLinesSink(lake), FrozenLetters(letters_path, gate)
        capture, operation = _garbage_capture(tmp_path / "c.jsonl"), "FrozenLetters.write cdc[0]@0"
    watchdog, port = Watchdog(AFTER), free_port()
    reporter = ProgressReporter(interactive=False, metrics_port=port, watchdog=watchdog)
    pipeline = Pipeline(
        group="g", state=ConsumerState(), sinks=[sink], dead_letters=letters, watchdog=watchdog
    )
    source = (
        FrozenCommits(capture, gate, listener=pipeline)
        if frozen == "offset commit"
        else FileSource(capture, listener=pipeline)
    )
    outcome: list[PipelineStats] = []
    run = threading.Thread(
        target=lambda: outcome.append(pipeline.run(source, until_idle=0.5, on_cycle=reporter))
    )
    run.start()
    try:
        assert gate.entered.wait(WAIT)
        first = _next_warning(warnings, operation)
        second = _next_warning(warnings, operation)  # every period while it lasts
        assert AFTER <= first < second and second >= 2 * AFTER
        gauges = _scrape(port)  # the loop is blocked in the write: read when scraped
        assert gauges["ticdc_stall_seconds"][()] >= second
        assert list(gauges["ticdc_stalled_operation_seconds"]) == [(("operation", operation),)]
    finally:
        gate.release.set()
        run.join(WAIT)
    took = _finished(warnings, operation)
    assert took >= second
    assert _scrape(port) == {"ticdc_stall_seconds": {(): 0.0}, "ticdc_stalled_operation_seconds": {}}
    assert outcome[0].stalls == {operation: pytest.approx(took, abs=0.1)}
    assert outcome[0].records > 0 and outcome[0].dead_letters == (1 if frozen == "dead letters" else 0)
    pipeline.close()


def test_operations_shorter_than_the_period_are_not_stalls(warnings: queue.Queue[str]) -> None:
    watchdog, gate = Watchdog(AFTER), _Gate()
    slow = threading.Thread(target=lambda: _watched(watchdog, "slow", gate))
    slow.start()
    try:
        assert gate.entered.wait(WAIT)
        with watchdog.watching("quick"):
            pass
        assert _next_warning(warnings, "slow") >= AFTER
        assert [stall.operation for stall in watchdog.stalls()] == ["slow"]
    finally:
        gate.release.set()
        slow.join(WAIT)
    took = _finished(warnings, "slow")
    assert watchdog.stalls() == [] and watchdog.longest() == {"slow": pytest.approx(took, abs=0.1)}
    assert warnings.empty()  # nothing of "quick"


def _watched(watchdog: Watchdog, operation: str, gate: _Gate) -> None:
    with watchdog.watching(operation):
        gate.pass_through()
