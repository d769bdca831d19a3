"""The Delta sink on real Delta tables: exactly-once changelog, pure mirrors (MERGE rules, deletes a lagging
member cannot undo, key-range MERGEs), DDLs as catalog commits, recorded progress, and concurrent writers."""

from __future__ import annotations

import datetime as dt
import logging
import multiprocessing
import threading
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.dataset as pads
import pytest
from delta_changes import (
    CONTEXT,
    SCHEMA,
    TS,
    ddl_event,
    delete_row,
    evolved_schema,
    insert_row,
    raw_change,
    table_batch,
    update_row,
)
from deltalake import DeltaTable

from consumer.errors import SinkError
from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.progress import COMPACT_EVERY, PROGRESS, consistent_ts
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import read_changelog, read_mirror, table_uri, tables
from consumer.protocol.model import Column, DataType, DDLType, DMLType, Index, TableSchema
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink


# -- reading results -----------------------------------------------------------------------------------
def _plain(uri: str | Path) -> list[dict[str, Any]]:
    """A Delta table's rows as any Delta reader sees them: the files its log lists, nothing filtered."""
    table = DeltaTable(str(uri))
    return (
        pads.dataset(table.file_uris(), schema=pa.schema(table.schema().to_arrow()), format="parquet")
        .to_table()
        .to_pylist()
    )


def _uri(root: Path, table: str = "orders", kind: str = "mirror") -> str:
    uri = table_uri(root, "shop", table, kind)  # type: ignore[arg-type]
    assert uri is not None, f"no live table shop.{table}"
    return uri


def _mirror(root: Path, table: str = "orders") -> dict[int, dict[str, Any]]:
    mirror = read_mirror(root, "shop", table)
    return {} if mirror is None else {row["id"]: row for row in mirror.to_pylist()}


def _changelog(root: Path, table: str = "orders") -> list[dict[str, Any]]:
    changelog = read_changelog(root, "shop", table)
    assert changelog is not None
    return sorted(changelog.to_pylist(), key=lambda r: (r["_partition"], r["_offset"]))


# -- changelog -----------------------------------------------------------------------------------------
def test_changelog_appends_once_and_a_replay_adds_nothing(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="changelog")
    first = table_batch([insert_row(1, TS, 0), insert_row(2, TS, 1), insert_row(3, TS, 0, partition=1)])
    sink.write(first, CONTEXT)
    table = DeltaTable(_uri(tmp_path, kind="changelog"))
    assert table.transaction_version("ticdc:g:t:0") == 2 and table.transaction_version("ticdc:g:t:1") == 1

    sink.write(first, CONTEXT)  # a replay after a crash: nothing new
    overlapping = table_batch(
        [insert_row(2, TS, 1), update_row(2, TS + 1, 2, qty=5), insert_row(3, TS, 0, partition=1)]
    )
    sink.write(overlapping, CONTEXT)  # offset 1 and partition 1 were written; offset 2 is new

    rows = _changelog(tmp_path)
    assert [(r["_partition"], r["_offset"], r["_change_type"]) for r in rows] == [
        (0, 0, "insert"),
        (0, 1, "insert"),
        (0, 2, "update_preimage"),
        (0, 2, "update_postimage"),
        (1, 0, "insert"),
    ]
    assert DeltaTable(_uri(tmp_path, kind="changelog")).version() == 1  # the replay never committed
    assert read_mirror(tmp_path, "shop", "orders") is None
    assert _uri(tmp_path, kind="changelog") == str(tmp_path / "shop/orders/changelog")  # the first location


