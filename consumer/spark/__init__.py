"""The SDK on Spark, one import: `from consumer.spark import start_lakehouse, ...`.

- the multi-table job (`run --engine spark`) in your session: `start_lakehouse(spark, config)` returns a
  `LakehouseQuery`; `on_table(table, frame, info)` adds your own function over every typed table batch
- its parts, for your own query: `register` (the `ticdc` data source), `stream_options`,
  `checkpoint_location`, `ChangeBatches` (the foreachBatch function)
- one table's typed changes as a stream: `table_stream(spark, config, "shop.orders", checkpoint)`; a change
  of its columns stops the query with `TableSchemaChanged` (restart to go on with the new schema)
- reading a lakehouse: `read_changelog`, `read_mirror`, `read_ddl_log` (typed DataFrames, no Delta jar)
- a configured session: `spark_session`; a table batch as Spark sees it: `TableName`, `BatchInfo`

Each name is imported on first use: tasks import `consumer.spark.source` without the driver's engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumer.exports import exported

if TYPE_CHECKING:
    from consumer.sinks.foreach_batch import BatchInfo, TableName
    from consumer.spark.engine import (
        ChangeBatches,
        LakehouseQuery,
        SparkQueryError,
        checkpoint_location,
        start_lakehouse,
        stream_options,
    )
    from consumer.spark.readers import read_changelog, read_ddl_log, read_mirror
    from consumer.spark.session import spark_session
    from consumer.spark.source import TicdcOptions, register
    from consumer.spark.table_source import TableSchemaChanged, table_stream

__all__ = [
    "BatchInfo",
    "ChangeBatches",
    "LakehouseQuery",
    "SparkQueryError",
    "TableName",
    "TableSchemaChanged",
    "TicdcOptions",
    "checkpoint_location",
    "read_changelog",
    "read_ddl_log",
    "read_mirror",
    "register",
    "spark_session",
    "start_lakehouse",
    "stream_options",
    "table_stream",
]
_HOMES = {  # public name -> the module defining it
    "start_lakehouse": "consumer.spark.engine",
    "LakehouseQuery": "consumer.spark.engine",
    "ChangeBatches": "consumer.spark.engine",
    "SparkQueryError": "consumer.spark.engine",
    "checkpoint_location": "consumer.spark.engine",
    "stream_options": "consumer.spark.engine",
    "register": "consumer.spark.source",
    "TicdcOptions": "consumer.spark.source",
    "read_changelog": "consumer.spark.readers",
    "read_mirror": "consumer.spark.readers",
    "read_ddl_log": "consumer.spark.readers",
    "spark_session": "consumer.spark.session",
    "table_stream": "consumer.spark.table_source",
    "TableSchemaChanged": "consumer.spark.table_source",
    "BatchInfo": "consumer.sinks.foreach_batch",
    "TableName": "consumer.sinks.foreach_batch",
}


def __getattr__(name: str) -> Any:
    return exported(__name__, _HOMES, globals(), name)


def __dir__() -> list[str]:
    return list(__all__)
