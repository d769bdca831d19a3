"""Where a partition's records end, found by fetching from where reading stopped.

Kafka tells a partition's end two ways: ListOffsets (`get_watermark_offsets(cached=False)`, what a planner
asks) and the high watermark each fetch response carries (what a consumer reads up to). They should agree.
tansu, the embedded test broker, answers ListOffsets with one past the *first* offset of the partition's
last record batch, so a planner that trusted it stopped up to a producer batch short and said it was done.
An end a fetch found is what a reader reads, whatever the broker: both engines check a run's claim to have
read everything against it, and the Spark planner takes its batches' ends from it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Mapping, Sequence

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, Message
from confluent_kafka import TopicPartition as KafkaTopicPartition

from consumer.kafka_config import create_client, scrubbed, secret_values
from consumer.sources.errors import SourceError
from consumer.sources.record import TopicPartition

EARLIEST = OFFSET_BEGINNING  # a position: the partition's first offset still held
_TIMEOUT_S = 30.0
_POLL_S = 0.5
# One small fetch per partition, answered at once: the broker holds a fetch at the end for at most this.
_PROBE_CONFIG: dict[str, object] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "enable.partition.eof": True,
    "auto.offset.reset": "earliest",
    "fetch.wait.max.ms": 10,
    "fetch.error.backoff.ms": 10,
    "fetch.queue.backoff.ms": 10,
    "fetch.message.max.bytes": 4096,
    "queued.min.messages": 1,
}


class PartitionEnd(msgspec.Struct, frozen=True):
    """Where reading stopped in a partition, against where its records end.

    `read`: the next offset the reader would read; `next`: the first record at or after it (`end` when there
    is none: offsets past `read` may hold only transaction markers); `end`: one past the partition's last
    record, the high watermark of the fetch from `read`. `paused`: the reader held the partition back."""

    topic: str
    partition: int
    read: int
    next: int
    end: int
    paused: bool = False

    @property
    def unread(self) -> int:
        """Offsets left to read (records, but for transaction markers among them)."""
        return max(0, self.end - self.next)

    def __str__(self) -> str:
        where = f"{self.topic}[{self.partition}]"
        if not self.unread:
            return f"{where}: read to its end offset {self.end}"
        why = ", paused: its rows wait for a schema or the watermark" if self.paused else ""
        return (
            f"{where}: read to {self.read} of end offset {self.end}: offsets {self.next}..{self.end - 1} "
            f"unread ({self.unread}{why})"
        )


def unread(ends: Iterable[PartitionEnd]) -> list[PartitionEnd]:
    """The partitions with records left past where reading stopped."""
    return [end for end in ends if end.unread]


class EndOffsets:
    """A client that asks for partitions' offsets and fetches once from given positions to find their true
    ends; it never joins its `group` (the name ACLs may require), commits or stores an offset. Errors name
    the partition and never carry the settings' secrets."""

    def __init__(
        self,
        bootstrap_servers: str,
        config: Mapping[str, object],
        *,
        group: str = "",
        timeout: float = _TIMEOUT_S,
    ) -> None:
        settings = {
            **{key: value for key, value in config.items() if key != "error_cb"},
            "bootstrap.servers": bootstrap_servers,
            "group.id": group or f"ticdc-end-offsets-{uuid.uuid4().hex}",  # the client's, never joined
            **_PROBE_CONFIG,
        }
        self._secrets = secret_values(settings)
        self._timeout = timeout
        consumer = create_client(Consumer, settings)
        if isinstance(consumer, KafkaError):
            raise SourceError(f"cannot create a Kafka client: {scrubbed(consumer.str(), self._secrets)}")
        self._consumer = consumer

    def listed(self, topics: Sequence[str]) -> dict[TopicPartition, tuple[int, int]]:
        """Per partition of `topics`, its first and end offsets as the broker lists them (ListOffsets)."""
        try:
            metadata = self._consumer.list_topics(timeout=self._timeout)
            listed = {}
            for topic in topics:
                info = metadata.topics.get(topic)
                if info is None or info.error is not None:
                    raise SourceError(f"topic {topic!r} does not exist", client_code="UNKNOWN_TOPIC_OR_PART")
                for partition in sorted(info.partitions):
                    listed[(topic, partition)] = self._consumer.get_watermark_offsets(
                        KafkaTopicPartition(topic, partition), timeout=self._timeout, cached=False
                    )
            return listed
        except KafkaException as exc:
            detail = scrubbed(exc.args[0].str(), self._secrets)
            raise SourceError(f"cannot read offsets of {list(topics)}: {detail}") from None

    def bounds(self, topics: Sequence[str]) -> dict[TopicPartition, tuple[int, int]]:
        """`listed`, each end checked by a fetch from it: a record there moves it to the fetch's."""
        listed = self.listed(topics)
        found = self.probe({tp: high for tp, (_, high) in listed.items()})
        return {tp: (low, max(high, found[tp].end)) for tp, (low, high) in listed.items()}

    def probe(
        self, positions: Mapping[TopicPartition, int], paused: Iterable[TopicPartition] = ()
    ) -> dict[TopicPartition, PartitionEnd]:
        """Each partition's end as one fetch from its position finds it (`EARLIEST`: from its first offset);
        `paused` marks the partitions their reader held back."""
        if not positions:
            return {}
        held = set(paused)
        self._consumer.assign([KafkaTopicPartition(*tp, offset) for tp, offset in positions.items()])
        try:
            found: dict[TopicPartition, PartitionEnd] = {}
            deadline = time.monotonic() + self._timeout
            while len(found) < len(positions):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(positions) - set(found))
                    raise SourceError(
                        f"the end offsets of {_named(missing)} were not found within {self._timeout:.0f} s"
                    )
                message = self._consumer.poll(min(left, _POLL_S))
                tp = _place(message)
                if message is not None and tp in positions and tp not in found:
                    found[tp] = self._end(message, tp, positions[tp], tp in held)
            return found
        finally:
            self._consumer.unassign()

    def _end(self, message: Message, tp: TopicPartition, position: int, paused: bool) -> PartitionEnd:
        error = message.error()
        offset = message.offset() or 0
        read = position if position >= 0 else offset
        if error is None:
            _, high = self._consumer.get_watermark_offsets(KafkaTopicPartition(*tp), cached=True)
            return PartitionEnd(*tp, read=read, next=offset, end=max(high, offset + 1), paused=paused)
        if error.code() == KafkaError._PARTITION_EOF:
            return PartitionEnd(*tp, read=read, next=offset, end=offset, paused=paused)
        detail = scrubbed(error.str(), self._secrets)
        raise SourceError(f"{_named([tp])}: cannot find its end offset: {detail}", client_code=error.name())

    def close(self) -> None:
        self._consumer.close()


def _place(message: Message | None) -> TopicPartition:
    """The partition a message or event is of; `("", -1)` for none (a client-wide event, no message)."""
    topic, partition = (message.topic(), message.partition()) if message is not None else (None, None)
    return (topic or "", -1 if partition is None else partition)


def _named(partitions: Iterable[TopicPartition]) -> str:
    return ", ".join(f"{topic}[{partition}]" for topic, partition in partitions)
