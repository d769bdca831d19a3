"""Honest exits (issue 10): a refused authentication or an unreachable broker ends `run` with exit 4; SIGTERM
is a clean stop (apply what is resolved, commit, exit 0); and after SIGTERM or SIGKILL, with decode workers
or `--processes 2`, no process the command started is left. Issue 25: `run --until-idle` going idle without
a partition (never assigned, or lost) exits 5, naming the group, unless another of its members held one."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from lakehouse_checks import changelog_rows

from consumer.cli import EXIT_SOURCE_UNAVAILABLE, EXIT_UNASSIGNED
from consumer.config import load_config
from consumer.configured import build_dead_letters
from consumer.errors import DeadLetter, RecordLocation, SinkError
from consumer.kafka_config import REDACTED
from consumer.pipeline import Pipeline, PipelineStats
from consumer.protocol.model import DML, DMLType
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import encoded, produce_to_kafka, write_capture_file
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.dead_letter import DeadLetterFile, DeadLetterTopic
from consumer.sources.errors import SourceUnreachableError
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource
from consumer.sources.record import SourceRecord
from consumer.state.machine import ConsumerState
from consumer.stopping import StopRequest
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.processes import command_line, descendants, wait_gone

FAST_GROUP = {
    "TICDC_CONSUMER_KAFKA_SESSION_TIMEOUT_MS": "3000",
    "TICDC_CONSUMER_KAFKA_HEARTBEAT_INTERVAL_MS": "300",
}
FAST_KAFKA = {"session.timeout.ms": "3000", "heartbeat.interval.ms": "300"}


def _start(*args: str, env: dict[str, str] | None = None, log: Path) -> subprocess.Popen[str]:
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "consumer", "run", *args],
            env={**os.environ, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, as a command started from a terminal
        )


def _wait_for(condition: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}; log:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def _changelog_rows(root: Path) -> int:
    try:
        return changelog_rows(root)
    except Exception:  # tables still being created
        return 0


def _workload(partitions: int = 1) -> Workload:
    """Rows dispatched by key, so every partition holds rows: a lake holding every row means each member
    has read its partitions up to their last rows (table dispatch put both tables on one partition)."""
    config = WorkloadConfig(
        rows=600, tables=2, partitions=partitions, seed=5, ddl=False, dispatch="primary-key"
    )
    return Workload(config)


def _images(partitions: int = 1) -> int:
    """Changelog rows the workload makes: one per DML, two per UPDATE."""
    dmls = [r.message for r in _workload(partitions).records() if isinstance(r.message, DML)]
    return sum(2 if dml.type is DMLType.UPDATE else 1 for dml in dmls)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


# -- the source refuses or cannot be reached -------------------------------------------------------------
def test_a_broker_refusing_sasl_ends_run_with_exit_4(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """tansu has no SASL: the handshake a SASL client sends is refused, as wrong credentials would be."""
    topic = kafka_topic(1)
    env = {
        "TICDC_CONSUMER_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "TICDC_CONSUMER_KAFKA_SASL_MECHANISM": "PLAIN",
        "TICDC_CONSUMER_KAFKA_SASL_USERNAME": "reader",
        "TICDC_CONSUMER_KAFKA_SASL_PASSWORD": "hunter2-secret",
    }
    log = tmp_path / "run.log"
    started = time.monotonic()
    source = f"kafka://{kafka_broker.bootstrap_servers}/{topic}"
    process = _start(
        "--source", source, "--sink", f"delta:{tmp_path / 'lake'}", "--until-idle", "5", env=env, log=log
    )
    assert process.wait(120) == EXIT_SOURCE_UNAVAILABLE, log.read_text()[-3000:]
    output = log.read_text()
    assert "SourceAuthenticationError" in output and "refused this client" in output
    assert "hunter2-secret" not in output
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_no_broker_listening_ends_run_with_exit_4(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    process = _start(
        "--source", f"kafka://127.0.0.1:{_free_port()}/t", "--sink", f"delta:{tmp_path / 'lake'}",
        "--until-idle", "5", log=log,
    )  # fmt: skip
    assert process.wait(120) == EXIT_SOURCE_UNAVAILABLE, log.read_text()[-3000:]
    assert "SourceUnreachableError: no broker of 127.0.0.1:" in log.read_text()


@pytest.mark.slow
def test_brokers_lost_for_longer_than_the_timeout_end_the_source() -> None:
    """Once connected, an outage is waited out for `unreachable_timeout`; then a metadata request decides."""
    broker = EmbeddedBroker()
    try:
        broker.create_topic("lost", 1)
        source = KafkaSource(
            broker.bootstrap_servers, ["lost"], "g", config=FAST_KAFKA, unreachable_timeout=1.0
        )
        deadline = time.monotonic() + 30
        while not source.assignment() and time.monotonic() < deadline:
            source.poll_batch(10, 0.2)
        assert source.assignment()
        broker.stop()
        started = time.monotonic()
        with pytest.raises(
            SourceUnreachableError, match=f"no broker of {broker.bootstrap_servers} reachable"
        ):
            while time.monotonic() - started < 60:
                source.poll_batch(10, 0.2)
        assert time.monotonic() - started < 30
        source.close()
    finally:
        broker.stop()


# -- signals ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ctrl_c", [False, True], ids=["sigterm", "ctrl-c-to-the-process-group"])
def test_a_stop_signal_applies_commits_and_leaves_no_decode_worker(tmp_path: Path, ctrl_c: bool) -> None:
    """SIGTERM to the command, or SIGINT to its whole process group as a terminal's Ctrl-C sends it (the
    decode workers get it too, and must leave stopping to the command)."""
    workload = _workload()
    source = tmp_path / "capture.jsonl"
    write_capture_file(workload, MessageEncoder("json"), "cdc", source)
    root, log = tmp_path / "lake", tmp_path / "run.log"
    process = _start("--source", f"file:{source}", "--sink", f"delta:{root}", log=log)  # workers: default 2
    _wait_for(lambda: len(descendants(process.pid)) >= 4, 60, "decode workers", log)
    started = descendants(process.pid)
    # the file source never ends by itself: stop it once every row is applied (and the run is waiting)
    expected = _images()
    _wait_for(lambda: _changelog_rows(root) == expected, 120, "every row in the lake", log)
    if ctrl_c:
        os.killpg(process.pid, signal.SIGINT)
    else:
        process.send_signal(signal.SIGTERM)
    assert process.wait(60) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert f"{'SIGINT' if ctrl_c else 'SIGTERM'}: stopping after this cycle" in output
    assert " dead letters" in output and "decode workers unusable" not in output
    assert wait_gone(started, 10) == set(), [command_line(pid) for pid in started]
    assert _changelog_rows(root) == expected


def test_sigkill_leaves_no_decode_worker_forkserver_or_tracker(tmp_path: Path) -> None:
    source = tmp_path / "capture.jsonl"
    write_capture_file(_workload(), MessageEncoder("json"), "cdc", source)
    log = tmp_path / "run.log"
    process = _start("--source", f"file:{source}", "--sink", f"delta:{tmp_path / 'lake'}", log=log)
    _wait_for(lambda: len(descendants(process.pid)) >= 4, 60, "decode workers", log)
    started = descendants(process.pid)
    assert any("forkserver" in command_line(pid) for pid in started)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert wait_gone(started, 30) == set(), [command_line(pid) for pid in started]


def _group_run(broker: EmbeddedBroker, topic: str, root: Path, log: Path) -> subprocess.Popen[str]:
    source = f"kafka://{broker.bootstrap_servers}/{topic}"
    group = ("--group", f"{topic}.g", "--processes", "2")
    return _start("--source", source, *group, "--sink", f"delta:{root}", env=FAST_GROUP, log=log)


def _members(process: subprocess.Popen[str]) -> set[int]:
    return {pid for pid in descendants(process.pid) if "multiprocessing.spawn" in command_line(pid)}


def test_sigterm_of_a_two_process_group_commits_everything_and_leaves_no_member(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(2)
    workload = _workload(partitions=2)
    report = produce_to_kafka(workload, MessageEncoder("json"), kafka_broker.bootstrap_servers, topic)
    root, log = tmp_path / "lake", tmp_path / "run.log"
    process = _group_run(kafka_broker, topic, root, log)
    _wait_for(lambda: len(_members(process)) == 1, 60, "the second member", log)
    started = descendants(process.pid)
    _wait_for(lambda: _changelog_rows(root) == _images(2), 180, "every row in the lake", log)
    process.send_signal(signal.SIGTERM)
    assert process.wait(90) == 0, log.read_text()[-3000:]
    assert wait_gone(started, 30) == set(), [command_line(pid) for pid in started]
    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], f"{topic}.g", partitions=ALL_PARTITIONS
    ) as source:
        committed = source.committed([(topic, p) for p in range(2)])
    assert committed == {(topic, p): report.end_offsets[p] for p in range(2)}, log.read_text()[-6000:]


def test_sigkill_of_a_two_process_group_leaves_no_member(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(2)
    produce_to_kafka(_workload(partitions=2), MessageEncoder("json"), kafka_broker.bootstrap_servers, topic)
    log = tmp_path / "run.log"
    process = _group_run(kafka_broker, topic, tmp_path / "lake", log)
    # the command's own member holding one of the two partitions: the other member is in its loop
    _wait_for(
        lambda: re.search(r" assigned \[\([^)]*\)\]$", log.read_text(), re.MULTILINE) is not None,
        120,
        "a split",
        log,
    )
    started = descendants(process.pid)
    process.send_signal(signal.SIGKILL)
    process.wait(30)
    assert wait_gone(started, 120) == set(), [command_line(pid) for pid in started]


def test_a_dead_letter_topic_carries_the_reason_code_header(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Its producer gets `[errors.kafka]`, not the consumer's settings (SASL here, which tansu refuses)."""
    topic, servers = kafka_topic(1), kafka_broker.bootstrap_servers
    sasl = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.password": "hunter2"}
    overrides: dict[str, dict[str, Any]] = {
        "source": {"url": f"kafka://{servers}/cdc", "kafka": sasl},
        "sink": {"url": f"jsonl:{tmp_path}"},
        "errors": {"dead_letter": f"kafka://{servers}/{topic}", "kafka": {"client.id": "dead-letters"}},
    }
    letters = build_dead_letters(load_config(overrides=overrides, environ={}))
    letters.write(
        DeadLetter(RecordLocation("cdc", 2, 41), "CompressionBombError: big", b"\x04\x22", "compression-bomb")
    )
    letters.close()
    consumer = Consumer({"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": "dlq-headers"})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        message = consumer.poll(30)
        assert message is not None and message.error() is None
        assert dict(message.headers() or []) == {
            "ticdc.reason": b"CompressionBombError: big",
            "ticdc.reason_code": b"compression-bomb",
            "ticdc.source": b"cdc[2]@41",
            "ticdc.topic": b"cdc",  # the origin, field by field, for a replay
            "ticdc.partition": b"2",
            "ticdc.offset": b"41",
        }
        assert message.value() == b"\x04\x22"
    finally:
        consumer.close()


