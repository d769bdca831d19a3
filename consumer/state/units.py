"""What the state machine hands a sink: ordered, typed units of work.

Units compare by identity: a sink confirms a unit by handing the same object back to
`ConsumerState.confirm`, so two batches with equal rows are still two units.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

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


@dataclass(frozen=True, slots=True, eq=False)
class RowBlock:
    """One partition's rows of one schema version, typed before they reached the state machine (the Spark
    engine's executors): one item for it to order instead of one per row. It reads only the metadata, a
    column each in offset order; `rows` (the typed changelog rows) pass through it untouched, and
    `whole` says whether they are all the block's (else keep only those at `offsets`). `typed_by`: the
    schema that typed them, learned where it is not known (its BOOTSTRAP was before the records fed)."""

    key: SchemaKey
    table_id: int
    topic: str
    partition: int
    offsets: np.ndarray  # int64, ascending
    commit_ts: np.ndarray  # int64, per offset
    row_bytes: int  # what a row costs in memory: for the budget
    rows: Any
    whole: bool = True
    typed_by: TableSchema | None = None

    @property
    def tp(self) -> TopicPartition:
        return (self.topic, self.partition)

    def select(self, which: np.ndarray) -> RowBlock:
        """The block's rows at `which` (a mask or indexes)."""
        return RowBlock(
            self.key,
            self.table_id,
            self.topic,
            self.partition,
            self.offsets[which],
            self.commit_ts[which],
            self.row_bytes,
            self.rows,
            whole=False,
            typed_by=self.typed_by,
        )


@dataclass(frozen=True, slots=True, eq=False)
class BlockBatch:
    """Rows of one table version from `RowBlock`s, resolved together (their order within the batch is the
    rows' own: by commit ts, topic, partition and offset)."""

    schema: TableSchema
    blocks: tuple[RowBlock, ...]

    @property
    def row_count(self) -> int:
        return sum(len(block.offsets) for block in self.blocks)

    def claim(self) -> dict[TopicPartition, list[int]]:
        """The rows' offsets per partition."""
        claim: dict[TopicPartition, list[int]] = {}
        for block in self.blocks:
            claim.setdefault(block.tp, []).extend(block.offsets.tolist())
        return claim


Unit = RowBatch | BlockBatch | DDLUnit | DeadLetter
