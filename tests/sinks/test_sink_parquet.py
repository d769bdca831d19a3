"""The Parquet changelog sink: manifest-committed files, idempotent replays, crash recovery, DDLs through the
shared lakehouse catalog and log."""

from __future__ import annotations

import datetime as dt
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
from pyarrow.fs import LocalFileSystem
from pyspark.sql import DataFrame, SparkSession

from consumer.batches.changes import TableChanges, table_changes
from consumer.batches.frames import spark_schema
from consumer.errors import RecordLocation, SinkError
from consumer.lakehouse.manifest import read_manifest
from consumer.lakehouse.tables import table_uri
from consumer.protocol.model import DDL, Column, DataType, DDLType, DMLType, Index, TableSchema
from consumer.protocol.table import TableCodec
from consumer.simulate.workload import _ALL_TYPES_COLUMNS, _random_value
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.parquet import ParquetSink, fresh_files
from consumer.spark.readers import read_changelog, read_ddl_log
from consumer.testing.messages import raw_dml

ORDERS = TableSchema(
    database="shop",
    table="orders",
    table_id=1,
    version=10,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("qty", DataType("int", length=11)),
        Column("spent", DataType("time", length=10)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
TS = 449512873440575500
CONTEXT = CommitContext(group="g", resume_offsets={("cdc", 0): 3}, resolved_ts=TS, schema_snapshot=b"v1")

Change = tuple[DMLType, dict[str, Any] | None, dict[str, Any] | None]


def batch(schema: TableSchema, changes: list[Change], *, partition: int = 0, offset: int = 0) -> TableChanges:
    """Consecutive records of one partition, from `offset` on, one commit_ts each."""
    rows = []
    for index, (kind, data, old) in enumerate(changes):
        raw = raw_dml(schema, kind, data, old, commit_ts=TS + offset + index)
        rows.append((raw, RecordLocation("cdc", partition, offset + index)))
    return table_changes(TableCodec(schema), rows)


def inserts(first_id: int, count: int) -> list[Change]:
    return [
        (DMLType.INSERT, {"id": i, "qty": i * 10, "spent": None}, None)
        for i in range(first_id, first_id + count)
    ]


def ordered(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(rows, key=lambda r: (r["_partition"], r["_offset"], r["_change_type"]))


def rows_of(frame: DataFrame) -> list[dict[str, Any]]:
    return ordered(frame.toArrow().to_pylist())


def expected(*batches: TableChanges) -> list[dict[str, Any]]:
    return ordered([row for b in batches for row in b.changelog.to_pylist()])


def ddl_event(kind: DDLType, sql: str, schema: TableSchema, commit_ts: int) -> DDLEvent:
    ddl = DDL(type=kind, sql=sql, commit_ts=commit_ts, build_ts=0, table_schema=schema)
    return DDLEvent(ddl, schema.database, schema.table)


def test_reader_returns_exactly_the_written_changelog(spark: SparkSession, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    first = batch(
        ORDERS,
        [
            (DMLType.INSERT, {"id": 1, "qty": 1, "spent": dt.timedelta(hours=-838)}, None),
            (DMLType.UPDATE, {"id": 1, "qty": 2, "spent": None}, {"id": 1, "qty": 1, "spent": None}),
            (DMLType.DELETE, None, {"id": 1, "qty": 2, "spent": None}),
        ],
    )
    second = batch(ORDERS, inserts(5, 2), partition=1, offset=40)
    sink.write(first, CONTEXT)
    sink.write(second, CONTEXT)
    frame = read_changelog(spark, tmp_path, "shop", "orders", format="parquet")
    assert rows_of(frame) == expected(first, second)
    assert [f.name for f in frame.schema.fields] == first.changelog.column_names
    manifest = read_manifest(str(tmp_path / "shop" / "orders" / "changelog"), LocalFileSystem())
    assert manifest is not None and len(manifest.files) == 2
    assert manifest.next_offsets == [("cdc", 0, 3), ("cdc", 1, 42)]


def test_replayed_rows_are_skipped(spark: SparkSession, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    first = batch(ORDERS, inserts(1, 3))
    sink.write(first, CONTEXT)
    manifest = tmp_path / "shop" / "orders" / "changelog" / "_manifest.json"
    committed = manifest.read_bytes()
    restarted = ParquetSink(tmp_path)
    restarted.write(first, CONTEXT)  # a restarted consumer re-reads the same records
    restarted.write(batch(ORDERS, []), CONTEXT)
    assert manifest.read_bytes() == committed
    overlapping = batch(ORDERS, inserts(2, 4), offset=1)  # offsets 1, 2 applied; 3, 4 new
    sink.write(overlapping, CONTEXT)
    frame = read_changelog(spark, tmp_path, "shop", "orders", format="parquet")
    assert [(r["id"], r["_offset"]) for r in rows_of(frame)] == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]


def test_files_of_a_crash_before_the_manifest_are_ignored_then_rewritten(
    spark: SparkSession, tmp_path: Path
) -> None:
    sink = ParquetSink(tmp_path)
    committed = batch(ORDERS, inserts(1, 2))
    sink.write(committed, CONTEXT)
    lost = batch(ORDERS, inserts(3, 2), offset=2)
    directory = tmp_path / "shop" / "orders" / "changelog"
    job = sink._job(str(directory), sink._manifest(str(directory)), lost)
    orphans = [name for name, _ in fresh_files(job, lost.changelog).files]  # the first commit step: it dies
    assert orphans and all((directory / name).exists() for name in orphans)
    assert rows_of(read_changelog(spark, tmp_path, "shop", "orders", format="parquet")) == expected(committed)

    restarted = ParquetSink(tmp_path)
    restarted.write(lost, CONTEXT)  # the replay
    assert not any((directory / name).exists() for name in orphans)
    frame = read_changelog(spark, tmp_path, "shop", "orders", format="parquet")
    assert rows_of(frame) == expected(committed, lost)


def test_recorded_offsets_and_schema_snapshot_survive_a_restart(spark: SparkSession, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    assert sink.recorded_offsets("g") == {} and sink.recorded_schema_snapshot() is None
    # the name would be a glob pattern to Spark if the layout did not escape it
    customers = msgspec.structs.replace(ORDERS, table="customers [eu]*", table_id=2)
    sink.write(batch(ORDERS, inserts(1, 1)), CONTEXT)
    sink.write(batch(customers, inserts(1, 1), offset=8), CONTEXT)
    snapshot = msgspec.msgpack.encode([ORDERS, customers])
    sink.record_progress(CommitContext("g", {("cdc", 0): 9, ("cdc", 1): 4}, TS + 9, snapshot))
    restarted = ParquetSink(tmp_path)
    assert restarted.recorded_offsets("g") == {("cdc", 0): 9, ("cdc", 1): 4}
    assert restarted.recorded_offsets("other") == {}
    assert restarted.recorded_schema_snapshot() == snapshot
    assert read_changelog(spark, tmp_path, "shop", "customers [eu]*", format="parquet").count() == 1


@pytest.mark.parametrize(
    "sql", ["RENAME TABLE `orders` TO `orders_renamed`", "RENAME TABLE shop.orders TO orders_renamed"]
)
def test_rename_renames_the_table_and_its_replayed_rows_follow(
    spark: SparkSession, tmp_path: Path, sql: str
) -> None:
    sink = ParquetSink(tmp_path)
    before = batch(ORDERS, inserts(1, 2))
    sink.write(before, CONTEXT)
    renamed = msgspec.structs.replace(ORDERS, table="orders_renamed")
    rename = ddl_event(DDLType.RENAME, sql, renamed, TS + 5)
    sink.apply_ddl(rename, CONTEXT)
    assert table_uri(tmp_path, "shop", "orders", "changelog") is None  # the old name is gone
    after = batch(renamed, inserts(3, 1), offset=6)
    sink.write(after, CONTEXT)

    restarted = ParquetSink(tmp_path)  # replays from before the rename
    restarted.write(before, CONTEXT)
    restarted.apply_ddl(rename, CONTEXT)
    frame = read_changelog(spark, tmp_path, "shop", "orders_renamed", format="parquet")
    assert rows_of(frame) == expected(before, after)
    log = read_ddl_log(spark, tmp_path).collect()
    assert [(r.type, r.database, r.table, r.commit_ts) for r in log] == [
        ("RENAME", "shop", "orders_renamed", TS + 5)
    ]


def test_rename_onto_an_existing_table_is_refused(spark: SparkSession, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    other = msgspec.structs.replace(ORDERS, table="archive", table_id=3)
    sink.write(batch(ORDERS, inserts(1, 1)), CONTEXT)
    sink.write(batch(other, inserts(1, 1), offset=1), CONTEXT)
    with pytest.raises(SinkError, match="already holds a live table"):
        sink.apply_ddl(
            ddl_event(DDLType.RENAME, "RENAME TABLE `orders` TO `archive`", other, TS + 5), CONTEXT
        )


def test_truncate_is_logged_and_schema_versions_are_merged(spark: SparkSession, tmp_path: Path) -> None:
    sink = ParquetSink(tmp_path)
    old = batch(ORDERS, inserts(1, 1))
    sink.write(old, CONTEXT)
    sink.apply_ddl(ddl_event(DDLType.TRUNCATE, "TRUNCATE TABLE `orders`", ORDERS, TS + 1), CONTEXT)
    note = Column("note", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=64))
    wider = msgspec.structs.replace(ORDERS, version=11, columns=(*ORDERS.columns, note))
    sink.apply_ddl(ddl_event(DDLType.ALTER, "ALTER TABLE `orders` ADD COLUMN `note`", wider, TS + 2), CONTEXT)
    new = batch(wider, [(DMLType.INSERT, {"id": 2, "qty": 3, "spent": None, "note": "hi"}, None)], offset=3)
    sink.write(new, CONTEXT)

    frame = read_changelog(spark, tmp_path, "shop", "orders", format="parquet")
    got = [(r["id"], r["note"], r["_schema_version"]) for r in rows_of(frame)]
    assert got == [(1, None, 10), (2, "hi", 11)]  # the truncate removed nothing from the history
    log = sorted(read_ddl_log(spark, tmp_path).collect(), key=lambda r: r.commit_ts)
    assert [(r.type, r.schema_version) for r in log] == [("TRUNCATE", 10), ("ALTER", 11)]


def test_every_type_round_trips_exactly(spark: SparkSession, tmp_path: Path) -> None:
    rng = random.Random(7)
    key = Column("id", DataType("bigint", length=20), nullable=False)
    schema = TableSchema("db", "all_types", 7, 1, (key, *_ALL_TYPES_COLUMNS), ORDERS.indexes)
    rows = [{"id": i} | {c.name: _random_value(c, rng) for c in _ALL_TYPES_COLUMNS} for i in range(50)]
    changes = batch(schema, [(DMLType.INSERT, row, None) for row in rows])
    ParquetSink(tmp_path).write(changes, CONTEXT)
    frame = read_changelog(spark, tmp_path, "db", "all_types", format="parquet")
    # Spark reads every Parquet column (and array element) as nullable; the types themselves are kept
    assert frame.schema.simpleString() == spark_schema(changes.changelog.schema).simpleString()
    assert rows_of(frame) == expected(changes)
