"""Shared test setup: the embedded Kafka broker fixtures (`kafka_broker`, `kafka_topic`), one SparkSession,
one local S3-protocol server (`s3_server`, `s3_lake`), and markers: a test using the broker is `e2e`, one
using Spark is `spark`, one using the S3 server `s3` (`pytest -m "not e2e and not spark and not slow"` is the
fast set)."""

pytest_plugins = ["consumer.testing.pytest_plugin"]


import os  # noqa: E402
from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from consumer.spark.session import spark_session  # noqa: E402
from consumer.testing.s3 import LocalS3Server  # noqa: E402


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession per test run: a cold start costs ~10 s."""
    session = spark_session("consumer-tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LocalS3Server]:
    """One S3-protocol server (moto) per test run; this process and its children reach it as S3 through the
    usual AWS environment variables, set for the session."""
    with LocalS3Server() as server:
        saved = {name: os.environ.get(name) for name in server.environment()}
        os.environ.update(server.environment())
        try:
            yield server
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture
def s3_lake(s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<fresh bucket>/lake`, with the server's AWS_* variables set for this test (as a user sets them
    for delta-rs)."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    return f"s3://{s3_server.bucket()}/lake"


_MARKED_BY_FIXTURE = {
    "kafka_broker": "e2e",
    "kafka_topic": "e2e",
    "spark": "spark",
    "s3_server": "s3",
    "s3_lake": "s3",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            marker = _MARKED_BY_FIXTURE.get(fixture)
            if marker:
                item.add_marker(marker)
