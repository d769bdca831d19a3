"""Arrow changelog -> Spark: every mysqlType arrives with its Spark type, exact value and nullability."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import types as T

from consumer.batches.changes import TableChanges, table_changes
from consumer.batches.frames import offset_ranges, spark_schema, to_dataframe
from consumer.errors import RecordLocation
from consumer.protocol.model import Column, DataType, DMLType, Index, TableSchema
from consumer.protocol.table import TableCodec
from consumer.simulate.workload import _ALL_TYPES_COLUMNS
from consumer.testing.messages import raw_dml

SCHEMA = TableSchema(
    database="db",
    table="all_types",
    table_id=7,
    version=3,
    columns=(Column("id", DataType("bigint", length=20), nullable=False), *_ALL_TYPES_COLUMNS),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
TS = 449512873440575500

DAY_TO_SECOND = T.DayTimeIntervalType(T.DayTimeIntervalType.DAY, T.DayTimeIntervalType.SECOND)
EXPECTED = T.StructType(
    [
        T.StructField("id", T.LongType(), False),
        T.StructField("c_tinyint", T.ByteType()),
        T.StructField("c_tinyint_u", T.ShortType()),
        T.StructField("c_smallint", T.ShortType()),
        T.StructField("c_mediumint_u", T.IntegerType()),
        T.StructField("c_int", T.IntegerType()),
        T.StructField("c_int_u", T.LongType()),
        T.StructField("c_bigint_u", T.DecimalType(20, 0)),
        T.StructField("c_float", T.FloatType()),
        T.StructField("c_double", T.DoubleType()),
        T.StructField("c_decimal", T.DecimalType(12, 2)),
        T.StructField("c_wide_decimal", T.StringType()),
        T.StructField("c_char", T.StringType()),
        T.StructField("c_text", T.StringType()),
        T.StructField("c_binary", T.BinaryType()),
        T.StructField("c_blob", T.BinaryType()),
        T.StructField("c_date", T.DateType()),
        T.StructField("c_datetime", T.TimestampNTZType()),
        T.StructField("c_timestamp", T.TimestampType()),
        T.StructField("c_time", DAY_TO_SECOND),
        T.StructField("c_year", T.IntegerType()),
        T.StructField("c_enum", T.StringType()),
        T.StructField("c_set", T.StringType()),
        T.StructField("c_bit1", T.BooleanType()),
        T.StructField("c_bit10", T.LongType()),
        T.StructField("c_bit64", T.DecimalType(20, 0)),
        T.StructField("c_json", T.StringType()),
        T.StructField("c_vector", T.ArrayType(T.FloatType(), containsNull=False)),
        T.StructField("_change_type", T.StringType(), False),
        T.StructField("_commit_ts", T.LongType(), False),
        T.StructField("_commit_time", T.TimestampType(), False),
        T.StructField("_schema_version", T.LongType(), False),
        T.StructField("_topic", T.StringType(), False),
        T.StructField("_partition", T.IntegerType(), False),
        T.StructField("_offset", T.LongType(), False),
    ]
)

HIGH: dict[str, Any] = {
    "id": 1,
    "c_tinyint": 127,
    "c_tinyint_u": 255,
    "c_smallint": 32767,
    "c_mediumint_u": 16777215,
    "c_int": 2147483647,
    "c_int_u": 4294967295,
    "c_bigint_u": 18446744073709551615,
    "c_float": 3.4028234663852886e38,
    "c_double": 1.7976931348623157e308,
    "c_decimal": Decimal("9999999999.99"),
    "c_wide_decimal": Decimal("1234567890123456789012345678901234567890.0123456789"),
    "c_char": "Zoë😀",
    "c_text": "multi\nline <&>",
    "c_binary": b"\x00\xff\x00\x01",
    "c_blob": bytes(range(256)),
    "c_date": dt.date(9999, 12, 31),
    "c_datetime": dt.datetime(9999, 12, 31, 23, 59, 59, 999000),
    "c_timestamp": dt.datetime(2038, 1, 19, 3, 14, 7, 999999, tzinfo=dt.UTC),
    "c_time": dt.timedelta(hours=838, minutes=59, seconds=59),
    "c_year": 2155,
    "c_enum": "blue",
    "c_set": "a,c",
    "c_bit1": True,
    "c_bit10": 1023,
    "c_bit64": 18446744073709551615,
    "c_json": {"k": [1, "two", None]},
    "c_vector": [1.5, -0.0, 3.4028234663852886e38],
}
LOW: dict[str, Any] = {
    "id": -9223372036854775808,
    "c_tinyint": -128,
    "c_tinyint_u": 0,
    "c_smallint": -32768,
    "c_mediumint_u": 0,
    "c_int": -2147483648,
    "c_int_u": 0,
    "c_bigint_u": 0,
    "c_float": -1.401298464324817e-45,
    "c_double": -5e-324,
    "c_decimal": Decimal("-9999999999.99"),
    "c_wide_decimal": Decimal("-0.0000000001"),
    "c_char": "",
    "c_text": "",
    "c_binary": b"\x00\x00\x00\x00",
    "c_blob": b"",
    "c_date": dt.date(1, 1, 1),
    "c_datetime": dt.datetime(1, 1, 1),
    "c_timestamp": dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=dt.UTC),
    "c_time": -dt.timedelta(hours=838, minutes=59, seconds=59),
    "c_year": 1901,
    "c_enum": "red",
    "c_set": "",
    "c_bit1": False,
    "c_bit10": 0,
    "c_bit64": 0,
    "c_json": [],
    "c_vector": [],
}
NULLS: dict[str, Any] = {"id": 0} | dict.fromkeys((c.name for c in _ALL_TYPES_COLUMNS), None)


def changes_of(schema: TableSchema, dmls: list[tuple[DMLType, dict | None, dict | None]]) -> TableChanges:
    """A resolved batch as the pipeline builds it: encoded, decoded, typed (offsets 100, 101, ...)."""
    rows = []
    for offset, (kind, data, old) in enumerate(dmls, start=100):
        raw = raw_dml(schema, kind, data, old, commit_ts=TS + offset)
        rows.append((raw, RecordLocation("cdc", 2, offset)))
    return table_changes(TableCodec(schema), rows)


@pytest.fixture(scope="module")
def all_types() -> TableChanges:
    return changes_of(SCHEMA, [(DMLType.INSERT, row, None) for row in (HIGH, LOW, NULLS)])


def test_schema_is_the_mysql_type_table_with_arrow_nullability(all_types: TableChanges) -> None:
    assert spark_schema(all_types.changelog.schema) == EXPECTED


def test_every_type_reaches_spark_with_its_exact_value(spark: SparkSession, all_types: TableChanges) -> None:
    frame = to_dataframe(spark, all_types)
    assert frame.selectExpr("*").schema == EXPECTED  # the JVM's schema, not only the one PySpark cached
    back = frame.toArrow()
    assert back.to_pylist() == all_types.changelog.to_pylist()
    assert [str(v) for v in back["c_vector"][0].as_py()] == ["1.5", "-0.0", "3.4028234663852886e+38"]


def test_spark_reads_the_values_with_their_sql_meaning(spark: SparkSession, all_types: TableChanges) -> None:
    """NTZ keeps the wall clock under another session zone, LTZ keeps the instant; TIME is an interval."""
    frame = to_dataframe(spark, all_types)
    spark.conf.set("spark.sql.session.timeZone", "Asia/Shanghai")
    try:
        rows = frame.selectExpr(
            "_offset",
            "cast(c_bigint_u as string) as bigint_u",
            "cast(c_datetime as string) as ntz",
            "cast(c_timestamp as string) as ltz",
            "cast(c_time as string) as time",
            "c_time < interval '0' second as negative",
            "c_tinyint_u * 2 as widened",
            "get(c_vector, 2) as element",
            "get_json_object(c_json, '$.k[1]') as json_path",
        ).collect()
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
    high, low, nulls = (row.asDict() for row in sorted(rows, key=lambda r: r["_offset"]))
    for row in (high, low, nulls):
        del row["_offset"]
    assert high == {
        "bigint_u": "18446744073709551615",
        "ntz": "9999-12-31 23:59:59.999",
        "ltz": "2038-01-19 11:14:07.999999",
        "time": "INTERVAL '34 22:59:59' DAY TO SECOND",
        "negative": False,
        "widened": 510,
        "element": pytest.approx(3.4028234663852886e38),
        "json_path": "two",
    }
    assert (low["ltz"], low["time"], low["negative"]) == (
        "1970-01-01 08:00:01",
        "INTERVAL '-34 22:59:59' DAY TO SECOND",
        True,
    )
    assert set(nulls.values()) == {None}


def test_not_null_columns_stay_not_null_unless_a_key_only_image_left_them_empty(spark: SparkSession) -> None:
    schema = TableSchema(
        database="db",
        table="orders",
        table_id=8,
        version=1,
        columns=(
            Column("id", DataType("bigint", length=20), nullable=False),
            Column("qty", DataType("int", length=11), nullable=False),
        ),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )
    full = to_dataframe(spark, changes_of(schema, [(DMLType.INSERT, {"id": 1, "qty": 2}, None)]))
    assert [f.nullable for f in full.schema.fields[:2]] == [False, False]
    key_only = changes_of(schema, [(DMLType.DELETE, None, {"id": 1})])
    frame = to_dataframe(spark, key_only)
    assert [f.nullable for f in frame.selectExpr("*").schema.fields[:2]] == [False, True]
    assert frame.select("id", "qty").collect() == [(1, None)]


def test_offset_ranges(all_types: TableChanges) -> None:
    assert offset_ranges(all_types) == {("cdc", 2): (100, 102)}
