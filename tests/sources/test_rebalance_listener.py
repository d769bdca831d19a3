"""One rebalance listener per source: start offsets it returns position the source, revocation and loss
reach it, and a `Pipeline` is one (resuming where its sinks recorded)."""

from __future__ import annotations

from pathlib import Path

from captures import one_row_per_table

from consumer.batches.changes import TableChanges
from consumer.pipeline import Pipeline
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sources.base import FixedStarts, RebalanceListener
from consumer.sources.files import FileSource
from consumer.sources.kafka import KafkaSource
from consumer.sources.record import TopicPartition
from consumer.state.machine import ConsumerState
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory


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
    source = FileSource(one_row_per_table(tmp_path / "c.jsonl", "abc"), listener=listener)
    assert listener.events == [("assign", [("t", 0)])]
    assert [record.offset for record in source.poll_batch(10, timeout=0)] == [5, 6]


def test_fixed_starts_override_the_listener_they_forward_to(tmp_path: Path) -> None:
    inner = _Events(starts={("t", 0): 1})
    listener = FixedStarts({("t", 0): 3}, then=inner)
    source = FileSource(one_row_per_table(tmp_path / "c.jsonl", "abc"), listener=listener)
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
        source = FileSource(one_row_per_table(tmp_path / "c.jsonl", "abc"), listener=pipeline)
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