def test_dead_letter_producer_errors_do_not_leak_secrets(kafka_broker: EmbeddedBroker) -> None:
    # librdkafka echoes invalid values; here the secret doubles as a bad value for another property.
    settings = {"sasl.password": "hunter2", "security.protocol": "hunter2"}
    with pytest.raises(SinkError, match="dead-letter producer") as failure:
        DeadLetterTopic(kafka_broker.bootstrap_servers, "letters", settings)
    assert "hunter2" not in str(failure.value) and REDACTED in str(failure.value)
    assert failure.value.__cause__ is None and failure.value.__context__ is None


def test_the_first_stop_signal_asks_the_second_interrupts_and_handlers_are_restored() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with StopRequest.on_signals() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        # handlers run in the main thread, between bytecodes: wait for this one's effect, not a while
        deadline = time.monotonic() + 10
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.001)
        assert stop.requested and stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)  # a deadline, not a wait: the handler's KeyboardInterrupt interrupts the sleep
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


# -- idle without a partition ------------------------------------------------------------------------------
GRACE = {"TICDC_CONSUMER_SOURCE_JOIN_GRACE_S": "2"}


@pytest.fixture
def holder(kafka_broker: EmbeddedBroker) -> Iterator[Callable[[str, str], None]]:
    """`holder(topic, group)`: a member of `group` that holds `topic`'s partition while the test lasts. It
    joins first, and its member id sorts before a `run`'s (client.id "a-holder" < "rdkafka"), so the range
    assignor leaves it the partition at every rebalance: what a member killed before its assignment (tansu)
    or a stranger sharing the group id does to a later `run`."""
    stop = threading.Event()
    pollers: list[threading.Thread] = []

    def hold(topic: str, group: str) -> None:
        settings = {"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": group}
        consumer = Consumer({**settings, "client.id": "a-holder", **FAST_KAFKA})
        consumer.subscribe([topic])
        deadline = time.monotonic() + 60
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(0.1)
        assert consumer.assignment(), "the holder got no partition"

        def poll() -> None:
            while not stop.is_set():
                consumer.poll(0.1)
            consumer.close()

        pollers.append(threading.Thread(target=poll))
        pollers[-1].start()

    yield hold
    stop.set()
    for poller in pollers:
        poller.join(30)


