"""The Delta sink on real Delta tables: exactly-once changelog, mirror MERGE rules, DDLs, recorded progress,
and concurrent writers."""

from __future__ import annotations

import datetime as dt
import logging
import multiprocessing
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from deltalake import DeltaTable

from consumer.batches.changes import TableChanges, table_changes
from consumer.errors import RecordLocation, SinkError
from consumer.protocol.model import DDL, Column, DataType, DDLType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.rows import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.delta import DeltaSink, consistent_ts, dropped_at, live_mirror
from consumer.sinks.layout import table_dir
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
CONTEXT = CommitContext(group="g", resume_offsets={("t", 0): 3}, resolved_ts=TS, schema_snapshot=b"cache-1")


# -- building batches ----------------------------------------------------------------------------------
def _raw(
    kind: DMLType, ts: int, data: dict | None = None, old: dict | None = None, schema: TableSchema = SCHEMA
) -> RawDML:
    raw = raw_dml(schema, kind, data, old, commit_ts=ts)
    return raw


def _changes(rows: list[tuple[RawDML, int, int]], schema: TableSchema = SCHEMA) -> TableChanges:
    """rows: (raw, partition, offset)."""
    located = [(raw, RecordLocation("t", partition, offset)) for raw, partition, offset in rows]
    return table_changes(TableCodec(schema), located)


def _insert(
    key: int, ts: int, offset: int, partition: int = 0, schema: TableSchema = SCHEMA, **values: Any
) -> tuple[RawDML, int, int]:
    return (
        _raw(DMLType.INSERT, ts, {"id": key, "name": f"n{key}", "qty": 1, **values}, schema=schema),
        partition,
        offset,
    )


def _update(key: int, ts: int, offset: int, qty: int, partition: int = 0) -> tuple[RawDML, int, int]:
    old, new = {"id": key, "name": f"n{key}", "qty": 0}, {"id": key, "name": f"n{key}", "qty": qty}
    return _raw(DMLType.UPDATE, ts, new, old), partition, offset


def _delete(key: int, ts: int, offset: int, partition: int = 0) -> tuple[RawDML, int, int]:
    return _raw(DMLType.DELETE, ts, old={"id": key, "name": f"n{key}", "qty": 1}), partition, offset


def _ddl(kind: DDLType, sql: str, ts: int, schema: TableSchema | None = SCHEMA) -> DDLEvent:
    ddl = DDL(type=kind, sql=sql, commit_ts=ts, build_ts=0, table_schema=schema)
    return DDLEvent(ddl, schema.database if schema else None, schema.table if schema else None)


def _evolved(version: int, *columns: Column, table: str = "orders") -> TableSchema:
    return msgspec.structs.replace(SCHEMA, version=version, columns=columns, table=table)


# -- reading results -----------------------------------------------------------------------------------
def _rows(path: Path) -> list[dict[str, Any]]:
    return DeltaTable(str(path)).to_pyarrow_table().to_pylist()


def _mirror(root: Path, table: str = "orders") -> dict[int, dict[str, Any]]:
    return {row["id"]: row for row in live_mirror(root / "shop" / table / "mirror").to_pylist()}


def _changelog(root: Path, table: str = "orders") -> list[dict[str, Any]]:
    return sorted(_rows(root / "shop" / table / "changelog"), key=lambda r: (r["_partition"], r["_offset"]))


# -- changelog -----------------------------------------------------------------------------------------
def test_changelog_appends_once_and_a_replay_adds_nothing(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="changelog")
    first = _changes([_insert(1, TS, 0), _insert(2, TS, 1), _insert(3, TS, 0, partition=1)])
    sink.write(first, CONTEXT)
    table = DeltaTable(str(tmp_path / "shop/orders/changelog"))
    assert table.transaction_version("ticdc:g:t:0") == 2 and table.transaction_version("ticdc:g:t:1") == 1

    sink.write(first, CONTEXT)  # a replay after a crash: nothing new
    overlapping = _changes([_insert(2, TS, 1), _update(2, TS + 1, 2, qty=5), _insert(3, TS, 0, partition=1)])
    sink.write(overlapping, CONTEXT)  # offset 1 and partition 1 were written; offset 2 is new

    rows = _changelog(tmp_path)
    assert [(r["_partition"], r["_offset"], r["_change_type"]) for r in rows] == [
        (0, 0, "insert"),
        (0, 1, "insert"),
        (0, 2, "update_preimage"),
        (0, 2, "update_postimage"),
        (1, 0, "insert"),
    ]
    assert DeltaTable(str(tmp_path / "shop/orders/changelog")).version() == 1  # the replay never committed
    assert not (tmp_path / "shop/orders/mirror").exists()


