"""spark_session(): one configured local session, reused."""

from __future__ import annotations

from pyspark.sql import SparkSession

from consumer.spark.session import SQL_CONF, spark_session


def test_the_active_session_is_reused_with_the_sdk_settings(spark: SparkSession) -> None:
    spark.conf.set("spark.sql.session.timeZone", "Europe/Paris")
    try:
        assert spark_session("another-app") is spark
        assert {key: spark.conf.get(key) for key in SQL_CONF} == SQL_CONF
        assert spark.conf.get("spark.sql.parquet.outputTimestampType") == "TIMESTAMP_MICROS"
        assert spark.sparkContext.getConf().get("spark.ui.enabled") == "false"
    finally:
        spark.conf.set("spark.sql.session.timeZone", "UTC")