def test_every_commit_records_its_group_and_watermark(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    for kind in ("changelog", "mirror"):
        info = DeltaTable(_uri(tmp_path, kind=kind)).history(1)[0]
        assert info["ticdc.group"] == "g" and info["ticdc.resolved_ts"] == str(TS)


def test_time_columns_are_stored_as_microseconds(tmp_path: Path) -> None:
    schema = evolved_schema(5, *SCHEMA.columns, Column("took", DataType("time", length=10)))
    sink = DeltaSink(tmp_path)
    sink.write(
        table_batch([insert_row(1, TS, 0, schema=schema, took=dt.timedelta(hours=-2, seconds=1))], schema),
        CONTEXT,
    )
    assert [r["took"] for r in _plain(_uri(tmp_path))] == [-7_199_000_000]
    assert _mirror(tmp_path)[1]["took"] == dt.timedelta(hours=-2, seconds=1)  # given back as a duration


# -- mirror --------------------------------------------------------------------------------------------
def test_mirror_follows_inserts_updates_deletes_and_key_changes(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    sink.write(
        table_batch(
            [
                insert_row(1, TS, 0),
                insert_row(2, TS, 1),
                insert_row(3, TS, 2),
                update_row(1, TS + 1, 3, qty=7),
            ]
        ),
        CONTEXT,
    )
    # a primary-key change arrives as DELETE + INSERT with one commit ts
    sink.write(
        table_batch([delete_row(2, TS + 2, 4), insert_row(20, TS + 2, 5), delete_row(3, TS + 3, 6)]), CONTEXT
    )
    mirror = _mirror(tmp_path)
    assert {k: (r["name"], r["qty"]) for k, r in mirror.items()} == {1: ("n1", 7), 20: ("n20", 1)}
    assert set(mirror[1]) == {"id", "name", "qty", "_commit_ts", "_schema_version"}
    assert (mirror[1]["_commit_ts"], mirror[20]["_commit_ts"], mirror[1]["_schema_version"]) == (
        TS + 1,
        TS + 2,
        5,
    )


def test_a_plain_delta_reader_sees_exactly_the_live_rows(tmp_path: Path) -> None:
    """No tombstones, no flag column: the mirror is the upstream table (plus when each row last changed)."""
    sink = DeltaSink(tmp_path, mode="mirror")
    sink.write(table_batch([insert_row(k, TS, k) for k in range(1, 6)]), CONTEXT)
    sink.write(
        table_batch([delete_row(2, TS + 1, 6), delete_row(4, TS + 1, 7), update_row(5, TS + 2, 8, qty=9)]),
        CONTEXT,
    )
    rows = sorted(_plain(_uri(tmp_path)), key=lambda r: r["id"])
    assert [(r["id"], r["qty"]) for r in rows] == [(1, 1), (3, 1), (5, 9)]
    assert set(rows[0]) == {"id", "name", "qty", "_commit_ts", "_schema_version"}
    deletes = sorted(
        (r["id"], r["_commit_ts"]) for r in _plain(_uri(tmp_path).replace("/mirror", "/deletes"))
    )
    assert deletes == [(2, TS + 1), (4, TS + 1)]  # the side table remembers them, outside the mirror


def test_mirror_ignores_stale_changes_and_inserts_updates_of_unknown_keys(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    sink.write(
        table_batch([update_row(1, TS + 10, 0, qty=10)]), CONTEXT
    )  # joined mid-stream: never saw the INSERT
    sink.write(table_batch([update_row(1, TS + 5, 0, qty=5, partition=1)]), CONTEXT)  # older: ignored
    sink.write(table_batch([delete_row(1, TS + 4, 1, partition=1)]), CONTEXT)  # older delete: ignored
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items()} == {1: 10}
    sink.write(table_batch([delete_row(1, TS + 10, 1)]), CONTEXT)  # same commit ts, later offset: applies
    assert _mirror(tmp_path) == {}


def test_a_lagging_members_older_change_cannot_bring_a_deleted_row_back(tmp_path: Path) -> None:
    """After a RENAME re-hashes keys, a key's changes move to another partition: the member owning it may
    delete the row before the member behind applies an older change of the same key."""
    ahead, behind = DeltaSink(tmp_path, mode="mirror"), DeltaSink(tmp_path, mode="mirror")
    ahead.write(table_batch([insert_row(1, TS, 0, partition=1), insert_row(2, TS, 1, partition=1)]), CONTEXT)
    ahead.write(table_batch([delete_row(1, TS + 10, 2, partition=1)]), CONTEXT)
    behind.write(table_batch([update_row(1, TS + 5, 0, qty=5), update_row(2, TS + 5, 1, qty=5)]), CONTEXT)
    behind.write(table_batch([insert_row(3, TS + 6, 2)]), CONTEXT)
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items()} == {2: 5, 3: 1}
    ahead.write(
        table_batch([insert_row(1, TS + 20, 3, partition=1)]), CONTEXT
    )  # a newer insert of the key: back
    assert sorted(_mirror(tmp_path)) == [1, 2, 3]


def test_the_deletes_side_table_is_purged_below_the_consistent_point(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    sink.write(table_batch([insert_row(k, TS, k) for k in range(40)]), CONTEXT)
    sink.record_progress(CommitContext("g", {("t", 0): 60}, TS, b"", applied_ts={("t", 0): TS + 20}))
    for k in range(32):  # the 32nd commit to the side table purges it
        sink.write(table_batch([delete_row(k, TS + 1 + k, 40 + k)]), CONTEXT)
    deletes = _uri(tmp_path).replace("/mirror", "/deletes")
    assert sorted(r["id"] for r in _plain(deletes)) == list(range(19, 32))  # deleted at TS + 20 and after
    assert len(DeltaTable(deletes).file_uris()) == 1
    assert sorted(r["id"] for r in _plain(_uri(tmp_path))) == list(range(32, 40))
    assert sorted(_mirror(tmp_path)) == list(range(20, 40))  # read_mirror: as of the consistent point


def test_mirror_replay_is_skipped(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror")
    batch = table_batch([insert_row(1, TS, 0), update_row(1, TS + 1, 1, qty=3)])
    sink.write(batch, CONTEXT)
    sink.write(table_batch([delete_row(1, TS + 2, 2)]), CONTEXT)
    sink.write(batch, CONTEXT)  # replayed: the row must not come back
    assert _mirror(tmp_path) == {}
    assert DeltaTable(_uri(tmp_path)).transaction_version("ticdc:g:t:0") == 3


def test_a_merge_reads_and_rewrites_only_the_files_holding_its_keys(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mode="mirror", target_file_size=4096)
    for batch in range(8):  # sorted inserts: each MERGE adds files of its own key range
        sink.write(
            table_batch([insert_row(batch * 500 + k, TS + batch, batch * 500 + k) for k in range(500)]),
            CONTEXT,
        )
    files = len(DeltaTable(_uri(tmp_path)).file_uris())
    before = sink.operation_metrics()
    sink.write(table_batch([update_row(k, TS + 100, 4000 + k, qty=7) for k in (3998, 3999)]), CONTEXT)
    merged = {k: v - before[k] for k, v in sink.operation_metrics().items()}
    assert files >= 8 and merged["merges"] == 1 and merged["num_target_rows_updated"] == 2
    assert (
        merged["num_target_files_removed"] <= 2
        and merged["num_target_files_skipped_during_scan"] >= files - 2
    )
    assert merged["num_output_rows"] < 4000 / files * 3  # a file or two rewritten, not the table
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items() if k >= 3998} == {3998: 7, 3999: 7}
    assert len(_mirror(tmp_path)) == 4000


def test_table_without_key_gets_a_changelog_and_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    schema = msgspec.structs.replace(SCHEMA, indexes=())
    sink = DeltaSink(tmp_path)
    with caplog.at_level(logging.WARNING, "consumer.sinks.delta"):
        sink.write(table_batch([insert_row(1, TS, 0, schema=schema)], schema), CONTEXT)
        sink.write(table_batch([insert_row(2, TS, 1, schema=schema)], schema), CONTEXT)
    assert len(_changelog(tmp_path)) == 2 and read_mirror(tmp_path, "shop", "orders") is None
    assert [r.getMessage() for r in caplog.records] == [
        "shop.orders has no primary key or NOT NULL unique index: no mirror or history, changelog only"
    ]


# -- DDL -----------------------------------------------------------------------------------------------
def test_add_column_evolves_both_tables_and_earlier_rows_are_null(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    v6 = evolved_schema(
        6, *SCHEMA.columns, Column("note", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=8))
    )
    add = ddl_event(DDLType.ALTER, "ALTER TABLE orders ADD COLUMN note varchar(8)", TS + 1, v6)
    sink.apply_ddl(add, CONTEXT)
    versions = [DeltaTable(_uri(tmp_path, kind=kind)).version() for kind in ("changelog", "mirror")]
    sink.apply_ddl(add, CONTEXT)  # a replay changes nothing
    assert [DeltaTable(_uri(tmp_path, kind=kind)).version() for kind in ("changelog", "mirror")] == versions
    for kind in ("changelog", "mirror"):
        assert "note" in DeltaTable(_uri(tmp_path, kind=kind)).schema().to_arrow().names
    sink.write(table_batch([insert_row(2, TS + 2, 1, schema=v6, note="hi")], v6), CONTEXT)
    assert [(r["id"], r["note"]) for r in _changelog(tmp_path)] == [(1, None), (2, "hi")]
    assert {k: r["note"] for k, r in _mirror(tmp_path).items()} == {1: None, 2: "hi"}


def test_drop_column_keeps_it_in_delta_and_null_from_then_on(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(
        table_batch([insert_row(1, TS, 0, qty=4), insert_row(3, TS, 1), delete_row(3, TS, 2)]), CONTEXT
    )
    v6 = evolved_schema(6, *SCHEMA.columns[:2])
    sink.apply_ddl(ddl_event(DDLType.ALTER, "ALTER TABLE orders DROP COLUMN qty", TS + 1, v6), CONTEXT)
    raw = raw_change(DMLType.INSERT, TS + 2, {"id": 2, "name": "n2"}, schema=v6)
    sink.write(table_batch([(raw, 0, 3)], v6), CONTEXT)
    changelog = [(r["id"], r["_change_type"], r["qty"]) for r in _changelog(tmp_path)]
    assert changelog == [(1, "insert", 4), (3, "insert", 1), (3, "delete", 1), (2, "insert", None)]  # history
    assert {r["id"]: r["qty"] for r in _plain(_uri(tmp_path))} == {1: None, 2: None}  # null in Delta
    assert list(_mirror(tmp_path)[1]) == ["id", "name", "_commit_ts", "_schema_version"]  # gone for readers


def test_widening_modify_keeps_the_delta_type_while_values_fit(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0, qty=1)]), CONTEXT)
    widened = evolved_schema(6, *SCHEMA.columns[:2], Column("qty", DataType("bigint", length=20)))
    sink.apply_ddl(ddl_event(DDLType.ALTER, "ALTER TABLE orders MODIFY qty bigint", TS + 1, widened), CONTEXT)
    sink.write(table_batch([insert_row(2, TS + 2, 1, schema=widened, qty=2**31 - 1)], widened), CONTEXT)
    assert {k: r["qty"] for k, r in _mirror(tmp_path).items()} == {1: 1, 2: 2**31 - 1}
    with pytest.raises(SinkError, match="'qty': int64 values do not fit its Delta type int32"):
        sink.write(table_batch([insert_row(3, TS + 3, 2, schema=widened, qty=2**40)], widened), CONTEXT)
    assert len(_changelog(tmp_path)) == 2


