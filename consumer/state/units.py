"""What the state machine hands a sink: ordered, typed units of work.

Units compare by identity: a sink confirms a unit by handing the same object back to
`ConsumerState.confirm`, so two batches with equal rows are still two units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from consumer.errors import DeadLetter, RecordLocation
from consumer.protocol.model import DDL, RawDML, TableSchema
from consumer.sources.record import TopicPartition

TableName = tuple[str, str]
SchemaKey = tuple[str, str, int]


def topic_partition(location: RecordLocation) -> TopicPartition:
    return (location.topic, location.partition)


@dataclass(frozen=True, slots=True)
class RowOrigins:
    """Where each row of a batch comes from, a column each, in the batch's order: the changelog's metadata
    columns and the offsets a batch applies are read from here without visiting every row object again
    (which, a cycle after they arrived, are no longer in the CPU's caches)."""

    commit_ts: list[int]
    schema_versions: list[int]
    topics: list[str]
    partitions: list[int]
    offsets: list[int]

    @classmethod
    def of(cls, rows: Sequence[tuple[RawDML, RecordLocation]]) -> RowOrigins:
        return cls(
            [raw.commit_ts for raw, _ in rows],
            [raw.schema_version for raw, _ in rows],
            [location.topic for _, location in rows],
            [location.partition for _, location in rows],
            [location.offset for _, location in rows],
        )

    def claim(self) -> dict[TopicPartition, list[int]]:
        """The rows' offsets per partition."""
        claim: dict[TopicPartition, list[int]] = {}
        for tp, offset in zip(zip(self.topics, self.partitions, strict=True), self.offsets, strict=True):
            offsets = claim.get(tp)
            if offsets is None:
                claim[tp] = [offset]
            else:
                offsets.append(offset)
        return claim


@dataclass(frozen=True, slots=True, eq=False)
class RowBatch:
    """Rows of one table version in (commit_ts, partition, offset) order; `schema` decodes every payload."""

    schema: TableSchema
    rows: tuple[tuple[RawDML, RecordLocation], ...]
    origins: RowOrigins


@dataclass(frozen=True, slots=True, eq=False)
class DDLUnit:
    """One DDL, once, although TiCDC broadcast a copy to every partition; `locations` are those copies."""

    ddl: DDL
    locations: tuple[RecordLocation, ...]


Unit = RowBatch | DDLUnit | DeadLetter
