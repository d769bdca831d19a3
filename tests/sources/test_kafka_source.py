"""KafkaSource on a real broker: both assignment modes, commits, pause/resume, rebalance hooks, secrets."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterable

import pytest

from consumer.kafka_config import REDACTED
from consumer.sources.base import FixedStarts, RebalanceListener
from consumer.sources.errors import SourceError
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory

# tansu accepts a 1 s session (Kafka's minimum is 6 s), so a group join takes about half a second.
FAST_GROUP = {"session.timeout.ms": 1000, "heartbeat.interval.ms": 100}


class _Offered(FixedStarts):
    """Fixed start offsets, noting every assignment offered."""

    def __init__(self, starts: dict[TopicPartition, int]) -> None:
        super().__init__(starts)
        self.offered: list[list[TopicPartition]] = []

    def on_assign(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
        self.offered.append(partitions)
        return dict(super().on_assign(partitions) or {})


class _Events(RebalanceListener):
    """Notes every assignment and revocation of member `name` in `events`."""

    def __init__(self, name: str, events: list[tuple[str, str, list[TopicPartition]]]) -> None:
        self._name = name
        self._events = events

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        self._events.append((self._name, "assign", partitions))

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self._events.append((self._name, "revoke", partitions))


def group_id() -> str:
    return f"group-{uuid.uuid4().hex[:8]}"


def fill(
    broker: EmbeddedBroker, topic: str, partitions: int, per_partition: int
) -> set[tuple[int, int, bytes]]:
    """Produce `per_partition` records to each partition; returns their (partition, offset, value)."""
    broker.produce(
        topic,
        [
            (p, f"key-{p}-{o}".encode(), f"value-{p}-{o}".encode())
            for o in range(per_partition)
            for p in range(partitions)
        ],
    )
    return {(p, o, f"value-{p}-{o}".encode()) for p in range(partitions) for o in range(per_partition)}


def poll_until(
    sources: Iterable[KafkaSource], done: Callable[[list[SourceRecord]], bool], timeout: float = 15.0
) -> list[SourceRecord]:
    """Poll every source in turn until `done(all records so far)` holds."""
    records: list[SourceRecord] = []
    deadline = time.monotonic() + timeout
    while not done(records):
        assert time.monotonic() < deadline, f"condition not met in {timeout} s; got {len(records)} records"
        for source in sources:
            records += source.poll_batch(100, timeout=0.05)
    return records


def summary(records: Iterable[SourceRecord]) -> set[tuple[int, int, bytes | None]]:
    return {(r.partition, r.offset, r.value) for r in records}


def test_all_partitions_reads_every_record(kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory) -> None:
    topic = kafka_topic(partitions=3)
    expected = fill(kafka_broker, topic, partitions=3, per_partition=4)
    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], group_id(), partitions=ALL_PARTITIONS
    ) as source:
        assert source.assignment() == {(topic, 0), (topic, 1), (topic, 2)}
        records = poll_until([source], lambda got: len(got) >= 12)
    assert summary(records) == expected
    assert len(records) == 12
    for record in records:
        assert record.topic == topic
        assert record.key == f"key-{record.partition}-{record.offset}".encode()
        assert record.timestamp is not None and record.timestamp > 0


def test_explicit_partitions_and_on_assign_start_offsets(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(partitions=3)
    fill(kafka_broker, topic, partitions=3, per_partition=5)
    start_at_3 = _Offered({(topic, 1): 3, (topic, 2): 0})  # entries for unassigned partitions are ignored

    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], group_id(), partitions=[(topic, 1)], listener=start_at_3
    ) as source:
        records = poll_until([source], lambda got: len(got) >= 2)
        assert source.poll_batch(100, timeout=0.2) == []
        assert source.partition_counts() == {topic: 3}  # the topic's, not the assignment's
    assert start_at_3.offered == [[(topic, 1)]]
    assert summary(records) == {(1, 3, b"value-1-3"), (1, 4, b"value-1-4")}


def test_a_source_is_behind_until_it_returned_every_record_of_its_unpaused_partitions(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(partitions=2)
    fill(kafka_broker, topic, partitions=2, per_partition=20)
    servers = kafka_broker.bootstrap_servers
    with KafkaSource(servers, [topic], group_id(), partitions=ALL_PARTITIONS) as source:
        first: list[SourceRecord] = []
        while not first:
            first = source.poll_batch(1, timeout=1.0)
        assert source.behind()  # one of 40 records returned
        source.pause([(topic, 0), (topic, 1)])
        assert not source.behind()  # held back by the caller: not the source's to read
        source.resume([(topic, 0), (topic, 1)])
        poll_until([source], lambda got: len(got) == 39)
        assert source.poll_batch(100, timeout=0.2) == []
        assert not source.behind()
        fill(kafka_broker, topic, partitions=1, per_partition=1)
        poll_until([source], lambda got: len(got) == 1)
        assert not source.behind()


def test_subscribe_mode_gets_records(kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory) -> None:
    topic = kafka_topic(partitions=2)
    expected = fill(kafka_broker, topic, partitions=2, per_partition=3)
    with KafkaSource(kafka_broker.bootstrap_servers, [topic], group_id(), config=FAST_GROUP) as source:
        records = poll_until([source], lambda got: len(got) >= 6)
        assert source.assignment() == {(topic, 0), (topic, 1)}
        assert source.partition_counts() == {topic: 2}
    assert summary(records) == expected


def test_committed_offsets_are_where_the_next_member_resumes(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(partitions=2)
    expected = fill(kafka_broker, topic, partitions=2, per_partition=4)
    group = group_id()
    with KafkaSource(kafka_broker.bootstrap_servers, [topic], group, config=FAST_GROUP) as first:
        poll_until([first], lambda got: len(got) >= 8)
        first.commit({(topic, 0): 3, (topic, 1): 1})
        first.commit({})
        assert first.committed([(topic, 0), (topic, 1)]) == {(topic, 0): 3, (topic, 1): 1}
    with KafkaSource(kafka_broker.bootstrap_servers, [topic], group, config=FAST_GROUP) as second:
        records = poll_until([second], lambda got: len(got) >= 4)
        assert second.poll_batch(100, timeout=0.2) == []
    assert summary(records) == {r for r in expected if r[1] >= (3 if r[0] == 0 else 1)}


def test_committed_is_none_without_a_commit(kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory) -> None:
    topic = kafka_topic()
    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], group_id(), partitions=ALL_PARTITIONS
    ) as source:
        assert source.committed([(topic, 0)]) == {(topic, 0): None}


def test_pause_holds_back_a_partition_until_resume(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(partitions=3)
    fill(kafka_broker, topic, partitions=3, per_partition=3)
    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], group_id(), partitions=ALL_PARTITIONS
    ) as source:
        source.pause([(topic, 0)])
        unpaused = poll_until([source], lambda got: len(got) >= 6)
        assert source.poll_batch(100, timeout=0.3) == []
        source.resume([(topic, 0)])
        resumed = poll_until([source], lambda got: len(got) >= 3)
    assert {r.partition for r in unpaused} == {1, 2}
    assert {r.partition for r in resumed} == {0}


def test_two_members_split_the_partitions(kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory) -> None:
    topic = kafka_topic(partitions=4)
    expected = fill(kafka_broker, topic, partitions=4, per_partition=2)
    group = group_id()
    events: list[tuple[str, str, list[TopicPartition]]] = []

    def member(name: str) -> KafkaSource:
        return KafkaSource(
            kafka_broker.bootstrap_servers,
            [topic],
            group,
            config=FAST_GROUP,
            listener=_Events(name, events),
        )

    def seen(name: str, kind: str) -> list[list[TopicPartition]]:
        return [sorted(parts) for who, what, parts in events if (who, what) == (name, kind)]

    with member("a") as a:
        records = poll_until([a], lambda got: len(got) >= 8)
        assert seen("a", "assign") == [sorted((topic, p) for p in range(4))]
        with member("b") as b:
            poll_until([a, b], lambda _: len(a.assignment()) == 2 and len(b.assignment()) == 2)
            assert a.assignment() | b.assignment() == {(topic, p) for p in range(4)}
            assert seen("a", "revoke") == [sorted((topic, p) for p in range(4))]
            assert seen("a", "assign")[-1] == sorted(a.assignment())
            assert seen("b", "assign") == [sorted(b.assignment())]
            b_partitions = sorted(b.assignment())
        assert seen("b", "revoke") == [b_partitions]
    assert summary(records) == expected


def test_redacted_config_hides_secrets(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory, caplog: pytest.LogCaptureFixture
) -> None:
    topic = kafka_topic()
    secrets = {
        "sasl.password": "hunter2",
        "ssl.key.password": "pem-pass",
        "sasl.oauthbearer.client.secret": "client-secret",
    }
    caplog.set_level(logging.INFO, logger="consumer.sources.kafka")
    with KafkaSource(
        kafka_broker.bootstrap_servers,
        [topic],
        group_id(),
        partitions=ALL_PARTITIONS,
        config={**secrets, "client.id": "visible"},
    ) as source:
        redacted = source.redacted_config()
    assert {key: redacted[key] for key in secrets} == dict.fromkeys(secrets, REDACTED)
    assert redacted["client.id"] == "visible"
    assert redacted["enable.auto.commit"] is False
    for value in secrets.values():
        assert value not in caplog.text


def test_config_errors_do_not_leak_secrets(kafka_broker: EmbeddedBroker) -> None:
    # librdkafka echoes invalid values; here the secret doubles as a bad value for another property.
    with pytest.raises(SourceError) as failure:
        KafkaSource(
            kafka_broker.bootstrap_servers,
            ["t"],
            group_id(),
            config={"sasl.password": "hunter2", "security.protocol": "hunter2"},
        )
    assert "hunter2" not in str(failure.value)
    assert failure.value.__cause__ is None and failure.value.__context__ is None
    assert REDACTED in str(failure.value)


def test_settings_the_source_owns_are_rejected(kafka_broker: EmbeddedBroker) -> None:
    with pytest.raises(ValueError, match=r"enable\.auto\.commit"):
        KafkaSource(kafka_broker.bootstrap_servers, ["t"], group_id(), config={"enable.auto.commit": True})


def test_missing_topic_is_a_source_error(kafka_broker: EmbeddedBroker) -> None:
    with pytest.raises(SourceError, match="does not exist") as failure:
        KafkaSource(kafka_broker.bootstrap_servers, ["absent"], group_id(), partitions=ALL_PARTITIONS)
    assert failure.value.client_code == "UNKNOWN_TOPIC_OR_PART"
    with (
        KafkaSource(kafka_broker.bootstrap_servers, ["absent"], group_id(), config=FAST_GROUP) as source,
        pytest.raises(SourceError, match="absent") as failure,
    ):
        poll_until([source], lambda _: False, timeout=10.0)
    assert failure.value.client_code == "UNKNOWN_TOPIC_OR_PART"


def test_a_client_error_loses_no_records(kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory) -> None:
    topic = kafka_topic(partitions=2)
    expected = fill(kafka_broker, topic, partitions=2, per_partition=50)
    records: list[SourceRecord] = []
    errors: list[SourceError] = []
    deadline = time.monotonic() + 15.0
    servers = kafka_broker.bootstrap_servers
    with KafkaSource(servers, [topic, "absent"], group_id(), config=FAST_GROUP) as source:
        while len(records) < 100 or not errors:
            assert time.monotonic() < deadline, f"{len(records)} records, {len(errors)} errors"
            try:
                records += source.poll_batch(1000, timeout=0.05)
            except SourceError as error:
                errors.append(error)
    assert summary(records) == expected
    assert len(records) == 100
    assert errors[0].client_code == "UNKNOWN_TOPIC_OR_PART"
