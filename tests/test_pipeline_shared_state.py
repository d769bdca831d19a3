"""What a pipeline shares with other threads and with its process: totals the writer thread never touches,
and the garbage collector left alone unless asked."""

from __future__ import annotations

import gc
import threading
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
from consumer.stopping import StopRequest


class _GatedSink:
    """Holds the writer thread inside its write of table `b` until released; says when it reached `c`."""

    def __init__(self) -> None:
        self.in_b, self.release, self.in_c = threading.Event(), threading.Event(), threading.Event()

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        if changes.table == "b":
            self.in_b.set()
            self.release.wait(30)
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