def test_every_commit_records_the_context(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    for kind in ("changelog", "mirror"):
        info = DeltaTable(str(tmp_path / "shop/orders" / kind)).history(1)[0]
        assert info["ticdc.group"] == "g" and info["ticdc.resolved_ts"] == str(TS)
        assert info["ticdc.resume_offsets"] == '{"t:0": 3}' and info["ticdc.schema_cache"] == "Y2FjaGUtMQ=="


def test_time_columns_are_stored_as_microseconds(tmp_path: Path) -> None:
    schema = _evolved(5, *SCHEMA.columns, Column("took", DataType("time", length=10)))
    sink = DeltaSink(tmp_path)
    sink.write(
        _changes([_insert(1, TS, 0, schema=schema, took=dt.timedelta(hours=-2, seconds=1))], schema), CONTEXT
    )
    mirror = tmp_path / "shop" / "orders" / "mirror"
    assert DeltaTable(str(mirror)).to_pyarrow_table()["took"].to_pylist() == [-7_199_000_000]
    assert _mirror(tmp_path)[1]["took"] == dt.timedelta(hours=-2, seconds=1)  # given back as a duration


# -- mirror --------------------------------------------------------------------------------------------
def test_mirror_follows_inserts_updates_deletes_and_key_changes(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    sink.write(
        _changes([_insert(1, TS, 0), _insert(2, TS, 1), _insert(3, TS, 2), _update(1, TS + 1, 3, qty=7)]),
        CONTEXT,
    )
    # a primary-key change arrives as DELETE + INSERT with one commit ts
    sink.write(_changes([_delete(2, TS + 2, 4), _insert(20, TS + 2, 5), _delete(3, TS + 3, 6)]), CONTEXT)
    mirror = _mirror(tmp_path)
    assert {k: (r["name"], r["qty"]) for k, r in mirror.items()} == {1: ("n1", 7), 20: ("n20", 1)}
    assert set(mirror[1]) == {"id", "name", "qty", "_commit_ts", "_schema_version"}
    assert (mirror[1]["_commit_ts"], mirror[20]["_commit_ts"], mirror[1]["_schema_version"]) == (
        TS + 1,
        TS + 2,
        5,
    )


def test_mirror_ignores_stale_changes_and_inserts_updates_of_unknown_keys(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    sink.write(_changes([_update(1, TS + 10, 0, qty=10)]), CONTEXT)  # joined mid-stream: never saw the INSERT
    sink.write(_changes([_update(1, TS + 5, 0, qty=5, partition=1)]), CONTEXT)  # older: ignored
    sink.write(_changes([_delete(1, TS + 4, 1, partition=1)]), CONTEXT)  # older delete: ignored
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items()} == {1: 10}
    sink.write(_changes([_delete(1, TS + 10, 1)]), CONTEXT)  # same commit ts, later offset: applies
    assert _mirror(tmp_path) == {}


def test_mirror_replay_is_skipped(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    batch = _changes([_insert(1, TS, 0), _update(1, TS + 1, 1, qty=3)])
    sink.write(batch, CONTEXT)
    sink.write(_changes([_delete(1, TS + 2, 2)]), CONTEXT)
    sink.write(batch, CONTEXT)  # replayed: the row must not come back (the mirror keeps no tombstones)
    assert _mirror(tmp_path) == {}
    assert DeltaTable(str(tmp_path / "shop/orders/mirror")).transaction_version("ticdc:g:t:0") == 3


def test_table_without_key_gets_a_changelog_and_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    schema = msgspec.structs.replace(SCHEMA, indexes=())
    sink = DeltaSink(tmp_path)
    with caplog.at_level(logging.WARNING, "consumer.sinks.delta"):
        sink.write(_changes([_insert(1, TS, 0, schema=schema)], schema), CONTEXT)
        sink.write(_changes([_insert(2, TS, 1, schema=schema)], schema), CONTEXT)
    assert len(_changelog(tmp_path)) == 2 and not (tmp_path / "shop/orders/mirror").exists()
    assert [r.getMessage() for r in caplog.records] == [
        "shop.orders has no primary key or NOT NULL unique index: no mirror, changelog only"
    ]


# -- DDL -----------------------------------------------------------------------------------------------
def test_add_column_evolves_both_tables_and_earlier_rows_are_null(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    v6 = _evolved(6, *SCHEMA.columns, Column("note", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=8)))
    add = _ddl(DDLType.ALTER, "ALTER TABLE orders ADD COLUMN note varchar(8)", TS + 1, v6)
    sink.apply_ddl(add, CONTEXT)
    sink.apply_ddl(add, CONTEXT)  # a replay changes nothing
    for kind in ("changelog", "mirror"):
        assert "note" in DeltaTable(str(tmp_path / "shop/orders" / kind)).schema().to_arrow().names
    sink.write(_changes([_insert(2, TS + 2, 1, schema=v6, note="hi")], v6), CONTEXT)
    assert [(r["id"], r["note"]) for r in _changelog(tmp_path)] == [(1, None), (2, "hi")]
    assert {k: r["note"] for k, r in _mirror(tmp_path).items()} == {1: None, 2: "hi"}


def test_drop_column_keeps_it_in_delta_and_null_from_then_on(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0, qty=4), _insert(3, TS, 1), _delete(3, TS, 2)]), CONTEXT)
    v6 = _evolved(6, *SCHEMA.columns[:2])
    sink.apply_ddl(_ddl(DDLType.ALTER, "ALTER TABLE orders DROP COLUMN qty", TS + 1, v6), CONTEXT)
    raw = _raw(DMLType.INSERT, TS + 2, {"id": 2, "name": "n2"}, schema=v6)
    sink.write(_changes([(raw, 0, 3)], v6), CONTEXT)
    changelog = [(r["id"], r["_change_type"], r["qty"]) for r in _changelog(tmp_path)]
    assert changelog == [(1, "insert", 4), (3, "insert", 1), (3, "delete", 1), (2, "insert", None)]  # history
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items()} == {1: None, 2: None}  # the column is gone
    tombstone = DeltaTable(str(tmp_path / "shop/orders/mirror")).to_pyarrow_table(filters=[("id", "=", 3)])
    assert tombstone["_deleted"].to_pylist() == [True]  # not mistaken for a dropped user column