def test_a_run_never_assigned_exits_5_naming_the_group(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, holder: Callable[[str, str], None], tmp_path: Path
) -> None:
    topic = kafka_topic(1)
    group = f"{topic}.g"
    holder(topic, group)
    log = tmp_path / "run.log"
    source = f"kafka://{kafka_broker.bootstrap_servers}/{topic}"
    started = time.monotonic()
    process = _start(
        "--source", source, "--group", group, "--sink", f"delta:{tmp_path / 'lake'}", "--until-idle", "1",
        env={**FAST_GROUP, **GRACE}, log=log,
    )  # fmt: skip
    assert process.wait(120) == EXIT_UNASSIGNED, log.read_text()[-3000:]
    took = time.monotonic() - started
    output = log.read_text()
    said = re.search(
        rf"^no partitions assigned to group {re.escape(group)} within (\d+) seconds$", output, re.M
    )
    assert said is not None, output[-3000:]
    assert 1 + 2 <= int(said.group(1)) <= took  # until idle, then the grace
    # tansu describes the group without its members (STABLE, or UNKNOWN once the `run` left)
    unknown = rf"members unknown \(the broker reports group {re.escape(group)} [A-Z_]+ but lists no member\)"
    assert re.search(unknown, output), output[-3000:]
    assert f"went idle holding no partition of group {group} for " in output
    assert "0 records, 0 changelog rows" in output


def _produce_until(servers: str, topic: str, workload: Workload, done: Callable[[], bool]) -> None:
    """`workload`'s stream, a record every 20 ms (so its reader never goes idle) until `done()`, then the
    rest at once."""
    producer = Producer({"bootstrap.servers": servers})
    for record, (key, value) in encoded(workload, MessageEncoder("json")):
        producer.produce(topic, value=value, key=key, partition=record.partition)
        if not done():
            producer.flush()
            time.sleep(0.02)
    producer.flush()


def test_a_member_of_a_group_with_fewer_partitions_than_members_holding_none_exits_0(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """`--processes 2` on one partition: one member rightly holds nothing, and goes idle (saying so) while
    the other is busy; the command exits 0 once the other applied every row."""
    topic = kafka_topic(1)
    config = WorkloadConfig(rows=3000, tables=2, partitions=1, seed=5, ddl=False)
    root, log = tmp_path / "lake", tmp_path / "run.log"
    process = _start(
        "--source", f"kafka://{kafka_broker.bootstrap_servers}/{topic}", "--group", f"{topic}.g",
        "--processes", "2", "--sink", f"delta:{root}", "--until-idle", "5", env={**FAST_GROUP, **GRACE},
        log=log,
    )  # fmt: skip
    said = f"went idle holding no partition of group {topic}.g for "
    _produce_until(kafka_broker.bootstrap_servers, topic, Workload(config), lambda: said in log.read_text())
    assert process.wait(180) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert output.count(said) == 1, output[-3000:]
    assert "no partitions assigned" not in output
    dmls = [r.message for r in Workload(config).records() if isinstance(r.message, DML)]  # the same
    assert _changelog_rows(root) == sum(2 if dml.type is DMLType.UPDATE else 1 for dml in dmls)


class _LosingSource:
    """No records; the partition is held for the first `held_polls` polls, then lost for good. A poll waits
    its timeout, as a broker's with nothing to deliver does."""

    def __init__(self, held_polls: int) -> None:
        self.polls, self.held_polls = 0, held_polls

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        self.polls += 1
        time.sleep(timeout)
        return []

    def assignment(self) -> set[tuple[str, int]]:
        return {("cdc", 0)} if self.polls <= self.held_polls else set()

    def commit(self, offsets: Mapping[tuple[str, int], int]) -> None:
        raise AssertionError("nothing to commit")

    def committed(self, partitions: Iterable[tuple[str, int]]) -> dict[tuple[str, int], int | None]:
        return {}

    def pause(self, partitions: Iterable[tuple[str, int]]) -> None:
        pass

    def resume(self, partitions: Iterable[tuple[str, int]]) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.mark.parametrize("held_polls", [0, 4, 10_000], ids=["never", "lost", "kept"])
def test_a_member_idle_without_a_partition_says_for_how_long(tmp_path: Path, held_polls: int) -> None:
    """Bounds with seconds of slack: a loaded machine stretches every poll, never shortens one."""
    idle, grace, poll = 1.0, 2.0, 0.05
    pipeline = Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[],
        dead_letters=DeadLetterFile(tmp_path / "letters.jsonl"),
        poll_timeout=poll,
        join_grace=grace,
    )
    source = _LosingSource(held_polls)
    started = time.monotonic()
    stats = pipeline.run(source, until_idle=idle)
    took = time.monotonic() - started
    pipeline.close()
    if held_polls > source.polls:
        assert stats.unassigned_s is None
        assert took < idle + grace  # held: no grace
        return
    # idle counts from the start; without a partition, the grace comes on top
    assert took >= idle + grace
    assert stats.unassigned_s is not None
    if held_polls:  # since it lost the partition (it held it for 4 polls of at least 0.05 s)
        assert idle <= stats.unassigned_s <= took - held_polls * poll
    else:  # the whole run but the first poll
        assert took - idle <= stats.unassigned_s <= took


