"""Hand each resolved batch to user code as a Spark DataFrame, like Structured Streaming's foreachBatch.

The function sees one table's batch at a time, typed, with where it came from; it must be durable when it
returns (the pipeline then confirms the batch). Offsets, not batch ids, identify a batch across restarts:
batch ids count from 0 in each process, while the offset ranges are the same on a replay.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pyspark.sql import DataFrame, SparkSession

from consumer.batches.changes import TableChanges
from consumer.batches.frames import offset_ranges, to_dataframe
from consumer.errors import SinkError
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sources.record import TopicPartition


@dataclass(frozen=True)
class TableName:
    database: str
    table: str


@dataclass(frozen=True)
class BatchInfo:
    """`offsets`: per (topic, partition), the first and last offset (inclusive) the batch's rows came from."""

    batch_id: int
    resolved_ts: int
    row_count: int
    offsets: dict[TopicPartition, tuple[int, int]]


BatchFunction = Callable[[TableName, DataFrame, BatchInfo], None]
DDLFunction = Callable[[DDLEvent], None]


class ForeachBatchSink:
    """Calls `fn(table, df, info)` per table batch and `on_ddl(event)` per DDL; their errors become SinkError.

    It records no progress itself: resume offsets come from Kafka commits, so `fn` should be idempotent
    for replayed offset ranges.
    """

    def __init__(self, spark: SparkSession, fn: BatchFunction, on_ddl: DDLFunction | None = None) -> None:
        self.spark = spark
        self.fn = fn
        self.on_ddl = on_ddl
        self._batch_ids = itertools.count()

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        info = BatchInfo(
            batch_id=next(self._batch_ids),
            resolved_ts=context.resolved_ts,
            row_count=changes.changelog.num_rows,
            offsets=offset_ranges(changes),
        )
        frame = to_dataframe(self.spark, changes)
        name = TableName(changes.database, changes.table)
        try:
            self.fn(name, frame, info)
        except Exception as exc:
            raise SinkError(f"foreachBatch function failed on {name.database}.{name.table}: {exc}") from exc

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        if self.on_ddl is None:
            return
        try:
            self.on_ddl(event)
        except Exception as exc:
            raise SinkError(
                f"DDL function failed on {event.ddl.type.value} {event.ddl.sql!r}: {exc}"
            ) from exc

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {}

    def recorded_schema_snapshot(self) -> bytes | None:
        return None

    def close(self) -> None:
        return None
