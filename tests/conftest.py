"""Shared test setup: the embedded Kafka broker fixtures (`kafka_broker`, `kafka_topic`)."""

pytest_plugins = ["consumer.testing.pytest_plugin"]


from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from consumer.spark.session import spark_session  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession per test run: a cold start costs ~10 s."""
    session = spark_session("consumer-tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()
