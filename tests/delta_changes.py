"""Delta sink inputs shared by the sink and lakehouse tests: one `orders` table, its changes and DDLs."""

from __future__ import annotations

from typing import Any

import msgspec

from consumer.batches.changes import TableChanges, table_changes
from consumer.errors import RecordLocation
from consumer.protocol.model import DDL, Column, DataType, DDLType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.testing.messages import raw_dml

TS = 449512873440575500
SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=1,
    version=5,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("name", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=32)),
        Column("qty", DataType("int", length=11)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
KV = TableSchema(
    database="shop",
    table="kv",
    table_id=7,
    version=1,
    columns=(Column("id", DataType("bigint"), nullable=False), Column("v", DataType("varchar", length=8))),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
CONTEXT = CommitContext(group="g", resume_offsets={("t", 0): 3}, resolved_ts=TS, schema_snapshot=b"cache-1")


def raw_change(
    kind: DMLType, ts: int, data: dict | None = None, old: dict | None = None, schema: TableSchema = SCHEMA
) -> RawDML:
    return raw_dml(schema, kind, data, old, commit_ts=ts)


def table_batch(rows: list[tuple[RawDML, int, int]], schema: TableSchema = SCHEMA) -> TableChanges:
    """rows: (raw, partition, offset)."""
    located = [(raw, RecordLocation("t", partition, offset)) for raw, partition, offset in rows]
    return table_changes(TableCodec(schema), located)


def insert_row(
    key: int, ts: int, offset: int, partition: int = 0, schema: TableSchema = SCHEMA, **values: Any
) -> tuple[RawDML, int, int]:
    return (
        raw_change(DMLType.INSERT, ts, {"id": key, "name": f"n{key}", "qty": 1, **values}, schema=schema),
        partition,
        offset,
    )


def update_row(key: int, ts: int, offset: int, qty: int, partition: int = 0) -> tuple[RawDML, int, int]:
    old, new = {"id": key, "name": f"n{key}", "qty": 0}, {"id": key, "name": f"n{key}", "qty": qty}
    return raw_change(DMLType.UPDATE, ts, new, old), partition, offset


def delete_row(key: int, ts: int, offset: int, partition: int = 0) -> tuple[RawDML, int, int]:
    return raw_change(DMLType.DELETE, ts, old={"id": key, "name": f"n{key}", "qty": 1}), partition, offset


def ddl_event(kind: DDLType, sql: str, ts: int, schema: TableSchema | None = SCHEMA) -> DDLEvent:
    ddl = DDL(type=kind, sql=sql, commit_ts=ts, build_ts=0, table_schema=schema)
    return DDLEvent(ddl, schema.database if schema else None, schema.table if schema else None)


def evolved_schema(version: int, *columns: Column, table: str = "orders") -> TableSchema:
    return msgspec.structs.replace(SCHEMA, version=version, columns=columns, table=table)
