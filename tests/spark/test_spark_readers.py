"""Readers of Delta tables (live files only, the table's schema), by URI or by upstream name through the
lakehouse catalog."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import STORED_AS, STORED_DURATION
from consumer.lakehouse.tables import read_mirror as read_mirror_arrow
from consumer.spark.readers import read_changelog, read_delta, read_mirror

ROWS = pa.table(
    {
        "id": pa.array([1, 2, 3], pa.int64()),
        "amount": pa.array([Decimal("18446744073709551615"), Decimal(0), None], pa.decimal128(20, 0)),
        "at": pa.array([dt.datetime(2024, 5, 1, 12, 30)] * 3, pa.timestamp("us")),
        "seen": pa.array([dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC)] * 3, pa.timestamp("us", tz="UTC")),
    },
    schema=pa.schema(
        [
            pa.field("id", pa.int64(), nullable=False),
            pa.field("amount", pa.decimal128(20, 0)),
            pa.field("at", pa.timestamp("us")),
            pa.field("seen", pa.timestamp("us", tz="UTC")),
        ]
    ),
)


def _registered(root: Path, database: str, table: str) -> Path:
    """The directory the catalog gives a new table (as a sink registers it on its first row)."""
    return root / Catalog(LakeRoot.of(root)).locate((database, table), 1).location


def test_read_delta_sees_the_live_files_with_the_tables_schema(spark: SparkSession, tmp_path: Path) -> None:
    mirror = _registered(tmp_path, "shop", "orders") / "mirror"
    write_deltalake(mirror, ROWS)
    DeltaTable(mirror).delete("id = 2")  # rewrites the file: the old one stays on disk, removed
    wider = pa.table({"id": pa.array([4], pa.int64()), "note": ["new"]})
    write_deltalake(mirror, wider, mode="append", schema_mode="merge")

    frame = read_mirror(spark, tmp_path, "shop", "orders")
    assert frame.schema == T.StructType(  # Spark reads file columns as nullable, NOT NULL or not
        [
            T.StructField("id", T.LongType()),
            T.StructField("amount", T.DecimalType(20, 0)),
            T.StructField("at", T.TimestampNTZType()),
            T.StructField("seen", T.TimestampType()),
            T.StructField("note", T.StringType()),
        ]
    )
    got = sorted(frame.toArrow().to_pylist(), key=lambda r: r["id"])
    assert [(r["id"], r["amount"], r["at"], r["note"]) for r in got] == [
        (1, Decimal("18446744073709551615"), dt.datetime(2024, 5, 1, 12, 30), None),
        (3, None, dt.datetime(2024, 5, 1, 12, 30), None),
        (4, None, None, "new"),
    ]
    assert got[0]["seen"] == dt.datetime(2024, 5, 1, 12, 30, tzinfo=dt.UTC)
    assert len(list(mirror.glob("*.parquet"))) > len(DeltaTable(mirror).file_uris())


def test_readers_find_a_renamed_table_by_its_new_name(spark: SparkSession, tmp_path: Path) -> None:
    catalog = Catalog(LakeRoot.of(tmp_path))
    location = catalog.locate(("shop", "orders"), 1).location
    write_deltalake(tmp_path / location / "mirror", ROWS)
    catalog.rename(("shop", "orders"), ("shop", "orders_v2"), 5)
    assert sorted(r["id"] for r in read_mirror(spark, tmp_path, "shop", "orders_v2").collect()) == [1, 2, 3]
    with pytest.raises(FileNotFoundError, match=r"no table shop\.orders with a mirror now in the catalog"):
        read_mirror(spark, tmp_path, "shop", "orders")


def test_read_changelog_of_an_empty_delta_table(spark: SparkSession, tmp_path: Path) -> None:
    changelog = _registered(tmp_path, "shop", "orders") / "changelog"
    write_deltalake(changelog, ROWS.slice(0, 0))
    frame = read_changelog(spark, tmp_path, "shop", "orders")
    assert frame.columns == ROWS.column_names and frame.count() == 0
    assert read_delta(spark, changelog).schema == frame.schema


def test_a_parquet_changelog_without_manifest_is_not_found(spark: SparkSession, tmp_path: Path) -> None:
    _registered(tmp_path, "shop", "missing")
    with pytest.raises(FileNotFoundError, match="no Parquet sink manifest"):
        read_changelog(spark, tmp_path, "shop", "missing", format="parquet")


def test_time_columns_come_back_as_intervals(spark: SparkSession, tmp_path: Path) -> None:
    """Delta has no duration type: TIME is stored as int64 microseconds, marked in the field metadata."""
    mirror = _registered(tmp_path, "shop", "clock") / "mirror"
    micros = [-(838 * 3600 + 59 * 60 + 59) * 10**6, 1_500_000, None]
    stored = pa.field("t", pa.int64(), metadata={STORED_AS: STORED_DURATION})
    write_deltalake(
        mirror,
        pa.table([pa.array([1, 2, 3]), pa.array(micros)], schema=pa.schema([("id", pa.int64()), stored])),
    )
    expected = [dt.timedelta(hours=-838, minutes=-59, seconds=-59), dt.timedelta(seconds=1.5), None]

    frame = read_mirror(spark, tmp_path, "shop", "clock")
    assert frame.schema["t"].dataType == T.DayTimeIntervalType(0, 3)
    assert [r["t"] for r in frame.orderBy("id").collect()] == expected
    arrow = read_mirror_arrow(tmp_path, "shop", "clock")
    assert arrow is not None and arrow["t"].to_pylist() == expected
