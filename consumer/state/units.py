"""What the state machine hands a sink: ordered, typed units of work.

Units compare by identity: a sink confirms a unit by handing the same object back to
`ConsumerState.confirm`, so two batches with equal rows are still two units.
"""

from __future__ import annotations

from dataclasses import dataclass

from consumer.errors import RecordLocation
from consumer.protocol.model import DDL, RawDML, TableSchema

TopicPartition = tuple[str, int]
TableName = tuple[str, str]
SchemaKey = tuple[str, str, int]


def topic_partition(location: RecordLocation) -> TopicPartition:
    return (location.topic, location.partition)


@dataclass(frozen=True, slots=True, eq=False)
class RowBatch:
    """Rows of one table version in (commit_ts, partition, offset) order; `schema` decodes every payload."""

    schema: TableSchema
    rows: tuple[tuple[RawDML, RecordLocation], ...]


@dataclass(frozen=True, slots=True, eq=False)
class DDLUnit:
    """One DDL, once, although TiCDC broadcast a copy to every partition; `locations` are those copies."""

    ddl: DDL
    locations: tuple[RecordLocation, ...]


@dataclass(frozen=True, slots=True, eq=False)
class DeadLetter:
    """A record the error policy set aside: undecodable, or a row whose schema never arrived."""

    location: RecordLocation
    reason: str
    value: bytes | None


Unit = RowBatch | DDLUnit | DeadLetter
