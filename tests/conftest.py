"""Shared test setup: the embedded Kafka broker fixtures (`kafka_broker`, `kafka_topic`), one SparkSession,
one local S3-protocol server (`s3_server`, `s3_lake`), and markers: a test using the broker is `e2e`, one
using Spark is `spark`, one using the S3 server `s3` (`pytest -m "not e2e and not spark and not slow"` is the
fast set). Property tests run without hypothesis's per-example deadline.

The session marks its environment (`TICDC_TEST_SESSION`), which every process it starts inherits, and fails
the run if any such process is still alive when it ends: brokers, JVMs, decode workers, forkservers,
resource trackers and group members must all be gone, re-parented orphans included. Only this process's own
multiprocessing forkserver and resource tracker may remain: they end with it (their "alive" pipe), and
any worker one of them still serves is reported.
"""

pytest_plugins = ["consumer.testing.pytest_plugin"]


import json  # noqa: E402
import os  # noqa: E402
import uuid  # noqa: E402
from collections import Counter  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from _pytest.nodeid import coerce_node_id  # noqa: E402
from hypothesis import settings  # noqa: E402
from pyspark import SparkContext  # noqa: E402
from pyspark.sql import SparkSession  # noqa: E402

from consumer.spark.session import spark_session  # noqa: E402
from consumer.testing.processes import command_line, parent, wait_gone, with_environment  # noqa: E402
from consumer.testing.s3 import LocalS3Server  # noqa: E402
from tests.jvm_archive import JVM_LOG_OFF, ArchiveBuild, archive_path, build_in_background  # noqa: E402

# Property tests check values, never time: no per-example deadline, which a loaded 2-core CI machine can miss.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")

SESSION_MARK = "TICDC_TEST_SESSION"
# The suite's JVMs (the session's, every `run --engine spark`, a standalone cluster) live seconds to a
# minute: the client compiler alone and the serial collector cost them ~30% less CPU than C2 and G1 do.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
DURATIONS = Path(__file__).with_name("durations.json")
SPARK_GROUP = "spark"  # the `xdist_group` of the tests using the `spark` fixture
LEFTOVER_GRACE_SECONDS = 15.0  # processes asked to stop by the last tests may still be finishing


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """One local SparkSession per test run (its tests are one `xdist_group`): a cold start costs ~10 s.
    Its JVM is ended with it (it would otherwise live until the test process exits)."""
    session = spark_session("consumer-tests")
    session.sparkContext.setLogLevel("ERROR")
    yield session
    gateway = SparkContext._gateway
    session.stop()
    if gateway is not None:
        gateway.shutdown()
        gateway.proc.stdin.close()  # the JVM exits when its stdin closes
        gateway.proc.wait(60)
        SparkContext._gateway = SparkContext._jvm = None


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
        if "spark" in getattr(item, "fixturenames", ()):
            # one worker runs them all: the session's driver starts once a run, not once a worker
            item.add_marker(pytest.mark.xdist_group(SPARK_GROUP))
    _longest_first(items)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reports the collected ids to the controller
def pytest_collection_finish(session: pytest.Session) -> None:
    """Under `--dist loadgroup`, a test of an `xdist_group` gets the id `<nodeid>@<group>`, which the
    scheduler sends to one worker by. xdist 3.8 renames through `item._nodeid`, which pytest 9 no longer
    reads (the id is `item._id`), and before this conftest marks its groups: without this a group's tests
    are spread over the workers, and what they share (the notebook's run, the Spark session) runs on each."""
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        group = _group(item)
        if group is not None and not item.nodeid.endswith(f"@{group}"):
            item._id = coerce_node_id(f"{item.nodeid}@{group}")


def _longest_first(items: list[pytest.Item]) -> None:
    """Order the work units (a test, or an `xdist_group` of them) longest first, by the seconds
    `durations.json` recorded (`--durations=0` of an earlier run; a test it lacks counts 0). The workers
    take units one by one (`--dist loadgroup`): a long test never starts last, leaving a worker idle."""
    seconds = json.loads(DURATIONS.read_text())
    unit_of = {item.nodeid: _work_unit(item) for item in items}
    unit_seconds: Counter[str] = Counter()
    first_seen: dict[str, int] = {}
    for index, item in enumerate(items):
        unit = unit_of[item.nodeid]
        unit_seconds[unit] += seconds.get(item.nodeid.split("@")[0], 0.0)
        first_seen.setdefault(unit, index)
    items.sort(key=lambda item: (-unit_seconds[unit_of[item.nodeid]], first_seen[unit_of[item.nodeid]]))


def _work_unit(item: pytest.Item) -> str:
    group = _group(item)
    return f"@{group}" if group else item.nodeid


def _group(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker("xdist_group")
    return str(marker.args[0]) if marker else None


_archive_build: ArchiveBuild | None = None


def pytest_configure(config: pytest.Config) -> None:
    """The suite's JVM options, unless the caller chose their own, with the Spark driver archive
    (`tests/jvm_archive.py`): built in the background by the first process (the xdist controller) when
    missing; its workers inherit the options."""
    global _archive_build
    if "JAVA_TOOL_OPTIONS" in os.environ:
        return
    archive = archive_path(TEST_JVM_OPTIONS)
    if not hasattr(config, "workerinput"):
        _archive_build = build_in_background(archive, TEST_JVM_OPTIONS)
    os.environ["JAVA_TOOL_OPTIONS"] = f"{TEST_JVM_OPTIONS} -XX:SharedArchiveFile={archive} {JVM_LOG_OFF}"


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ.setdefault(SESSION_MARK, uuid.uuid4().hex)


_OWN_HELPERS = ("multiprocessing.forkserver import main", "multiprocessing.resource_tracker import main")


def _own_helper(pid: int) -> bool:
    return parent(pid) == os.getpid() and any(helper in command_line(pid) for helper in _OWN_HELPERS)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _archive_build is not None:
        _archive_build.stop()
    started = {
        pid for pid in with_environment(SESSION_MARK, os.environ[SESSION_MARK]) if not _own_helper(pid)
    }
    leftovers = wait_gone(started, LEFTOVER_GRACE_SECONDS)
    if leftovers:
        lines = "\n".join(f"  {pid} {command_line(pid)[:200]}" for pid in sorted(leftovers))
        session.config.get_terminal_writer().line(
            f"\n{len(leftovers)} process(es) started by the tests outlived them:\n{lines}", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
