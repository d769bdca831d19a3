"""Typed changelog batches (Arrow) -> Spark DataFrames with an explicit schema, without per-row Python.

The Spark type of every column follows from its Arrow type, which the mysqlType table
(`consumer.protocol.types`) gives, so a column has the same Spark type whether it arrives through a
DataFrame, a Parquet file or a Delta table.
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import types as T

from consumer.batches.changes import TableChanges
from consumer.errors import UnsupportedTypeError
from consumer.sources.record import TopicPartition


def spark_schema(arrow_schema: pa.Schema) -> T.StructType:
    """The Spark schema of an SDK Arrow schema; a field is nullable exactly when its Arrow field is."""
    return T.StructType(
        [T.StructField(f.name, spark_type_of(f.type), nullable=f.nullable) for f in arrow_schema]
    )


def to_dataframe(spark: SparkSession, changes: TableChanges) -> DataFrame:
    """One batch as a DataFrame. Arrow goes to the JVM in record batches; no value passes through Python."""
    table = changes.changelog
    return spark.createDataFrame(table, schema=spark_schema(_nullable_where_null(table)))


def _nullable_where_null(table: pa.Table) -> pa.Schema:
    """Relax NOT NULL columns that hold nulls in this batch, which PySpark would otherwise reject.

    A key-only image (TiCDC's handle-key-only large-message mode) leaves non-key NOT NULL columns empty.
    """
    schema = table.schema
    for index, field in enumerate(schema):
        if not field.nullable and table.column(index).null_count:
            schema = schema.set(index, field.with_nullable(True))
    return schema


def offset_ranges(changes: TableChanges) -> dict[TopicPartition, tuple[int, int]]:
    """Per (topic, partition), the first and last offset the batch's rows came from."""
    ranges = changes.changelog.group_by(["_topic", "_partition"], use_threads=False).aggregate(
        [("_offset", "min"), ("_offset", "max")]
    )
    return {
        (row["_topic"], row["_partition"]): (row["_offset_min"], row["_offset_max"])
        for row in ranges.to_pylist()
    }


def spark_type_of(arrow_type: pa.DataType) -> T.DataType:
    """The pyspark.sql.types type of an SDK Arrow type."""
    if pa.types.is_boolean(arrow_type):
        return T.BooleanType()
    if pa.types.is_int8(arrow_type):
        return T.ByteType()
    if pa.types.is_int16(arrow_type):
        return T.ShortType()
    if pa.types.is_int32(arrow_type):
        return T.IntegerType()
    if pa.types.is_int64(arrow_type):
        return T.LongType()
    if pa.types.is_float32(arrow_type):
        return T.FloatType()
    if pa.types.is_float64(arrow_type):
        return T.DoubleType()
    if pa.types.is_decimal(arrow_type):
        return T.DecimalType(arrow_type.precision, arrow_type.scale)
    if pa.types.is_string(arrow_type):
        return T.StringType()
    if pa.types.is_binary(arrow_type):
        return T.BinaryType()
    if pa.types.is_date32(arrow_type):
        return T.DateType()
    if pa.types.is_timestamp(arrow_type):
        return T.TimestampType() if arrow_type.tz else T.TimestampNTZType()
    if pa.types.is_duration(arrow_type):
        return T.DayTimeIntervalType(T.DayTimeIntervalType.DAY, T.DayTimeIntervalType.SECOND)
    if pa.types.is_list(arrow_type):
        return T.ArrayType(spark_type_of(arrow_type.value_type), containsNull=False)
    raise UnsupportedTypeError(f"no Spark type for Arrow {arrow_type}")
