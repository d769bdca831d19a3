"""`GroupCommits` on the embedded broker: a group's offsets (and watermarks) committed without joining it,
read back as Kafka's tools read them; refused while the group has a member, as Kafka refuses a stranger."""

from __future__ import annotations

import time
from typing import Any

import pytest
from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KafkaTopicPartition

from consumer.sources.commit_metadata import metadata_watermark
from consumer.sources.errors import SourceError
from consumer.sources.group_commits import GroupCommits
from consumer.testing.broker import EmbeddedBroker


def _committed(broker: EmbeddedBroker, group: str, topic: str) -> dict[int, tuple[int, int | None]]:
    """Per partition: the committed offset and the watermark its metadata carries."""
    client = Consumer({"bootstrap.servers": broker.bootstrap_servers, "group.id": group})
    try:
        found = client.committed([KafkaTopicPartition(topic, p) for p in (0, 1)], timeout=10)
    finally:
        client.close()
    return {tp.partition: (tp.offset, metadata_watermark(tp.metadata)) for tp in found}


def test_offsets_and_watermarks_are_committed_for_a_group_it_never_joins(
    kafka_broker: EmbeddedBroker, kafka_topic: Any
) -> None:
    topic, group = kafka_topic(2), f"commits-{time.monotonic_ns()}"
    commits = GroupCommits(kafka_broker.bootstrap_servers, group)
    try:
        commits.commit({(topic, 0): 5, (topic, 1): 0}, {(topic, 0): 470754648100700160})
        first = _committed(kafka_broker, group, topic)
        # Kafka keeps commit metadata; tansu 0.6 (the embedded broker) drops it
        assert first in ({0: (5, 470754648100700160), 1: (0, None)}, {0: (5, None), 1: (0, None)})
        commits.commit({(topic, 1): 9})
        assert _committed(kafka_broker, group, topic) == {0: first[0], 1: (9, None)}
    finally:
        commits.close()


def test_a_commit_is_refused_while_the_group_has_a_member(
    kafka_broker: EmbeddedBroker, kafka_topic: Any
) -> None:
    topic, group = kafka_topic(2), f"commits-{time.monotonic_ns()}"
    settings = {"bootstrap.servers": kafka_broker.bootstrap_servers, "group.id": group}
    member = Consumer({**settings, **EmbeddedBroker.GROUP_CONFIG})
    member.subscribe([topic])
    commits = GroupCommits(kafka_broker.bootstrap_servers, group)
    try:
        deadline = time.monotonic() + 120
        while not member.assignment():  # joined: the group has a member
            assert time.monotonic() < deadline, "the member was never assigned"
            member.poll(0.1)
        with pytest.raises(SourceError, match=rf"commit of .*{topic}"):
            commits.commit({(topic, 0): 5})
    finally:
        commits.close()
        member.close()
