"""Read-only looks at Kafka for `ticdc-consumer status` and `dead-letters`: where consumer groups are in a
topic, and what a dead-letter topic holds. No group is joined and nothing is committed: a client carrying a
group's id reads its committed offsets without subscribing.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import cast

import msgspec
from confluent_kafka import Consumer, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KafkaTopicPartition

from consumer.kafka_config import create_client, scrubbed, secret_values
from consumer.sources.errors import SourceError, SourceUnreachableError
from consumer.sources.record import TopicPartition

_CONSUME_BATCH = 1000
HeadedRecord = tuple[bytes | None, bytes | None, dict[str, bytes | None]]
"""A record read back whole: key, value and headers."""
_CONSUME_SECONDS = 0.5


class PartitionOffsets(msgspec.Struct, frozen=True):
    start: int  # the oldest offset the broker still holds
    end: int  # the offset the next record gets (the high watermark)
    committed: int | None  # the group's committed offset; None: it committed none


def group_offsets(
    bootstrap_servers: str,
    topic: str,
    groups: Iterable[str],
    *,
    config: Mapping[str, object] | None = None,
    timeout: float = 10.0,
) -> dict[str, dict[TopicPartition, PartitionOffsets]]:
    """Per group, per partition of `topic`: the broker's start and end offsets and the group's commit."""
    found: dict[str, dict[TopicPartition, PartitionOffsets]] = {}
    ends: dict[TopicPartition, tuple[int, int]] | None = None
    for group in groups:
        with _Client(bootstrap_servers, group, config) as client:
            ends = ends if ends is not None else client.watermarks(topic, timeout)
            committed = client.committed(ends, timeout)
        found[group] = {tp: PartitionOffsets(*ends[tp], committed.get(tp)) for tp in sorted(ends)}
    return found


def count_by_header(
    bootstrap_servers: str,
    topic: str,
    header: str,
    *,
    distinct_by: str,
    config: Mapping[str, object] | None = None,
    timeout: float = 60.0,
) -> dict[str, int]:
    """Records of `topic` (all of it, as it is now) per value of `header`, each `distinct_by` header value
    counted once (a record produced twice, e.g. replayed before a commit, is one)."""
    with _Client(bootstrap_servers, f"ticdc-status-{uuid.uuid4().hex}", config) as client:
        ends = client.watermarks(topic, timeout)
        seen: dict[bytes | None, str] = {}
        for _, _, headers in client.read_records(ends, time.monotonic() + timeout):
            seen[headers.get(distinct_by)] = (headers.get(header) or b"").decode(errors="replace")
    return dict(Counter(seen.values()))


def read_topic(
    bootstrap_servers: str,
    topic: str,
    *,
    config: Mapping[str, object] | None = None,
    timeout: float = 60.0,
) -> list[HeadedRecord]:
    """Every record `topic` holds now (key, value, headers), each partition in offset order."""
    with _Client(bootstrap_servers, f"ticdc-read-{uuid.uuid4().hex}", config) as client:
        ends = client.watermarks(topic, timeout)
        return list(client.read_records(ends, time.monotonic() + timeout))


class _Client:
    """A consumer that never subscribes, commits or stores offsets; errors scrubbed of secrets."""

    def __init__(self, bootstrap_servers: str, group: str, config: Mapping[str, object] | None) -> None:
        settings = {
            **(config or {}),
            "bootstrap.servers": bootstrap_servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
        self._secrets = secret_values(settings)
        consumer = create_client(Consumer, settings)
        if isinstance(consumer, KafkaError):
            raise self._error("cannot create a Kafka client", consumer)
        self._consumer = consumer

    def __enter__(self) -> _Client:
        return self

    def __exit__(self, *_: object) -> None:
        self._consumer.close()

    def watermarks(self, topic: str, timeout: float) -> dict[TopicPartition, tuple[int, int]]:
        """Per partition of `topic`, its start and end offsets."""
        try:
            info = self._consumer.list_topics(topic, timeout=timeout).topics.get(topic)
        except KafkaException as exc:
            raise self._error("no broker reachable", exc.args[0], SourceUnreachableError) from exc
        if info is None or info.error is not None or not info.partitions:
            raise SourceError(f"topic {topic!r} does not exist", client_code="UNKNOWN_TOPIC_OR_PART")
        found = {}
        for partition in sorted(info.partitions):
            request = KafkaTopicPartition(topic, partition)
            try:
                found[topic, partition] = self._consumer.get_watermark_offsets(request, timeout, cached=False)
            except KafkaException as exc:
                raise self._error(f"cannot read the offsets of {topic}[{partition}]", exc.args[0]) from exc
        return found

    def committed(self, partitions: Iterable[TopicPartition], timeout: float) -> dict[TopicPartition, int]:
        request = [KafkaTopicPartition(topic, partition) for topic, partition in partitions]
        try:
            result = self._consumer.committed(request, timeout=timeout)
        except KafkaException as exc:
            raise self._error("cannot read committed offsets", exc.args[0]) from exc
        return {(tp.topic, tp.partition): tp.offset for tp in result if tp.error is None and tp.offset >= 0}

    def read_records(
        self, ends: Mapping[TopicPartition, tuple[int, int]], deadline: float
    ) -> Iterable[HeadedRecord]:
        """Every record from each partition's start to its end (as given)."""
        left = {tp: end for tp, (start, end) in ends.items() if end > start}
        self._consumer.assign([KafkaTopicPartition(*tp, ends[tp][0]) for tp in left])
        while left:
            if time.monotonic() > deadline:
                raise SourceError(f"reading {sorted(left)} timed out", retriable=True)
            for message in self._consumer.consume(_CONSUME_BATCH, _CONSUME_SECONDS):
                if message.error() is None:
                    headers = cast(
                        list[tuple[str, bytes | None]], message.headers() or []
                    )  # consumed: a list
                    yield message.key(), message.value(), dict(headers)
            done = self._consumer.position([KafkaTopicPartition(*tp) for tp in left])
            for tp in done:
                if tp.offset >= left[tp.topic, tp.partition]:
                    del left[tp.topic, tp.partition]

    def _error(self, context: str, error: KafkaError, kind: type[SourceError] = SourceError) -> SourceError:
        return kind(scrubbed(f"{context}: {error.str()}", self._secrets), client_code=error.name())
