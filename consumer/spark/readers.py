"""Reading what the lakehouse sinks wrote, as Spark DataFrames, finding tables through the catalog
(`consumer.lakehouse`): `read_changelog` / `read_mirror` / `read_history` by upstream name, `read_delta`
by table URI.

Spark cannot read Delta here (no delta-spark jar) and must not list a table directory (that would include
files a Delta MERGE removed, or Parquet files a crashed writer never committed), so every reader reads
exactly the files a Delta log or manifest lists: Spark reads them itself on a local disk; on an object
store (this Spark has no Hadoop S3 connector) pyarrow reads them and Spark takes the Arrow table.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from consumer.batches.frames import spark_schema
from consumer.lakehouse.catalog import Catalog, CatalogEntry
from consumer.lakehouse.ddl import DDL_LOG
from consumer.lakehouse.manifest import manifest_files
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import as_durations, stored_durations
from consumer.lakehouse.tables import read_delta as read_delta_arrow
from consumer.lakehouse.tables import read_history as read_history_arrow
from consumer.lakehouse.tables import read_mirror as read_mirror_arrow

ChangelogFormat = Literal["delta", "parquet"]
Root = str | os.PathLike[str]


def read_delta(spark: SparkSession, uri: Root, storage_options: Mapping[str, str] | None = None) -> DataFrame:
    """The current version of the Delta table at `uri`: its live files, read with the table's own schema
    (types, and columns older files lack), TIME columns as intervals again; Spark makes every column read
    from files nullable."""
    root = LakeRoot.of(uri, storage_options)
    delta = root.open(root.uri)
    if delta is None:
        raise FileNotFoundError(f"no Delta table at {root.uri}")
    if not root.is_local:
        return _from_arrow(spark, read_delta_arrow(root, delta))
    arrow_schema = pa.schema(delta.schema().to_arrow())
    files = delta.file_uris()
    if not files:  # through Arrow: a Python list would start Python workers (seconds, the first time)
        frame = spark.createDataFrame(arrow_schema.empty_table(), schema=spark_schema(arrow_schema))
    else:
        frame = spark.read.schema(spark_schema(arrow_schema)).parquet(*files)
    return _with_intervals(frame, stored_durations(arrow_schema))


def read_changelog(
    spark: SparkSession,
    root: Root,
    database: str,
    table: str,
    format: ChangelogFormat = "delta",
    storage_options: Mapping[str, str] | None = None,
) -> DataFrame:
    """Every change of the live table `database.table` (one row per image, with the `_change_type`,
    `_commit_ts`... columns), written by the Delta or the Parquet sink."""
    lake = LakeRoot.of(root, storage_options)
    entry = _entry(lake, database, table)
    if format == "delta":
        return read_delta(spark, lake.join(entry.location, "changelog"), storage_options)
    return _read_parquet_log(spark, lake, entry)


def read_mirror(
    spark: SparkSession,
    root: Root,
    database: str,
    table: str,
    storage_options: Mapping[str, str] | None = None,
    as_of_tso: int | None = None,
) -> DataFrame:
    """The rows and columns `database.table` had as of `as_of_tso` (default: the consistent point), as
    `consumer.lakehouse.read_mirror` gives them (a mirror version plus the changelog after it); a table with
    no rows written yet is an empty frame. Raises FileNotFoundError when no table with a mirror had the name
    then, `TsoOutOfRangeError` for a TSO outside `retained_range(root)`."""
    rows = read_mirror_arrow(root, database, table, storage_options=storage_options, as_of_tso=as_of_tso)
    if rows is None:
        when = "now" if as_of_tso is None else f"at TSO {as_of_tso}"
        raise FileNotFoundError(f"no table {database}.{table} with a mirror {when} in the catalog of {root}")
    return _nullable_frame(spark, rows)


def read_history(
    spark: SparkSession,
    root: Root,
    database: str,
    table: str,
    key: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, str] | None = None,
    as_of_tso: int | None = None,
) -> DataFrame:
    """Every version of the live table `database.table`'s rows (of the row with `key` when given), or with
    `as_of_tso` the history as it stood at that TSO (of the table that had the name then), as
    `consumer.lakehouse.read_history` gives them. Raises FileNotFoundError when it has no history,
    `TsoOutOfRangeError` for a TSO outside `retained_range(root)`."""
    rows = read_history_arrow(root, database, table, key, storage_options, as_of_tso=as_of_tso)
    if rows is None:
        when = "live table" if as_of_tso is None else f"table at TSO {as_of_tso}"
        raise FileNotFoundError(f"no {when} {database}.{table} with a history in the catalog of {root}")
    return _nullable_frame(spark, rows)


def read_ddl_log(
    spark: SparkSession, root: Root, storage_options: Mapping[str, str] | None = None
) -> DataFrame:
    """Every DDL the lakehouse sinks applied at `root`, once each."""
    return read_delta(spark, LakeRoot.of(root, storage_options).join(DDL_LOG), storage_options)


def _entry(root: LakeRoot, database: str, table: str) -> CatalogEntry:
    entry = Catalog(root).current((database, table))
    if entry is None:
        raise FileNotFoundError(f"no live table {database}.{table} in the catalog of {root.uri}")
    return entry


def _read_parquet_log(spark: SparkSession, root: LakeRoot, entry: CatalogEntry) -> DataFrame:
    """The files a Parquet sink's manifest lists; files of older schema versions are merged in."""
    files = manifest_files(root, entry.location)
    if files is None:
        raise FileNotFoundError(f"no Parquet sink manifest for {entry.location} under {root.uri}")
    filesystem, _ = root.filesystem()
    schema = pa.unify_schemas([pq.read_schema(path, filesystem=filesystem) for path in files])
    durations = stored_durations(schema)
    if not root.is_local:
        rows = pads.dataset(files, schema=schema, format="parquet", filesystem=filesystem).to_table()
        return _from_arrow(spark, as_durations(rows, durations))
    frame = spark.read.option("mergeSchema", "true").parquet(*files)
    return _with_intervals(frame, durations)


def _nullable_frame(spark: SparkSession, rows: pa.Table) -> DataFrame:
    """Every column nullable, as Spark reads files."""
    nullable = T.StructType([_nullable(field) for field in spark_schema(rows.schema).fields])
    return spark.createDataFrame(rows, schema=nullable)


def _nullable(field: T.StructField) -> T.StructField:
    return T.StructField(field.name, field.dataType, True, field.metadata)


def _from_arrow(spark: SparkSession, rows: pa.Table) -> DataFrame:
    return spark.createDataFrame(rows, schema=spark_schema(rows.schema))


def _with_intervals(frame: DataFrame, durations: list[str]) -> DataFrame:
    """TIME: int64 microseconds in the files, an interval in Spark."""
    for name in durations:
        seconds = (F.col(name).cast("decimal(20,0)") / F.lit(1_000_000)).cast("decimal(18,6)")
        frame = frame.withColumn(name, F.make_dt_interval(secs=seconds))
    return frame