def test_float_to_double_fits_only_exact_values(tmp_path: Path) -> None:
    v5 = evolved_schema(5, *SCHEMA.columns[:2], Column("qty", DataType("float", length=12)))
    sink = DeltaSink(tmp_path, mode="changelog")
    sink.write(table_batch([insert_row(1, TS, 0, schema=v5, qty=0.5)], v5), CONTEXT)
    v6 = evolved_schema(6, *SCHEMA.columns[:2], Column("qty", DataType("double", length=22)))
    sink.apply_ddl(ddl_event(DDLType.ALTER, "ALTER TABLE orders MODIFY qty double", TS + 1, v6), CONTEXT)
    sink.write(table_batch([insert_row(2, TS + 2, 1, schema=v6, qty=1.5)], v6), CONTEXT)
    with pytest.raises(SinkError, match="do not fit"):
        sink.write(table_batch([insert_row(3, TS + 3, 2, schema=v6, qty=0.1)], v6), CONTEXT)
    assert [r["qty"] for r in _changelog(tmp_path)] == [0.5, 1.5]


def test_modify_to_a_type_without_a_cast_fails_at_the_ddl(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    vector = evolved_schema(6, *SCHEMA.columns[:2], Column("qty", DataType("vector", length=3)))
    with pytest.raises(SinkError, match="cannot be stored"):
        sink.apply_ddl(
            ddl_event(DDLType.ALTER, "ALTER TABLE orders MODIFY qty vector(3)", TS + 1, vector), CONTEXT
        )


def test_truncate_empties_the_mirror_and_keeps_the_changelog(tmp_path: Path) -> None:
    sink, behind = DeltaSink(tmp_path), DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0), insert_row(2, TS, 1)]), CONTEXT)
    truncate = ddl_event(
        DDLType.TRUNCATE, "TRUNCATE TABLE orders", TS + 1, msgspec.structs.replace(SCHEMA, table_id=2)
    )
    sink.apply_ddl(truncate, CONTEXT)
    sink.write(table_batch([insert_row(1, TS + 2, 2)]), CONTEXT)
    sink.apply_ddl(truncate, CONTEXT)  # a replay keeps the newer row
    behind.write(table_batch([insert_row(3, TS, 0, partition=1)]), CONTEXT)  # a lagging member's older row
    assert list(_mirror(tmp_path)) == [1] and len(_changelog(tmp_path)) == 4
    assert Catalog(LakeRoot.of(tmp_path)).current(("shop", "orders")).truncated_ts == TS + 1  # type: ignore[union-attr]


