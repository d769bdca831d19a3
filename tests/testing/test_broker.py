"""The embedded tansu broker: starts on its own port, serves a produce/consume round trip, stops cleanly."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition

from consumer.testing.broker import BrokerError, EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory


def test_round_trip(kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory) -> None:
    topic = kafka_topic(partitions=2)
    kafka_broker.produce(topic, [(0, b"k0", b"v0"), (1, None, b"v1"), (1, b"k2", None)])
    consumer = Consumer(
        {
            "bootstrap.servers": kafka_broker.bootstrap_servers,
            "group.id": "round-trip",
            "enable.auto.commit": False,
        }
    )
    try:
        consumer.assign([TopicPartition(topic, 0, 0), TopicPartition(topic, 1, 0)])
        messages = []
        for _ in range(50):
            messages += consumer.consume(num_messages=10, timeout=0.1)
            if len(messages) == 3:
                break
    finally:
        consumer.close()
    assert sorted((m.partition(), m.offset(), m.key(), m.value()) for m in messages) == [
        (0, 0, b"k0", b"v0"),
        (1, 0, None, b"v1"),
        (1, 1, b"k2", None),
    ]


def _member(
    servers: str,
    group: str,
    topic: str,
    until: threading.Event | None = None,
    assigned: threading.Semaphore | None = None,
) -> set[int]:
    """A subscribed member: the partitions it was first assigned (None if never, in two minutes). With
    `until` it releases `assigned` then stays in the group until `until` is set."""
    member = Consumer({"bootstrap.servers": servers, "group.id": group, **EmbeddedBroker.GROUP_CONFIG})
    try:
        member.subscribe([topic])
        deadline = time.monotonic() + 120
        while not member.assignment() and time.monotonic() < deadline:
            member.poll(0.1)
        partitions = {tp.partition for tp in member.assignment()}
        if assigned is not None and partitions:
            assigned.release()
        while until is not None and not until.is_set():
            member.poll(0.1)
        return partitions
    finally:
        member.close()


def test_reset_group_keeps_its_offsets_and_lets_a_new_member_in(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    """The members of a group leaving at once (what can wedge a tansu group), then a reset: the committed
    offsets are as they were and a new member gets every partition."""
    topic, group = kafka_topic(partitions=3), "reset-me"
    servers = kafka_broker.bootstrap_servers
    committer = Consumer({"bootstrap.servers": servers, "group.id": group})
    committer.commit(offsets=[TopicPartition(topic, 0, 5), TopicPartition(topic, 2, 7)], asynchronous=False)
    leave, assigned = threading.Event(), threading.Semaphore(0)

    def member() -> None:
        _member(servers, group, topic, leave, assigned)

    members = [threading.Thread(target=member) for _ in range(2)]
    for thread in members:
        thread.start()
    try:
        for _ in members:
            assert assigned.acquire(timeout=120), "a member of two was never assigned a partition"
    finally:
        leave.set()
        for thread in members:
            thread.join()
    kafka_broker.reset_group(group, topic)
    wanted = [TopicPartition(topic, partition) for partition in range(3)]
    committed = committer.committed(wanted, timeout=10)
    committer.close()
    assert [(tp.partition, tp.offset) for tp in committed] == [(0, 5), (1, -1001), (2, 7)]
    assert _member(servers, group, topic) == {0, 1, 2}


def test_stop_ends_the_process_and_frees_the_port() -> None:
    with EmbeddedBroker() as broker:
        assert broker.running
        assert broker.bootstrap_servers == f"127.0.0.1:{broker.port}"
        broker.create_topic("created", partitions=3)
    assert not broker.running
    assert not broker.log_path.exists()
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # tolerate TIME_WAIT, not a listener
        probe.bind(("127.0.0.1", broker.port))
    broker.stop()  # idempotent


def test_interpreter_exit_kills_the_broker() -> None:
    script = "from consumer.testing.broker import EmbeddedBroker; print(EmbeddedBroker().pid)"
    repo = Path(__file__).resolve().parents[2]
    pid = int(
        subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True, check=True).stdout
    )
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match=r"tansu binary missing at .*nowhere"):
        EmbeddedBroker(binary=tmp_path / "nowhere")


def test_startup_failure_names_the_log(tmp_path: Path) -> None:
    broken = tmp_path / "tansu"
    broken.write_text("#!/bin/sh\necho listener refused\nexit 3\n")
    broken.chmod(broken.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(BrokerError, match="exited with status 3") as failure:
        EmbeddedBroker(binary=broken)
    log_path = Path(str(failure.value).rsplit("log: ", 1)[1].rstrip(")"))
    assert "listener refused" in log_path.read_text()
    log_path.unlink()
