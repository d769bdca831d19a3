"""Reading what the sinks wrote, as Spark DataFrames, under the layout `<root>/<database>/<table>/<kind>`
(names escaped to path segments as the Delta sink's `table_dir` does, for every sink).

Spark cannot read Delta here (no delta-spark jar) and must not list a table directory (that would include
files a Delta MERGE removed, or Parquet files a crashed writer never committed), so every reader reads
exactly the files a log or manifest lists.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from consumer.sinks.delta import DELETED_FIELD, stored_durations
from consumer.sinks.layout import table_dir
from consumer.sinks.parquet import read_progress
from consumer.spark.frames import spark_schema

ChangelogFormat = Literal["delta", "parquet"]
DELETED = DELETED_FIELD.name


def read_delta(spark: SparkSession, path: str | os.PathLike[str]) -> DataFrame:
    """The current version of a Delta table: its live files, read with the table's own schema (types, and
    columns older files lack), TIME columns as intervals again; Spark makes every column read from files
    nullable."""
    delta = DeltaTable(str(path))
    arrow_schema = pa.schema(delta.schema().to_arrow())
    files = delta.file_uris()
    if not files:  # through Arrow: a Python list would start Python workers (seconds, the first time)
        frame = spark.createDataFrame(arrow_schema.empty_table(), schema=spark_schema(arrow_schema))
    else:
        frame = spark.read.schema(spark_schema(arrow_schema)).parquet(*files)
    for name in stored_durations(delta):  # TIME: int64 microseconds in Delta, an interval in Spark
        seconds = (F.col(name).cast("decimal(20,0)") / F.lit(1_000_000)).cast("decimal(18,6)")
        frame = frame.withColumn(name, F.make_dt_interval(secs=seconds))
    return frame


def read_parquet_log(spark: SparkSession, directory: str | os.PathLike[str]) -> DataFrame:
    """The files a Parquet sink's manifest lists; files of older schema versions are merged in."""
    directory = Path(directory)
    progress = read_progress(directory)
    if progress is None:
        raise FileNotFoundError(f"no Parquet sink manifest in {directory}")
    files = [str(directory / name) for name in progress.files]
    return spark.read.option("mergeSchema", "true").parquet(*files)


def read_changelog(
    spark: SparkSession,
    root: str | os.PathLike[str],
    database: str,
    table: str,
    format: ChangelogFormat = "delta",
) -> DataFrame:
    """Every change of a table (one row per image, with the `_change_type`, `_commit_ts`... columns)."""
    path = table_dir(root, database, table) / "changelog"
    return read_delta(spark, path) if format == "delta" else read_parquet_log(spark, path)


def read_mirror(
    spark: SparkSession,
    root: str | os.PathLike[str],
    database: str,
    table: str,
    include_deleted: bool = False,
) -> DataFrame:
    """The table's current rows, as the Delta sink's MERGEs left them. Deleted keys stay in the mirror as
    tombstones (`_deleted` true) so late, older changes cannot resurrect them; they are left out unless
    `include_deleted`, which keeps the `_deleted` column."""
    frame = read_delta(spark, table_dir(root, database, table) / "mirror")
    if include_deleted or DELETED not in frame.columns:
        return frame
    return frame.filter(~F.coalesce(F.col(DELETED), F.lit(False))).drop(DELETED)


def read_ddl_log(spark: SparkSession, root: str | os.PathLike[str]) -> DataFrame:
    """The DDLs a Parquet sink applied, in the order it applied them."""
    return read_parquet_log(spark, Path(root) / "_ddl")
