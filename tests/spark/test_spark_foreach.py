"""ForeachBatchSink: user code gets each table batch as a typed DataFrame with where it came from."""

from __future__ import annotations

import pytest
from pyspark.sql import DataFrame, SparkSession

from consumer.batches.changes import TableChanges, table_changes
from consumer.errors import RecordLocation, SinkError
from consumer.protocol.model import DDL, Column, DataType, DDLType, DMLType, Index, TableSchema
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.foreach_batch import BatchInfo, ForeachBatchSink, TableName
from consumer.testing.messages import raw_dml

SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=1,
    version=4,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("qty", DataType("int", length=11)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
TS = 449512873440575500
CONTEXT = CommitContext(group="g", resolved_ts=TS + 100)


def inserts(ids_and_locations: list[tuple[int, int, int]]) -> TableChanges:
    """One INSERT per (id, partition, offset)."""
    rows = []
    for key, partition, offset in ids_and_locations:
        raw = raw_dml(SCHEMA, DMLType.INSERT, {"id": key, "qty": key * 10}, commit_ts=TS + key)
        rows.append((raw, RecordLocation("cdc", partition, offset)))
    return table_changes(TableCodec(SCHEMA), rows)


def test_each_batch_reaches_the_function_with_its_info(spark: SparkSession) -> None:
    seen: list[tuple[TableName, list[tuple[int, int]], BatchInfo]] = []

    def collect(table: TableName, frame: DataFrame, info: BatchInfo) -> None:
        seen.append((table, sorted((r.id, r.qty) for r in frame.collect()), info))

    ddls: list[DDLEvent] = []
    sink = ForeachBatchSink(spark, collect, on_ddl=ddls.append)
    sink.write(inserts([(1, 0, 10), (2, 1, 7), (3, 0, 12)]), CONTEXT)
    sink.write(inserts([(4, 1, 8)]), CONTEXT)
    ddl = DDL(type=DDLType.TRUNCATE, sql="TRUNCATE TABLE `orders`", commit_ts=TS + 50, build_ts=0)
    sink.apply_ddl(DDLEvent(ddl, "shop", "orders"), CONTEXT)

    assert seen == [
        (
            TableName("shop", "orders"),
            [(1, 10), (2, 20), (3, 30)],
            BatchInfo(0, TS + 100, 3, {("cdc", 0): (10, 12), ("cdc", 1): (7, 7)}),
        ),
        (TableName("shop", "orders"), [(4, 40)], BatchInfo(1, TS + 100, 1, {("cdc", 1): (8, 8)})),
    ]
    assert [event.ddl.type for event in ddls] == [DDLType.TRUNCATE]
    assert sink.recorded_offsets("g") == {} and sink.recorded_schema_snapshot() is None


def test_errors_of_user_code_become_sink_errors(spark: SparkSession) -> None:
    def fail(table: TableName, frame: DataFrame, info: BatchInfo) -> None:
        frame.selectExpr("assert_true(id < 0, 'ids are negative here')").collect()

    def refuse(event: DDLEvent) -> None:
        raise ValueError("no DDLs please")

    sink = ForeachBatchSink(spark, fail, on_ddl=refuse)
    with pytest.raises(SinkError, match=r"shop\.orders: .*ids are negative here") as failed:
        sink.write(inserts([(1, 0, 0)]), CONTEXT)
    assert failed.value.__cause__ is not None
    ddl = DDL(type=DDLType.ERASE, sql="DROP TABLE `orders`", commit_ts=TS, build_ts=0)
    with pytest.raises(SinkError, match="no DDLs please"):
        sink.apply_ddl(DDLEvent(ddl, "shop", "orders"), CONTEXT)
    ForeachBatchSink(spark, fail).apply_ddl(DDLEvent(ddl, "shop", "orders"), CONTEXT)  # no on_ddl: ignored
