"""One rebalance listener per source: start offsets it returns position the source, revocation and loss
reach it, and a `Pipeline` is one (resuming where its sinks recorded)."""

from __future__ import annotations

from pathlib import Path

from consumer.batches.changes import TableChanges
from consumer.pipeline import Pipeline
from consumer.protocol.codec import MessageEncoder
from consumer.protocol.model import DML, Bootstrap, Column, DataType, DMLType, Index, TableSchema, Watermark
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sources.base import FixedStarts, RebalanceListener
from consumer.sources.capture import write_capture
from consumer.sources.files import FileSource
from consumer.sources.kafka import KafkaSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.state.machine import ConsumerState
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory

TS = 449512873440575500


def _schema(table: str, table_id: int) -> TableSchema:
    return TableSchema(
        database="shop",
        table=table,
        table_id=table_id,
        version=1,
        columns=(Column("id", DataType("bigint", length=20), nullable=False),),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )


def _capture(path: Path) -> Path:
    """Partition ("t", 0): for tables a, b, c a BOOTSTRAP and one row each (offsets 0-5), then a WATERMARK."""
    encoder = MessageEncoder()
    values = []
    for n, table in enumerate("abc", start=1):
        schema = _schema(table, n)
        row = DML(
            type=DMLType.INSERT,
            database="shop",
            table=table,
            table_id=n,
            commit_ts=TS + n,
            build_ts=0,
            schema_version=1,
            data={"id": n},
        )
        values += [encoder.encode(Bootstrap(table_schema=schema, build_ts=0)), encoder.encode(row, schema)]
    values.append(encoder.encode(Watermark(commit_ts=TS + 100, build_ts=0)))
    with path.open("wb") as fp:
        write_capture((SourceRecord("t", 0, offset, value=v) for offset, v in enumerate(values)), fp)
    return path


class _Events(RebalanceListener):
    """Notes what it is told; inherits `on_lost`."""

    def __init__(self, starts: dict[TopicPartition, int] | None = None) -> None:
        self.starts = starts
        self.events: list[tuple[str, list[TopicPartition]]] = []

    def on_assign(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int] | None:
        self.events.append(("assign", partitions))
        return self.starts

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self.events.append(("revoke", partitions))


class _ResumingSink:
    """A sink that recorded, in an earlier run, that partition ("t", 0) resumes at offset 4 (table c)."""

    def __init__(self) -> None:
        self.written: list[tuple[str, list[int]]] = []

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        self.written.append((changes.table, changes.changelog["_offset"].to_pylist()))

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        raise AssertionError("the stream has no DDL")

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {("t", 0): 4}

    def recorded_schema_snapshot(self) -> bytes | None:
        return None

    def close(self) -> None:
        return None


def test_a_file_source_starts_where_its_listener_says(tmp_path: Path) -> None:
    listener = _Events(starts={("t", 0): 5, ("gone", 0): 1})  # a partition the file lacks is ignored
    source = FileSource(_capture(tmp_path / "c.jsonl"), listener=listener)
    assert listener.events == [("assign", [("t", 0)])]
    assert [record.offset for record in source.poll_batch(10, timeout=0)] == [5, 6]


def test_fixed_starts_override_the_listener_they_forward_to(tmp_path: Path) -> None:
    inner = _Events(starts={("t", 0): 1})
    listener = FixedStarts({("t", 0): 3}, then=inner)
    source = FileSource(_capture(tmp_path / "c.jsonl"), listener=listener)
    assert [record.offset for record in source.poll_batch(10, timeout=0)] == [3, 4, 5, 6]
    listener.on_revoke([("t", 0)])
    listener.on_lost([("t", 1)])
    assert inner.events == [("assign", [("t", 0)]), ("revoke", [("t", 0)]), ("revoke", [("t", 1)])]


def test_losing_partitions_is_revoking_them_unless_the_listener_says_otherwise() -> None:
    listener = _Events()
    listener.on_lost([("t", 2)])
    assert listener.events == [("revoke", [("t", 2)])]


def test_a_pipeline_listening_to_a_file_source_resumes_where_its_sink_recorded(tmp_path: Path) -> None:
    sink = _ResumingSink()
    pipeline = Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[sink],  # type: ignore[list-item]
        dead_letters=DeadLetterFile(tmp_path / "_dead_letters.jsonl"),
    )
    try:
        source = FileSource(_capture(tmp_path / "c.jsonl"), listener=pipeline)
        assert set(pipeline.state.partition_states()) == {("t", 0)}
        stats = pipeline.run(source, until_idle=0.2)
        assert sink.written == [("c", [5])]  # a and b were applied by the earlier run
        assert stats.rows_by_table == {"shop.c": 1}
        pipeline.on_lost([("t", 0)])  # a lost partition's state goes, as a revoked one's
        assert pipeline.state.partition_states() == {}
    finally:
        pipeline.close()


def test_leaving_the_group_revokes_the_listener_s_partitions(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(partitions=2)
    listener = _Events()
    source = KafkaSource(
        kafka_broker.bootstrap_servers,
        [topic],
        f"{topic}.listener",
        config={"session.timeout.ms": 1000, "heartbeat.interval.ms": 100},
        listener=listener,
    )
    try:
        for _ in range(100):
            if source.assignment():
                break
            source.poll_batch(10, timeout=0.1)
        assert listener.events == [("assign", [(topic, 0), (topic, 1)])]
    finally:
        source.close()
    assert listener.events[1:] == [("revoke", [(topic, 0), (topic, 1)])]
