"""Shared test setup: the embedded Kafka broker fixtures (`kafka_broker`, `kafka_topic`), one SparkSession,
one local S3-protocol server (`s3_server`, `s3_lake`), and markers: a test using the broker is `e2e`, one
using Spark is `spark`, one using the S3 server `s3` (`pytest -m "not e2e and not spark and not slow"` is the
fast set)."""

pytest_plugins = ["consumer.testing.pytest_plugin"]


import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import pyarrow.fs as pafs  # noqa: E402
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


@dataclass(frozen=True)
class S3Server:
    """A moto S3 server process: `environment` is what delta-rs and pyarrow need to reach it (the standard
    AWS_* variables), `storage_options` the same as delta-rs storage options."""

    endpoint: str

    @property
    def storage_options(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
        }

    @property
    def environment(self) -> dict[str, str]:
        return dict(self.storage_options)

    def bucket(self) -> str:
        name = f"lake-{uuid.uuid4().hex[:12]}"
        filesystem = pafs.S3FileSystem(
            endpoint_override=self.endpoint.removeprefix("http://"),
            scheme="http",
            access_key="testing",
            secret_key="testing",
            region="us-east-1",
            allow_bucket_creation=True,
        )
        filesystem.create_dir(name)
        return name


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto S3 server process per test session, stopped (and waited for) at its end."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("w")
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (exit code {process.poll()})") from None
                time.sleep(0.05)
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.fixture
def s3_lake(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> str:
    """`s3://<fresh bucket>/lake`, with the server's AWS_* variables set for this test (as a user sets them
    for delta-rs)."""
    for name, value in s3_server.environment.items():
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
