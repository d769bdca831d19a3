"""Building a `Pipeline` reads nothing: what the sinks recorded is read when it is opened (by `run`, the
first assignment, or the Spark engine), once."""

from __future__ import annotations

from pathlib import Path

from consumer.batches.changes import TableChanges
from consumer.pipeline import Pipeline
from consumer.protocol.model import Column, DataType, Index, TableSchema
from consumer.sinks.base import CommitContext, DDLEvent, ProgressRecorder
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sources.record import TopicPartition
from consumer.state.machine import ConsumerState

SCHEMA = TableSchema(
    database="shop",
    table="a",
    table_id=1,
    version=7,
    columns=(Column("id", DataType("bigint", length=20), nullable=False),),
    indexes=(Index("primary", True, True, False, ("id",)),),
)


class _RecordsReads:
    """A sink keeping progress that notes every read of what it recorded: `SCHEMA`, partition ("t", 0)
    resuming at offset 12 and applied up to commit ts 40."""

    def __init__(self) -> None:
        self.reads: list[str] = []
        known = ConsumerState()
        known.learn_schemas([SCHEMA])
        self._snapshot = known.schemas.snapshot()

    def recorded_schema_snapshot(self) -> bytes | None:
        self.reads.append("schemas")
        return self._snapshot

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        self.reads.append(f"offsets of {group}")
        return {("t", 0): 12}

    def recorded_watermarks(self, group: str) -> dict[TopicPartition, int]:
        self.reads.append(f"watermarks of {group}")
        return {("t", 0): 40}

    def record_progress(self, context: CommitContext) -> None:
        raise AssertionError("nothing was applied")

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        raise AssertionError("nothing was applied")

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        raise AssertionError("nothing was applied")

    def close(self) -> None:
        return None


def _pipeline(tmp_path: Path, sink: _RecordsReads) -> Pipeline:
    return Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[sink],  # type: ignore[list-item]
        dead_letters=DeadLetterFile(tmp_path / "_dead_letters.jsonl"),
    )


def test_building_a_pipeline_reads_nothing_until_it_is_opened(tmp_path: Path) -> None:
    sink = _RecordsReads()
    assert isinstance(sink, ProgressRecorder)
    pipeline = _pipeline(tmp_path, sink)
    assert sink.reads == []
    assert pipeline.state.schemas.lookup(SCHEMA.key, SCHEMA.table_id) is None
    pipeline.open()
    assert sink.reads == ["schemas"]
    assert pipeline.state.schemas.lookup(SCHEMA.key, SCHEMA.table_id) == SCHEMA
    pipeline.open()
    assert sink.reads == ["schemas"]  # once


def test_the_first_assignment_opens_the_pipeline_then_reads_where_to_resume(tmp_path: Path) -> None:
    sink = _RecordsReads()
    pipeline = _pipeline(tmp_path, sink)
    assert pipeline.on_assign([("t", 0), ("t", 1)]) == {("t", 0): 12}
    assert sink.reads == ["schemas", "schemas", "offsets of g", "watermarks of g"]
    assert pipeline.state.partition_states()[("t", 0)].watermark == 40
