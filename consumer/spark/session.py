"""A local SparkSession configured the way the SDK's Arrow and Parquet paths assume."""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

# Runtime SQL settings the SDK relies on; also applied to a reused session.
SQL_CONF: dict[str, str] = {
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    # 10k (the default) splits a large batch into many tiny partitions
    "spark.sql.execution.arrow.maxRecordsPerBatch": "100000",
    # INT96 (the default) is deprecated and other readers (delta-rs, pyarrow) read it differently
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
    # TIMESTAMP (LTZ) values are instants; UTC keeps their rendering independent of the machine
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "4",
}


def spark_session(
    app_name: str = "ticdc-consumer", master: str | None = None, driver_memory: str = "2g"
) -> SparkSession:
    """The active session with the SDK's settings applied, or a new one without a UI: on `master`, else
    where `spark-submit` said (when it started this process), else `local[2]`.

    In local mode the driver heap holds every batch handed to Spark and the writers' buffers: the default
    1g ran out writing a 500k-row all-types batch (and the session then hung instead of failing). Python
    workers (the `ticdc` source's tasks, on every node) run this interpreter unless `PYSPARK_PYTHON` names
    another (see the README for a cluster whose nodes keep it elsewhere).
    """
    active = SparkSession.getActiveSession()
    if active is not None:
        for key, value in SQL_CONF.items():
            active.conf.set(key, value)
        return active
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # read when the context starts
    builder = (
        SparkSession.builder.appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # progress bars would garble a consumer's logs
    )
    if master or not _submitted():
        builder = builder.master(master or "local[2]").config("spark.driver.memory", driver_memory)
    for key, value in SQL_CONF.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _submitted() -> bool:
    """Whether `spark-submit` started this process (its JVM runs already, with its --master and --conf)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ
