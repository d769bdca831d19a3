"""End to end on the real (embedded tansu) broker: simulator -> Kafka -> pipeline -> JSON-lines sink.

Every test checks the delivered changelog against the simulator's ground truth or against the exact set of
DML records, so loss, duplication (beyond legitimate redelivery) or a wrong typed value fails it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Consumer, ConsumerGroupState
from confluent_kafka import TopicPartition as KafkaTopicPartition
from confluent_kafka.admin import AdminClient
from jsonl_outputs import delivered_ddls, delivered_rows, unique_images

from consumer.pipeline import Pipeline
from consumer.protocol.model import RawDML
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import WatermarkHeartbeat, produce_to_kafka, write_ground_truth
from consumer.simulate.truth import differences, load_truth, replay_changelog
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sinks.jsonl import JsonLinesSink
from consumer.sources.base import FixedStarts, RebalanceListener
from consumer.sources.capture import read_capture
from consumer.sources.errors import SourceError
from consumer.sources.files import FileSource
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource, capture_topic
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.state.machine import ConsumerState
from consumer.stopping import StopRequest
from consumer.testing.broker import EmbeddedBroker

FAST_GROUP = {"session.timeout.ms": "3000", "heartbeat.interval.ms": "300"}
Offsets = set[tuple[str, int, int]]


def _simulation(
    broker: EmbeddedBroker,
    topic: str,
    tmp: Path,
    encoding: str = "json",
    compression: str = "none",
    **options: Any,
) -> tuple[Workload, dict[str, Any]]:
    workload = Workload(WorkloadConfig(**{"rows": 4000, "tables": 3, "partitions": 3, **options}))
    encoder = MessageEncoder(encoding, compression)  # type: ignore[arg-type]
    produce_to_kafka(workload, encoder, broker.bootstrap_servers, topic)
    return workload, write_ground_truth(workload, tmp / "truth.json")


def _simulate(broker: EmbeddedBroker, topic: str, tmp: Path, *args: Any, **options: Any) -> dict[str, Any]:
    return _simulation(broker, topic, tmp, *args, **options)[1]


def _pipeline(root: Path, group: str, **options: Any) -> Pipeline:
    return Pipeline(
        group=group,
        state=ConsumerState(),
        sinks=[JsonLinesSink(root)],
        dead_letters=DeadLetterFile(root / "_dead_letters.jsonl"),
        **options,
    )


def _consume(
    broker: EmbeddedBroker,
    topic: str,
    root: Path,
    group: str,
    *,
    until_idle: float = 1.0,
    starts: dict[tuple[str, int], int] | None = None,
) -> Pipeline:
    group = f"{topic}.{group}"  # the broker outlives tests: a group of an earlier test must not interfere
    pipeline = _pipeline(root, group)
    source = KafkaSource(
        broker.bootstrap_servers,
        [topic],
        group,
        config=FAST_GROUP,
        listener=FixedStarts(starts or {}, then=pipeline),
    )
    try:
        pipeline.run(source, until_idle=until_idle)
    finally:
        source.close()
    return pipeline


def _dml_offsets(records: Iterable[Any], starts: dict[tuple[str, int], int] | None = None) -> Offsets:
    decoder = MessageDecoder()
    return {
        (r.topic, r.partition, r.offset)
        for r in records
        if isinstance(decoder.decode(r.value), RawDML)
        and r.offset >= (starts or {}).get((r.topic, r.partition), 0)
    }


def _offsets_of(rows: dict[str, list[dict[str, Any]]]) -> Offsets:
    return {(r["_topic"], r["_partition"], r["_offset"]) for images in rows.values() for r in images}


@pytest.mark.parametrize(("encoding", "compression"), [("json", "none"), ("avro", "lz4")])
def test_from_the_beginning_every_row_arrives_in_order_and_typed(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path, encoding: str, compression: str
) -> None:
    topic = kafka_topic(3)
    truth = _simulate(kafka_broker, topic, tmp_path, encoding, compression, dispatch="primary-key")
    _consume(kafka_broker, topic, tmp_path / "out", "from-start")
    rows = delivered_rows(tmp_path / "out")
    assert differences(replay_changelog(rows, delivered_ddls(tmp_path / "out")), truth) == []
    for images in rows.values():
        commit_ts = [r["_commit_ts"] for r in images]
        assert commit_ts == sorted(commit_ts)
    assert not (tmp_path / "out" / "_dead_letters.jsonl").read_text()


def test_mid_stream_join_holds_rows_until_the_next_bootstrap(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    _simulate(kafka_broker, topic, tmp_path, ddl=False, bootstrap_every_rows=400)
    capture = tmp_path / "all.jsonl"
    capture_topic(kafka_broker.bootstrap_servers, topic, capture, idle_seconds=2.0)
    records = list(read_capture(capture))
    # join after the first BOOTSTRAP of every partition: start each partition half-way through it
    ends = {(r.topic, r.partition): r.offset + 1 for r in records}
    starts = {tp: end // 2 for tp, end in ends.items()}
    pipeline = _consume(kafka_broker, topic, tmp_path / "out", "mid-stream", starts=starts)
    delivered = _offsets_of(delivered_rows(tmp_path / "out"))
    assert delivered == _dml_offsets(records, starts)
    assert pipeline.stats.dead_letters == 0


class _StallingFetches:
    """The real source, each poll returning at most 50 records, and none at all for `stall_s` after the
    first batch: fetches as slow as on a loaded machine, while records wait."""

    def __init__(self, source: KafkaSource, stall_s: float) -> None:
        self._source = source
        self._stall_s = stall_s
        self._stalled_until: float | None = None

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        if self._stalled_until is not None and time.monotonic() < self._stalled_until:
            time.sleep(timeout)
            return []
        records = self._source.poll_batch(min(max_records, 50), timeout)
        if records and self._stalled_until is None:
            self._stalled_until = time.monotonic() + self._stall_s
        return records

    # Spelled out: from Python 3.12 an isinstance check of a runtime-checkable protocol (`KnowsItsEnd`,
    # `CountsPartitions`, `CarriesWatermarks`) looks methods up statically, past `__getattr__`
    def behind(self) -> bool:
        return self._source.behind()

    def partition_counts(self) -> dict[str, int]:
        return self._source.partition_counts()

    def commit(self, offsets: Any, watermarks: Any = None) -> None:
        self._source.commit(offsets, watermarks)

    def committed_watermarks(self, partitions: Any) -> Any:
        return self._source.committed_watermarks(partitions)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


def test_until_idle_waits_out_fetches_that_stall_while_records_wait(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Polls come back empty for 2 s, six times `until_idle`, after the first 50 records: the source says
    records wait, so the run is not idle, and it ends with the whole stream applied (it ended after 50)."""
    topic = kafka_topic(3)
    truth = _simulate(kafka_broker, topic, tmp_path, rows=600)
    pipeline = _pipeline(tmp_path / "out", f"{topic}.stalled")
    source = KafkaSource(
        kafka_broker.bootstrap_servers,
        [topic],
        f"{topic}.stalled",
        partitions=ALL_PARTITIONS,
        listener=pipeline,
    )
    try:
        stats = pipeline.run(_StallingFetches(source, stall_s=2.0), until_idle=0.3)  # type: ignore[arg-type]
    finally:
        source.close()
    rows = delivered_rows(tmp_path / "out")
    assert differences(replay_changelog(rows, delivered_ddls(tmp_path / "out")), truth) == []
    assert stats.records > 50


def test_capture_then_replay_delivers_the_same_stream_as_kafka(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    _simulate(kafka_broker, topic, tmp_path, "avro", "snappy")
    _consume(kafka_broker, topic, tmp_path / "kafka", "capture-compare")
    capture = tmp_path / "capture.jsonl"
    capture_topic(kafka_broker.bootstrap_servers, topic, capture, idle_seconds=2.0)
    replay = _pipeline(tmp_path / "file", "replay")
    replay.run(FileSource(capture, listener=replay), until_idle=0.2)
    assert delivered_rows(tmp_path / "file") == delivered_rows(tmp_path / "kafka")


@pytest.mark.slow
def test_three_members_joining_and_leaving_lose_nothing(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(6)
    workload, truth = _simulation(
        kafka_broker, topic, tmp_path, rows=12000, partitions=6, dispatch="primary-key"
    )
    heartbeat = WatermarkHeartbeat(workload, MessageEncoder(), kafka_broker.bootstrap_servers, topic)
    root = tmp_path / "out"  # members of one group share the output, as they share the lakehouse
    joined = [threading.Event() for _ in range(3)]
    left = threading.Event()
    delivered_by: dict[int, int] = {}

    def member(index: int) -> None:
        # join one after another: each member once the previous one holds partitions
        if index and not joined[index - 1].wait(120):
            return  # reported below: "a member never got partitions"
        pipeline = _pipeline(root, f"{topic}.trio", max_batch_records=300)
        source = KafkaSource(
            kafka_broker.bootstrap_servers,
            [topic],
            f"{topic}.trio",
            config=FAST_GROUP,
            listener=_Joining(pipeline, joined[index]),
        )

        def pace_and_maybe_leave(p: Pipeline) -> None:
            everyone_in = all(event.is_set() for event in joined)
            # pacing, not synchronisation: a member must keep polling to take part in the rebalances, so it
            # slows down (rather than blocks) until all three have joined, leaving most of the stream unread
            time.sleep(0.02 if everyone_in else 0.2)
            if index == 1 and everyone_in and p.stats.rows > 300:
                left.set()
                raise _Leave

        try:
            pipeline.run(source, until_idle=4.0, on_cycle=pace_and_maybe_leave)
        except _Leave:
            pass
        finally:
            source.close()
            delivered_by[index] = pipeline.stats.rows

    threads = [threading.Thread(target=member, args=(i,)) for i in range(3)]
    with heartbeat:  # TiCDC keeps broadcasting its checkpoint while idle
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
    assert all(event.is_set() for event in joined), "a member never got partitions"
    assert left.is_set(), "the second member never left mid-run"
    assert all(delivered_by.get(i) for i in range(3)), f"a member delivered nothing: {delivered_by}"
    union = unique_images(delivered_rows(root))
    assert differences(replay_changelog(union, delivered_ddls(root)), truth) == []


class _Joining(RebalanceListener):
    """A member's pipeline as its listener, saying when the member first got partitions."""

    def __init__(self, pipeline: Pipeline, joined: threading.Event) -> None:
        self._pipeline = pipeline
        self._joined = joined

    def on_assign(self, partitions: list[TopicPartition]) -> Any:
        self._joined.set()
        return self._pipeline.on_assign(partitions)

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self._pipeline.on_revoke(partitions)


class _Leave(Exception):
    """Makes a member leave the group mid-run (its source closes and revokes)."""


@pytest.mark.slow
def test_sigkill_and_restart_resumes_from_committed_offsets_without_loss(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    _simulate(kafka_broker, topic, tmp_path, rows=20000, dispatch="primary-key")
    out = tmp_path / "out"
    command = [
        sys.executable,
        "-m",
        "consumer",
        "run",
        "--source",
        f"kafka://{kafka_broker.bootstrap_servers}/{topic}",
        "--group",
        f"{topic}.killed",
        "--sink",
        f"jsonl:{out}",
        "--until-idle",
        "3",
    ]
    env = {
        **os.environ,
        "TICDC_CONSUMER_KAFKA_SESSION_TIMEOUT_MS": "3000",
        "TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": "500",
    }
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    partitions = [(topic, p) for p in range(3)]
    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], f"{topic}.killed", partitions=ALL_PARTITIONS
    ) as group:  # reads the group's commits without joining it
        deadline = time.monotonic() + 120
        while not any(group.committed(partitions).values()):  # kill once the run has committed offsets
            assert first.poll() is None, "the first run ended before it committed anything"
            assert time.monotonic() < deadline, "the first run committed no offset within 120 s"
            time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL, "the first run ended by itself, before the kill"
    before = _offsets_of(delivered_rows(out))
    assert before, "the first run delivered nothing before it was killed"
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert second.returncode == 0, second.stderr[-2000:]
    rows = delivered_rows(out)
    assert _offsets_of(rows) > before, "the restart had nothing left to deliver: the kill came too late"
    truth = load_truth(tmp_path / "truth.json")
    assert differences(replay_changelog(unique_images(rows), delivered_ddls(out)), truth) == []


@pytest.mark.slow
def test_a_cycle_slower_than_the_poll_interval_costs_the_membership_not_the_run(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """librdkafka leaves the group when the loop does not poll within `max.poll.interval.ms` (a slow sink
    write) and reports _MAX_POLL_EXCEEDED: a transient error, retried; the member rejoins and resumes from
    the last commit, with the watermark it carried (a partition read to its end has none left to read, and
    this finished stream sends no more)."""
    topic = kafka_topic(2)
    truth = _simulate(kafka_broker, topic, tmp_path, rows=600, tables=1, partitions=2)
    ends = _end_offsets(kafka_broker, topic, 2)
    group, root = f"{topic}.slow", tmp_path / "out"
    pipeline = _pipeline(root, group, max_batch_records=200)
    source = KafkaSource(
        kafka_broker.bootstrap_servers,
        [topic],
        group,
        config={**FAST_GROUP, "max.poll.interval.ms": "3000"},
        listener=_Joining(pipeline, joined := threading.Event()),
    )
    # reads the group's commits without joining it
    watcher = KafkaSource(kafka_broker.bootstrap_servers, [topic], group, partitions=ALL_PARTITIONS)
    slowed: list[bool] = []
    done = StopRequest()

    def slow_once_then_stop_when_committed(p: Pipeline) -> None:
        if p.stats.rows and not slowed:
            slowed.append(True)
            _wait_until_put_out(kafka_broker, group)  # the loop blocks past max.poll.interval.ms, once
            joined.clear()  # set again when the member is given partitions again
        if slowed and joined.is_set() and watcher.committed(ends) == ends:
            done.request("rejoined, everything applied and committed")

    with caplog.at_level("WARNING", logger="consumer.sources.retry"):
        try:
            pipeline.run(source, on_cycle=slow_once_then_stop_when_committed, stop=done)
        finally:
            source.close()
            watcher.close()
    assert "_MAX_POLL_EXCEEDED" in caplog.text and "retrying" in caplog.text
    rows = unique_images(delivered_rows(root))
    assert differences(replay_changelog(rows, delivered_ddls(root)), truth) == []


def _end_offsets(broker: EmbeddedBroker, topic: str, partitions: int) -> dict[TopicPartition, int | None]:
    """The offset after each partition's last record (the stream is finished)."""
    client = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": f"{topic}.ends"})
    try:
        return {
            (topic, p): client.get_watermark_offsets(KafkaTopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        }
    finally:
        client.close()


def _wait_until_put_out(broker: EmbeddedBroker, group: str) -> None:
    """Block until the broker reports the group empty: its one member, not polling, was put out."""
    admin = AdminClient({"bootstrap.servers": broker.bootstrap_servers})
    for _ in range(600):  # asks the broker until it says so; the bound is only for a broken broker
        description = admin.describe_consumer_groups([group])[group].result(timeout=10)
        if description.state == ConsumerGroupState.EMPTY:
            return
        time.sleep(0.1)
    raise AssertionError(f"the broker never put the blocked member of {group} out")


def test_a_permanent_source_error_stops_the_run_without_retrying(
    kafka_broker: EmbeddedBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline = _pipeline(tmp_path, "absent-topic")
    source = KafkaSource(
        kafka_broker.bootstrap_servers,
        ["absent"],
        "absent-topic",
        config=FAST_GROUP,
        listener=pipeline,
    )
    with caplog.at_level("WARNING", logger="consumer.sources.retry"):
        try:
            with pytest.raises(SourceError, match="absent") as stopped:
                pipeline.run(source, until_idle=30.0)
        finally:
            source.close()
    assert stopped.value.client_code == "UNKNOWN_TOPIC_OR_PART" and not stopped.value.retriable
    assert "retrying" not in caplog.text