def test_widening_modify_keeps_the_delta_type_while_values_fit(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0, qty=1)]), CONTEXT)
    widened = _evolved(6, *SCHEMA.columns[:2], Column("qty", DataType("bigint", length=20)))
    sink.apply_ddl(_ddl(DDLType.ALTER, "ALTER TABLE orders MODIFY qty bigint", TS + 1, widened), CONTEXT)
    sink.write(_changes([_insert(2, TS + 2, 1, schema=widened, qty=2**31 - 1)], widened), CONTEXT)
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items()} == {1: 1, 2: 2**31 - 1}
    with pytest.raises(SinkError, match="'qty': int64 values do not fit its Delta type int32"):
        sink.write(_changes([_insert(3, TS + 3, 2, schema=widened, qty=2**40)], widened), CONTEXT)
    assert len(_changelog(tmp_path)) == 2


def test_float_to_double_fits_only_exact_values(tmp_path: Path) -> None:
    v5 = _evolved(5, *SCHEMA.columns[:2], Column("qty", DataType("float", length=12)))
    sink = DeltaSink(tmp_path, mode="changelog")
    sink.write(_changes([_insert(1, TS, 0, schema=v5, qty=0.5)], v5), CONTEXT)
    v6 = _evolved(6, *SCHEMA.columns[:2], Column("qty", DataType("double", length=22)))
    sink.apply_ddl(_ddl(DDLType.ALTER, "ALTER TABLE orders MODIFY qty double", TS + 1, v6), CONTEXT)
    sink.write(_changes([_insert(2, TS + 2, 1, schema=v6, qty=1.5)], v6), CONTEXT)
    with pytest.raises(SinkError, match="do not fit"):
        sink.write(_changes([_insert(3, TS + 3, 2, schema=v6, qty=0.1)], v6), CONTEXT)
    assert [r["qty"] for r in _changelog(tmp_path)] == [0.5, 1.5]