def test_truncate_of_a_table_never_written_keeps_older_rows_out(tmp_path: Path) -> None:
    DeltaSink(tmp_path).apply_ddl(ddl_event(DDLType.TRUNCATE, "TRUNCATE TABLE orders", TS + 5), CONTEXT)
    DeltaSink(tmp_path).write(table_batch([insert_row(1, TS, 0), insert_row(2, TS + 6, 1)]), CONTEXT)
    assert list(_mirror(tmp_path)) == [2]


def test_drop_table_empties_it_then_create_starts_a_new_table(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    sink.apply_ddl(ddl_event(DDLType.ERASE, "DROP TABLE orders", TS + 1), CONTEXT)
    assert table_uri(tmp_path, "shop", "orders") is None  # no live table of that name
    assert (
        _plain(tmp_path / "shop/orders/mirror") == [] and len(_plain(tmp_path / "shop/orders/changelog")) == 1
    )
    DeltaSink(tmp_path).write(
        table_batch([insert_row(2, TS, 1, partition=1)]), CONTEXT
    )  # a lagging member's row
    assert _plain(tmp_path / "shop/orders/mirror") == []  # the dropped table stays empty

    recreated = msgspec.structs.replace(SCHEMA, table_id=9, version=7)
    create = ddl_event(DDLType.CREATE, "CREATE TABLE orders (id bigint primary key)", TS + 2, recreated)
    sink.apply_ddl(create, CONTEXT)
    sink.write(table_batch([insert_row(5, TS + 3, 1, schema=recreated)], recreated), CONTEXT)
    sink.apply_ddl(create, CONTEXT)  # a replay
    assert _uri(tmp_path) == str(tmp_path / "shop/orders@2/mirror") and list(_mirror(tmp_path)) == [5]
    entries = {e.location: (e.created_ts, e.dropped_ts) for e in tables(tmp_path)}
    assert entries == {"shop/orders": (0, TS + 1), "shop/orders@2": (TS + 2, None)}


def test_rename_gives_the_table_its_new_name_and_nothing_moves(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    renamed = evolved_schema(5, *SCHEMA.columns, table="orders v2")
    rename = ddl_event(DDLType.RENAME, "RENAME TABLE `shop`.`orders` TO `shop`.`orders v2`", TS + 1, renamed)
    sink.apply_ddl(rename, CONTEXT)
    sink.apply_ddl(rename, CONTEXT)  # a replay is a no-op
    assert table_uri(tmp_path, "shop", "orders") is None
    assert _uri(tmp_path, "orders v2") == str(tmp_path / "shop/orders/mirror")  # the same table
    sink.write(
        table_batch(
            [insert_row(1, TS, 0, schema=renamed), insert_row(2, TS + 2, 1, schema=renamed)], renamed
        ),
        CONTEXT,
    )
    DeltaSink(tmp_path).write(
        table_batch([insert_row(3, TS, 0, partition=1)]), CONTEXT
    )  # old name, older: follows
    assert sorted(_mirror(tmp_path, "orders v2")) == [1, 2, 3]
    assert [(r["_partition"], r["_offset"]) for r in _changelog(tmp_path, "orders v2")] == [
        (0, 0),
        (0, 1),
        (1, 0),
    ]
    (entry,) = tables(tmp_path)
    assert [(p.since_ts, p.table) for p in entry.names] == [(0, "orders"), (TS + 1, "orders v2")]


@pytest.mark.parametrize(
    "sql",
    [
        "RENAME TABLE orders TO orders2",
        "rename table `shop`.`orders` to `orders2`",
        "RENAME TABLE shop.orders TO x",
    ],
)
def test_rename_reads_bare_quoted_and_qualified_names(tmp_path: Path, sql: str) -> None:
    sink = DeltaSink(tmp_path)
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    sink.apply_ddl(
        ddl_event(DDLType.RENAME, sql, TS + 1, evolved_schema(5, *SCHEMA.columns, table="orders2")), CONTEXT
    )
    assert sorted(_mirror(tmp_path, "orders2")) == [1]


def test_two_members_applying_one_rename_at_once_both_succeed(tmp_path: Path) -> None:
    first, second = DeltaSink(tmp_path), DeltaSink(tmp_path)
    first.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    renamed = evolved_schema(5, *SCHEMA.columns, table="orders2")
    rename = ddl_event(DDLType.RENAME, "RENAME TABLE `orders` TO `orders2`", TS + 1, renamed)
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
    assert table_uri(tmp_path, "shop", "orders") is None
    assert sorted(_mirror(tmp_path, "orders2")) == [1]
    assert [len(e.names) for e in tables(tmp_path)] == [2]


def test_a_member_behind_a_rename_applies_older_ddls_to_the_renamed_table(tmp_path: Path) -> None:
    ahead, behind = DeltaSink(tmp_path), DeltaSink(tmp_path)
    ahead.write(table_batch([insert_row(1, TS, 0), insert_row(2, TS, 1)]), CONTEXT)
    renamed = evolved_schema(5, *SCHEMA.columns, table="orders2")
    ahead.apply_ddl(ddl_event(DDLType.RENAME, "RENAME TABLE `orders` TO `orders2`", TS + 3, renamed), CONTEXT)
    v6 = evolved_schema(
        6, *SCHEMA.columns, Column("note", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=8))
    )
    behind.apply_ddl(
        ddl_event(DDLType.ALTER, "ALTER TABLE orders ADD COLUMN note varchar(8)", TS + 1, v6), CONTEXT
    )
    behind.apply_ddl(ddl_event(DDLType.TRUNCATE, "TRUNCATE TABLE orders", TS + 2), CONTEXT)
    assert table_uri(tmp_path, "shop", "orders") is None  # nothing was created under the old name
    for kind in ("changelog", "mirror"):
        assert "note" in DeltaTable(_uri(tmp_path, "orders2", kind)).schema().to_arrow().names
    assert _mirror(tmp_path, "orders2") == {} and len(_changelog(tmp_path, "orders2")) == 2


def test_rename_onto_a_live_table_fails(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    other = evolved_schema(5, *SCHEMA.columns, table="other")
    sink.write(table_batch([insert_row(1, TS, 0)]), CONTEXT)
    sink.write(table_batch([insert_row(1, TS, 1, schema=other)], other), CONTEXT)
    with pytest.raises(SinkError, match="already holds a live table"):
        sink.apply_ddl(ddl_event(DDLType.RENAME, "RENAME TABLE orders TO other", TS + 1, other), CONTEXT)


def test_every_ddl_is_logged_once(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    events = [
        ddl_event(DDLType.CREATE, "CREATE DATABASE shop", TS, None),
        ddl_event(DDLType.CINDEX, "CREATE INDEX i ON orders (qty)", TS + 1),
        ddl_event(DDLType.DINDEX, "DROP INDEX i ON orders", TS + 2),
        ddl_event(DDLType.QUERY, "CREATE VIEW v AS SELECT 1", TS + 3),
    ]
    for event in [*events, *events]:
        sink.apply_ddl(event, CONTEXT)
    logged = sorted(_plain(tmp_path / "_ddl"), key=lambda r: r["commit_ts"])
    assert [(r["type"], r["database"], r["table"], r["schema_version"]) for r in logged] == [
        ("CREATE", None, None, None),
        ("CINDEX", "shop", "orders", 5),
        ("DINDEX", "shop", "orders", 5),
        ("QUERY", "shop", "orders", 5),
    ]
    assert tables(tmp_path) == [] and not (tmp_path / "shop").exists()  # only logged


# -- recorded progress ---------------------------------------------------------------------------------
def test_recorded_progress_round_trips_and_gives_the_consistent_point(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    assert sink.recorded_offsets("g") == {} and sink.recorded_schema_snapshot() is None
    sink.record_progress(
        CommitContext(
            "g", {("t", 0): 3, ("t", 1): 8}, TS + 9, b"", applied_ts={("t", 0): TS + 4, ("t", 1): TS + 9}
        )
    )
    other_member = DeltaSink(tmp_path)  # a member behind: its older facts do not move anything back
    other_member.record_progress(CommitContext("g", {("t", 0): 2}, TS, b"", applied_ts={("t", 0): TS + 1}))

    reopened = DeltaSink(tmp_path)
    assert reopened.recorded_offsets("g") == {("t", 0): 3, ("t", 1): 8}
    assert reopened.recorded_watermarks("g") == {("t", 0): TS + 4, ("t", 1): TS + 9}
    assert reopened.recorded_offsets("another group") == {}
    assert consistent_ts(LakeRoot.of(tmp_path)) == TS + 4  # the partition furthest behind
    assert consistent_ts(LakeRoot.of(tmp_path), "another group") is None


def test_no_consistent_point_until_every_partition_of_the_topic_recorded(tmp_path: Path) -> None:
    """A member that started first records its one partition at the stream's end; the member owning the
    others has recorded nothing yet: the lake holds nothing consistent (it claimed that point once)."""
    three = {"t": 3}
    early = DeltaSink(tmp_path)
    early.record_progress(
        CommitContext("g", {("t", 2): 9}, applied_ts={("t", 2): TS + 9}, topic_partitions=three)
    )
    assert consistent_ts(LakeRoot.of(tmp_path), "g") is None
    late = DeltaSink(tmp_path)
    late.record_progress(CommitContext("g", {("t", 0): 4}, applied_ts={("t", 0): TS + 5}))  # count not known
    assert consistent_ts(LakeRoot.of(tmp_path), "g") is None
    late.record_progress(
        CommitContext("g", {("t", 1): 4}, applied_ts={("t", 1): TS + 3}, topic_partitions={"t": 2})
    )
    assert consistent_ts(LakeRoot.of(tmp_path), "g") == TS + 3  # the largest count any member saw: 3
    early.record_progress(
        CommitContext("g", {("t", 3): 1}, applied_ts={("t", 3): TS}, topic_partitions={"t": 5})
    )
    assert consistent_ts(LakeRoot.of(tmp_path), "g") is None  # the topic grew to 5: partition 4 unrecorded


def test_a_compacted_progress_table_keeps_the_partition_counts(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path)
    for _ in range(COMPACT_EVERY + 1):
        sink.record_progress(
            CommitContext("g", {("t", 0): 1}, applied_ts={("t", 0): TS}, topic_partitions={"t": 2})
        )
    assert consistent_ts(LakeRoot.of(tmp_path), "g") is None
    rows = _plain(tmp_path / PROGRESS)
    assert "compacted" in {row["member"] for row in rows} and {row["topic_partitions"] for row in rows} == {2}
    sink.record_progress(
        CommitContext("g", {("t", 1): 1}, applied_ts={("t", 1): TS + 1}, topic_partitions={})
    )
    assert consistent_ts(LakeRoot.of(tmp_path), "g") == TS


def test_schema_snapshots_of_every_member_are_merged(tmp_path: Path) -> None:
    first, second = (
        msgspec.msgpack.encode([schema]) for schema in (SCHEMA, evolved_schema(6, *SCHEMA.columns))
    )
    DeltaSink(tmp_path).record_progress(CommitContext("g", {("t", 0): 1}, TS, first))
    DeltaSink(tmp_path).record_progress(CommitContext("g", {("t", 1): 1}, TS, second))
    merged = msgspec.msgpack.decode(
        DeltaSink(tmp_path).recorded_schema_snapshot() or b"", type=list[TableSchema]
    )
    assert sorted(schema.version for schema in merged) == [5, 6]


# -- concurrency ---------------------------------------------------------------------------------------
MIN_BATCHES, MAX_BATCHES, ROWS = 6, 30, 5


class _Conflicts(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "concurrent commit" in record.getMessage():
            self.count += 1


def _member(root: str, partition: int, rounds: Any, conflicts: Any, batches: Any) -> None:
    """A consumer-group member in its own process, owning one partition and writing the shared table.
    Both members commit each batch at the same moment, round after round, until they have collided at least
    once (and at least `MIN_BATCHES` rounds). Whether two commits collide is up to the scheduler: on a loaded
    machine one process may run each round alone, so a collision is sought, not required."""
    counter = _Conflicts()
    logging.getLogger("consumer.lakehouse.storage").addHandler(counter)
    logging.getLogger("consumer.lakehouse.storage").setLevel(logging.INFO)
    sink = DeltaSink(root, max_commit_retries=60, retry_backoff=0.02)
    context = CommitContext(group="g", resume_offsets={("t", partition): 0}, resolved_ts=TS)
    batch = reported = 0
    while batch < MIN_BATCHES or (conflicts.value == 0 and batch < MAX_BATCHES):
        rounds.wait()
        offsets = range(batch * ROWS, (batch + 1) * ROWS)
        sink.write(
            table_batch([insert_row(partition * 1000 + o, TS + o, o, partition) for o in offsets]), context
        )
        with conflicts.get_lock():
            conflicts.value += counter.count - reported
        reported = counter.count
        rounds.wait()  # nobody writes before both have read the same total
        batch += 1
    batches.put(batch)


def test_concurrent_members_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    spawn = multiprocessing.get_context("spawn")
    rounds, conflicts, batches = spawn.Barrier(2), spawn.Value("i", 0), spawn.Queue()
    members = [
        spawn.Process(target=_member, args=(str(tmp_path), p, rounds, conflicts, batches)) for p in (0, 1)
    ]
    for member in members:
        member.start()
    for member in members:
        member.join(120)
    assert [m.exitcode for m in members] == [0, 0]
    done = batches.get()
    assert batches.get() == done
    written = [(r["_partition"], r["_offset"]) for r in _changelog(tmp_path)]
    assert written == [(p, o) for p in (0, 1) for o in range(done * ROWS)]
    assert sorted(_mirror(tmp_path)) == [p * 1000 + o for p in (0, 1) for o in range(done * ROWS)]
    assert [e.location for e in tables(tmp_path)] == ["shop/orders"]  # registered once


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
    insert = raw_change(DMLType.INSERT, TS, row, schema=odd)
    delete = raw_change(DMLType.DELETE, TS + 1, old={**row, "_offset": 8}, schema=odd)
    sink = DeltaSink(tmp_path)
    sink.write(
        table_batch(
            [(insert, 0, 10), (raw_change(DMLType.INSERT, TS, {**row, "_offset": 8}, schema=odd), 0, 11)], odd
        ),
        CONTEXT,
    )
    sink.write(table_batch([(delete, 0, 12)], odd), CONTEXT)

    changelog = read_changelog(tmp_path, "shop", "odd `t` é")
    assert changelog is not None
    rows = sorted(changelog.to_pylist(), key=lambda r: r["_offset"])
    assert [(r["_offset"], r["__offset"], r["__deleted"], r["__commit_ts"]) for r in rows] == [
        (10, 7, "no", 3),
        (11, 8, "no", 3),
        (12, 8, "no", 3),
    ]
    mirror = read_mirror(tmp_path, "shop", "odd `t` é")
    assert mirror is not None
    assert [
        (r["__offset"], r["__deleted"], r["__commit_ts"], r["a b`c"], r["_commit_ts"])
        for r in mirror.to_pylist()
    ] == [(7, "no", 3, 4, TS)]