def test_a_group_went_idle_unassigned_only_if_every_member_did() -> None:
    held, three, five = PipelineStats(), PipelineStats(unassigned_s=3.0), PipelineStats(unassigned_s=5.0)
    assert held.combined(three).unassigned_s is None
    assert three.combined(held).unassigned_s is None
    assert five.combined(three).unassigned_s == 3.0  # the group was without partitions this long


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        (["--max-batch-records", "0"], "budget.max_batch_records = 0: it must be positive"),
        (["--max-batch-records", "-3"], "budget.max_batch_records = -3: it must be positive"),
        (["--pending-bytes", "0"], "budget.pending_bytes = 0: it must be positive"),
        (["--pending-timeout-s", "-1"], "budget.pending_timeout_s = -1.0: it must be 0 or more"),
        (["--sink", "delta:"], "sink 'delta:' names no root"),
        (["--sink", "parquet: "], "sink 'parquet: ' names no root"),
    ],
)
def test_a_setting_that_would_make_a_run_read_or_write_nothing_is_refused_at_start(
    tmp_path: Path, setting: list[str], said: str
) -> None:
    """Issue 39: these ran and exited 0 with everything unread (or wrote the lake into the current
    directory); they are a `ConfigError` now, exit 2, before anything is read."""
    capture = tmp_path / "c.jsonl"
    write_capture_file(
        Workload(WorkloadConfig(rows=20, tables=1, partitions=1)), MessageEncoder(), "t", capture
    )
    sink = ["--sink", f"delta:{tmp_path / 'lake'}"] if "--sink" not in setting else []
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumer",
            "run",
            "--source",
            f"file:{capture}",
            *sink,
            *setting,
            "--until-idle",
            "1",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert said in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["c.jsonl"])  # nothing written anywhere