def test_modify_to_a_type_without_a_cast_fails_at_the_ddl(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    vector = _evolved(6, *SCHEMA.columns[:2], Column("qty", DataType("vector", length=3)))
    with pytest.raises(SinkError, match="cannot be stored"):
        sink.apply_ddl(
            _ddl(DDLType.ALTER, "ALTER TABLE orders MODIFY qty vector(3)", TS + 1, vector), CONTEXT
        )


def test_truncate_empties_the_mirror_and_keeps_the_changelog(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0), _insert(2, TS, 1)]), CONTEXT)
    truncate = _ddl(
        DDLType.TRUNCATE, "TRUNCATE TABLE orders", TS + 1, msgspec.structs.replace(SCHEMA, table_id=2)
    )
    sink.apply_ddl(truncate, CONTEXT)
    sink.write(_changes([_insert(1, TS + 2, 2)]), CONTEXT)
    sink.apply_ddl(truncate, CONTEXT)  # a replay keeps the newer row
    assert list(_mirror(tmp_path)) == [1] and len(_changelog(tmp_path)) == 3


def test_drop_table_empties_and_marks_then_create_starts_fresh(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    sink.apply_ddl(_ddl(DDLType.ERASE, "DROP TABLE orders", TS + 1), CONTEXT)
    assert _mirror(tmp_path) == {}
    for kind in ("changelog", "mirror"):
        assert dropped_at(DeltaTable(str(tmp_path / "shop/orders" / kind))) == TS + 1
    assert consistent_ts(tmp_path) is None  # dropped tables do not hold the watermark back

    recreated = msgspec.structs.replace(SCHEMA, table_id=9, version=7)
    sink.apply_ddl(
        _ddl(DDLType.CREATE, "CREATE TABLE orders (id bigint primary key)", TS + 2, recreated), CONTEXT
    )
    retired = tmp_path / "shop" / f"orders@dropped-{TS + 1}"
    assert len(_rows(retired / "changelog")) == 1 and not (tmp_path / "shop/orders").exists()
    sink.write(_changes([_insert(5, TS + 3, 1, schema=recreated)], recreated), CONTEXT)
    assert (
        list(_mirror(tmp_path)) == [5]
        and dropped_at(DeltaTable(str(tmp_path / "shop/orders/mirror"))) is None
    )


def test_rename_moves_the_tables_and_later_changes_continue_them(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    renamed = _evolved(5, *SCHEMA.columns, table="orders v2")
    rename = _ddl(DDLType.RENAME, "RENAME TABLE `shop`.`orders` TO `shop`.`orders v2`", TS + 1, renamed)
    sink.apply_ddl(rename, CONTEXT)
    sink.apply_ddl(rename, CONTEXT)  # a replay is a no-op
    assert not (tmp_path / "shop/orders").exists() and (tmp_path / "shop/orders~20v2/mirror").is_dir()
    moved = DeltaTable(str(tmp_path / "shop/orders~20v2/changelog"))
    assert moved.transaction_version("ticdc:g:t:0") == 1  # same table: its history came along
    sink.write(
        _changes([_insert(1, TS, 0, schema=renamed), _insert(2, TS + 2, 1, schema=renamed)], renamed), CONTEXT
    )
    assert sorted(_mirror(tmp_path, "orders~20v2")) == [1, 2]
    assert [r["_offset"] for r in _changelog(tmp_path, "orders~20v2")] == [0, 1]


def test_two_members_applying_one_rename_at_once_both_succeed(tmp_path: Path) -> None:
    first, second = DeltaSink(tmp_path), DeltaSink(tmp_path)
    first.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    renamed = _evolved(5, *SCHEMA.columns, table="orders2")
    rename = _ddl(DDLType.RENAME, "RENAME TABLE `orders` TO `orders2`", TS + 1, renamed)
    start = threading.Barrier(2)
    errors: list[BaseException] = []

    def member(sink: DeltaSink) -> None:
        start.wait()
        try:
            sink.apply_ddl(rename, CONTEXT)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(sink,)) for sink in (first, second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert not (tmp_path / "shop/orders").exists()
    assert sorted(_mirror(tmp_path, "orders2")) == [1]


def test_a_write_in_flight_holds_a_rename_back(tmp_path: Path, monkeypatch: Any) -> None:
    """A directory moved under a commit in flight would re-create the old name around the new file."""
    writer, renamer = DeltaSink(tmp_path), DeltaSink(tmp_path)
    writer.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    renamed = _evolved(5, *SCHEMA.columns, table="orders2")
    rename = _ddl(DDLType.RENAME, "RENAME TABLE `orders` TO `orders2`", TS + 3, renamed)
    writing, renaming = threading.Event(), threading.Thread(target=renamer.apply_ddl, args=(rename, CONTEXT))
    append = writer._append_changelog

    def slow_append(path: Path, changelog: Any, context: CommitContext) -> None:
        writing.set()
        time.sleep(0.5)  # the RENAME is attempted meanwhile
        append(path, changelog, context)

    monkeypatch.setattr(writer, "_append_changelog", slow_append)
    threading.Thread(target=lambda: (writing.wait(), renaming.start())).start()
    writer.write(_changes([_insert(2, TS + 1, 1)]), CONTEXT)
    renaming.join()
    assert not (tmp_path / "shop/orders").exists()  # moved after the write, not around it
    assert [r["_offset"] for r in _changelog(tmp_path, "orders2")] == [0, 1]
    assert sorted(_mirror(tmp_path, "orders2")) == [1, 2]


def test_a_member_behind_a_rename_applies_older_ddls_where_the_table_moved(tmp_path: Path) -> None:
    ahead, behind = DeltaSink(tmp_path), DeltaSink(tmp_path)
    ahead.write(_changes([_insert(1, TS, 0), _insert(2, TS, 1)]), CONTEXT)
    renamed = _evolved(5, *SCHEMA.columns, table="orders2")
    ahead.apply_ddl(_ddl(DDLType.RENAME, "RENAME TABLE `orders` TO `orders2`", TS + 3, renamed), CONTEXT)
    v6 = _evolved(6, *SCHEMA.columns, Column("note", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=8)))
    behind.apply_ddl(
        _ddl(DDLType.ALTER, "ALTER TABLE orders ADD COLUMN note varchar(8)", TS + 1, v6), CONTEXT
    )
    behind.apply_ddl(_ddl(DDLType.TRUNCATE, "TRUNCATE TABLE orders", TS + 2), CONTEXT)
    assert not (tmp_path / "shop/orders").exists()  # nothing was re-created under the old name
    for kind in ("changelog", "mirror"):
        assert "note" in DeltaTable(str(tmp_path / "shop/orders2" / kind)).schema().to_arrow().names
    assert _mirror(tmp_path, "orders2") == {} and len(_changelog(tmp_path, "orders2")) == 2


def test_rename_onto_a_live_table_fails(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    other = _evolved(5, *SCHEMA.columns, table="other")
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    sink.write(_changes([_insert(1, TS, 1, schema=other)], other), CONTEXT)
    with pytest.raises(SinkError, match="already holds a live table"):
        sink.apply_ddl(_ddl(DDLType.RENAME, "RENAME TABLE orders TO other", TS + 1, other), CONTEXT)


def test_every_ddl_is_logged_once(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    events = [
        _ddl(DDLType.CREATE, "CREATE DATABASE shop", TS, None),
        _ddl(DDLType.CINDEX, "CREATE INDEX i ON orders (qty)", TS + 1),
        _ddl(DDLType.DINDEX, "DROP INDEX i ON orders", TS + 2),
        _ddl(DDLType.QUERY, "CREATE VIEW v AS SELECT 1", TS + 3),
    ]
    for event in [*events, *events]:
        sink.apply_ddl(event, CONTEXT)
    logged = sorted(_rows(tmp_path / "_ddl"), key=lambda r: r["commit_ts"])
    assert [(r["type"], r["database"], r["table"], r["schema_version"]) for r in logged] == [
        ("CREATE", None, None, None),
        ("CINDEX", "shop", "orders", 5),
        ("DINDEX", "shop", "orders", 5),
        ("QUERY", "shop", "orders", 5),
    ]
    assert not (tmp_path / "shop").exists()  # only logged


# -- recorded progress ---------------------------------------------------------------------------------
def test_recorded_offsets_snapshot_and_consistent_ts_round_trip(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    other = _evolved(5, *SCHEMA.columns, table="other")
    sink.write(_changes([_insert(1, TS, 0)]), CONTEXT)
    later = CommitContext(
        group="g", resume_offsets={("t", 0): 2, ("t", 1): 8}, resolved_ts=TS + 9, schema_snapshot=b"cache-2"
    )
    sink.write(_changes([_insert(1, TS, 1, schema=other)], other), later)
    sink.apply_ddl(_ddl(DDLType.CINDEX, "CREATE INDEX i ON orders (qty)", TS + 1, None), later)

    reopened = DeltaSink(tmp_path)
    assert reopened.recorded_offsets("g") == {("t", 0): 3, ("t", 1): 8}  # the max per partition
    assert reopened.recorded_offsets("another group") == {}
    assert reopened.recorded_schema_snapshot() == b"cache-2"
    assert consistent_ts(tmp_path) == TS  # "orders" was last written at TS
    assert DeltaSink(tmp_path / "empty").recorded_schema_snapshot() is None


# -- concurrency ---------------------------------------------------------------------------------------
BATCHES, ROWS = 6, 5


class _Conflicts(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "concurrent commit" in record.getMessage():
            self.count += 1


def _member(root: str, partition: int, start: Any, conflicts: Any) -> None:
    """A consumer-group member in its own process, owning one partition and writing the shared table."""
    counter = _Conflicts()
    logging.getLogger("consumer.sinks.delta").addHandler(counter)
    logging.getLogger("consumer.sinks.delta").setLevel(logging.INFO)
    sink = DeltaSink(root, max_commit_retries=60, retry_backoff=0.02)
    context = CommitContext(group="g", resume_offsets={("t", partition): 0}, resolved_ts=TS)
    batches = [
        _changes(
            [_insert(partition * 1000 + o, TS + o, o, partition) for o in range(b * ROWS, (b + 1) * ROWS)]
        )
        for b in range(BATCHES)
    ]
    for batch in batches:
        start.wait()  # both members commit each batch at the same moment: they collide
        sink.write(batch, context)
    conflicts.put(counter.count)


def test_concurrent_members_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    spawn = multiprocessing.get_context("spawn")
    start, conflicts = spawn.Barrier(2), spawn.Queue()
    members = [spawn.Process(target=_member, args=(str(tmp_path), p, start, conflicts)) for p in (0, 1)]
    for member in members:
        member.start()
    for member in members:
        member.join(60)
    assert [m.exitcode for m in members] == [0, 0]
    assert conflicts.get() + conflicts.get() > 0  # the members did collide, and retried
    written = [(r["_partition"], r["_offset"]) for r in _changelog(tmp_path)]
    assert written == [(p, o) for p in (0, 1) for o in range(BATCHES * ROWS)]
    assert sorted(_mirror(tmp_path)) == [p * 1000 + o for p in (0, 1) for o in range(BATCHES * ROWS)]


def test_user_columns_named_like_metadata_land_in_changelog_and_mirror(tmp_path: Path) -> None:
    odd = msgspec.structs.replace(
        SCHEMA,
        table="odd `t` é",
        columns=(
            Column("_offset", DataType("bigint", length=20), nullable=False),
            Column("_deleted", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=8)),
            Column("_commit_ts", DataType("int", length=11)),
            Column("a b`c", DataType("int", length=11)),
        ),
        indexes=(Index("primary", True, True, False, ("_offset",)),),
    )
    row = {"_offset": 7, "_deleted": "no", "_commit_ts": 3, "a b`c": 4}
    insert = _raw(DMLType.INSERT, TS, row, schema=odd)
    delete = _raw(DMLType.DELETE, TS + 1, old={**row, "_offset": 8}, schema=odd)
    sink = DeltaSink(tmp_path)
    sink.write(
        _changes(
            [(insert, 0, 10), (_raw(DMLType.INSERT, TS, {**row, "_offset": 8}, schema=odd), 0, 11)], odd
        ),
        CONTEXT,
    )
    sink.write(_changes([(delete, 0, 12)], odd), CONTEXT)

    where = table_dir(tmp_path, "shop", "odd `t` é")
    changelog = sorted(_rows(where / "changelog"), key=lambda r: r["_offset"])
    assert [(r["_offset"], r["__offset"], r["__deleted"], r["__commit_ts"]) for r in changelog] == [
        (10, 7, "no", 3),
        (11, 8, "no", 3),
        (12, 8, "no", 3),
    ]
    mirror = live_mirror(where / "mirror").to_pylist()
    assert [
        (r["__offset"], r["__deleted"], r["__commit_ts"], r["a b`c"], r["_commit_ts"]) for r in mirror
    ] == [(7, "no", 3, 4, TS)]
