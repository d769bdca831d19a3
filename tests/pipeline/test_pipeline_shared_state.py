"""What a pipeline shares with other threads and with its process: totals the writer thread never touches,
sinks that record progress on the writer's thread while the loop goes on, and the garbage collector left
alone unless asked."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from captures import one_row_per_table
from click.testing import CliRunner

from consumer.batches.changes import TableChanges
from consumer.cli import main
from consumer.pipeline import Pipeline
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sources.files import FileSource
from consumer.sources.record import TopicPartition
from consumer.state.machine import ConsumerState
from consumer.state.schema_cache import snapshot_schemas
from consumer.stopping import StopRequest


class _GatedSink:
    """Holds the writer thread inside its write of table `b` until released; says when it reached `c`."""

    def __init__(self) -> None:
        self.in_b, self.release, self.in_c = threading.Event(), threading.Event(), threading.Event()
        self.stalled = False  # nobody released it: the loop was waiting for this write

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        if changes.table == "b":
            self.in_b.set()
            self.stalled = not self.release.wait(10)
        elif changes.table == "c":
            self.in_c.set()

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        raise AssertionError("the stream has no DDL")

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {}

    def recorded_schema_snapshot(self) -> bytes | None:
        return None

    def close(self) -> None:
        return None


def _pipeline(tmp_path: Path, sink: object, **options: object) -> Pipeline:
    return Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[sink],  # type: ignore[list-item]
        dead_letters=DeadLetterFile(tmp_path / "_dead_letters.jsonl"),
        **options,  # type: ignore[arg-type]
    )


def test_the_writer_thread_never_changes_the_totals_the_loop_is_reading(tmp_path: Path) -> None:
    """The progress display iterates `rows_by_table` on the loop's thread. Here the writer applies a new
    table's rows exactly while that iteration is half-way: with the writer updating the totals itself,
    the iteration fails ("dictionary changed size during iteration")."""
    sink, stop = _GatedSink(), StopRequest()
    read: list[tuple[str, int]] = []
    pipeline = _pipeline(tmp_path, sink, decode_workers=1)

    def cycle(p: Pipeline) -> None:
        if read or not (sink.in_b.is_set() and "shop.a" in p.stats.rows_by_table):
            return
        tables = iter(p.stats.rows_by_table.items())
        read.append(next(tables))
        sink.release.set()
        assert sink.in_c.wait(30)  # the writer finished b, rows and all
        read.extend(tables)
        stop.request("read")

    try:
        source = FileSource(one_row_per_table(tmp_path / "c.jsonl", "abc"), listener=pipeline)
        pipeline.run(source, until_idle=20, on_cycle=cycle, stop=stop)
    finally:
        pipeline.close()
    assert read == [("shop.a", 1)]  # b was not counted until the loop confirmed it
    assert pipeline.stats.rows_by_table == {"shop.a": 1, "shop.b": 1, "shop.c": 1}
    assert pipeline.stats.rows == 3


class _Sink(_GatedSink):
    def write(self, changes: TableChanges, context: CommitContext) -> None:
        return None


class _GatedRecorder(_Sink):
    """Keeps progress; its first record waits until released. Notes each record's thread and the tables
    whose schemas its records durably hold."""

    def __init__(self) -> None:
        super().__init__()
        self.recording = threading.Event()
        self.threads: set[str] = set()
        self.durable: set[str] = set()

    def record_progress(self, context: CommitContext) -> None:
        self.threads.add(threading.current_thread().name)
        if not self.recording.is_set():
            self.recording.set()
            self.stalled = not self.release.wait(10)
        if context.schema_snapshot:
            self.durable.update(schema.table for schema in snapshot_schemas(context.schema_snapshot))

    def recorded_watermarks(self, group: str) -> dict[TopicPartition, int]:
        return {}


class _CheckedSource(FileSource):
    """Notes each commit that moves past a BOOTSTRAP (offsets 0, 2, 4 teach tables a, b, c) whose schema no
    durable record of the sink holds: a member resuming there would never learn it."""

    def __init__(self, path: Path, sink: _GatedRecorder, listener: Pipeline) -> None:
        super().__init__(path, listener=listener)
        self.sink = sink
        self.unsafe: list[int] = []

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        for offset in offsets.values():
            taught = {"abc"[n // 2] for n in (0, 2, 4) if n < offset}
            if not taught <= self.sink.durable:
                self.unsafe.append(offset)
        super().commit(offsets)


TP = ("t", 0)


def test_progress_is_recorded_behind_the_writers_backlog_and_kafka_waits_for_the_schemas_it_holds(
    tmp_path: Path,
) -> None:
    """The writer's thread is held inside the first progress record, which holds the schemas of a, b and c.
    The loop goes on cycling (it used to wait for the writer, to record progress) and commits nothing to
    Kafka meanwhile: past offset 0 lies a BOOTSTRAP whose schema is not durable yet."""
    sink, stop = _GatedRecorder(), StopRequest()
    pipeline = _pipeline(tmp_path, sink, decode_workers=1)
    source = _CheckedSource(one_row_per_table(tmp_path / "c.jsonl", "abc"), sink, pipeline)
    held: list[int | None] = []

    def cycle(_: Pipeline) -> None:
        if sink.recording.is_set() and not sink.release.is_set():
            held.append(source.committed([TP])[TP])
            if len(held) == 3:
                sink.release.set()
        elif source.committed([TP])[TP] == 7:
            stop.request("all committed")

    try:
        pipeline.run(source, until_idle=20, on_cycle=cycle, stop=stop)
    finally:
        pipeline.close()
    assert not sink.stalled
    assert held == [None, None, None]
    assert source.unsafe == []
    assert source.committed([TP]) == {TP: 7}
    assert sink.threads == {"sink-writer_0"}
    assert sink.durable == {"a", "b", "c"}


def test_a_cycle_applies_for_its_time_then_polls_again(tmp_path: Path) -> None:
    """One watermark resolves the rows of a, b and c; with no time to apply, each cycle applies one unit and
    polls again (the group waits for a member that does not poll), and the run still applies them all."""
    seen: list[int] = []
    pipeline = _pipeline(tmp_path, _Sink(), apply_seconds=0.0)
    try:
        source = FileSource(one_row_per_table(tmp_path / "c.jsonl", "abc"), listener=pipeline)
        pipeline.run(source, until_idle=0.5, on_cycle=lambda p: seen.append(p.stats.rows))
    finally:
        pipeline.close()
    assert sorted(set(seen)) == [1, 2, 3]
    assert pipeline.stats.rows == 3


class _PauseLog(FileSource):
    def __init__(self, path: Path, listener: Pipeline) -> None:
        super().__init__(path, listener=listener)
        self.log: list[tuple[str, list[TopicPartition]]] = []

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self.log.append(("pause", sorted(partitions)))
        super().pause(partitions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self.log.append(("resume", sorted(partitions)))
        super().resume(partitions)


def test_while_more_than_a_cycles_rows_wait_to_be_applied_intake_pauses(tmp_path: Path) -> None:
    """A cycle's budget of one record: with the rows of b and c left to apply, the partition pauses (the
    loop polls on, taking nothing) and resumes once they are applied."""
    pipeline = _pipeline(tmp_path, _Sink(), apply_seconds=0.0, max_batch_records=1)
    try:
        source = _PauseLog(one_row_per_table(tmp_path / "c.jsonl", "abc"), pipeline)
        pipeline.run(source, until_idle=0.5)
    finally:
        pipeline.close()
    assert source.log == [("pause", [TP]), ("resume", [TP])]
    assert pipeline.stats.rows == 3


def _collector_during_run(tmp_path: Path, **options: object) -> list[bool]:
    enabled: list[bool] = []
    pipeline = _pipeline(tmp_path, _Sink(), **options)
    try:
        source = FileSource(one_row_per_table(tmp_path / "c.jsonl", "a"), listener=pipeline)
        pipeline.run(source, until_idle=0.2, on_cycle=lambda _: enabled.append(gc.isenabled()))
    finally:
        pipeline.close()
    assert pipeline.stats.rows == 1
    return enabled


def test_a_library_pipeline_leaves_the_garbage_collector_alone(tmp_path: Path) -> None:
    enabled = _collector_during_run(tmp_path)
    assert enabled and all(enabled)
    assert gc.isenabled()


def test_pause_gc_pauses_it_while_running_and_restores_it(tmp_path: Path) -> None:
    enabled = _collector_during_run(tmp_path, pause_gc=True)
    assert enabled and not any(enabled)
    assert gc.isenabled()


def test_the_run_command_pauses_the_collector(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paused: list[bool] = []
    real = gc.disable

    def disable() -> None:
        paused.append(True)
        real()

    monkeypatch.setattr(gc, "disable", disable)
    capture = one_row_per_table(tmp_path / "c.jsonl", "a")
    result = CliRunner().invoke(
        main,
        ["run", "--source", f"file:{capture}", "--sink", f"jsonl:{tmp_path / 'out'}", "--until-idle", "0.2"],
    )
    assert result.exit_code == 0, result.output
    assert "1 changelog rows" in result.output
    assert paused and gc.isenabled()
