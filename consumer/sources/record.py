"""The unit every source yields: one Kafka record, exactly as the broker stored it."""

from __future__ import annotations

import msgspec

from consumer.errors import RecordLocation

TopicPartition = tuple[str, int]
"""A Kafka (topic, partition) pair: the one name for it across the SDK."""


class SourceRecord(msgspec.Struct, frozen=True):
    """Fields in this order: a source builds one per record, positionally (the cheapest way)."""

    topic: str
    partition: int
    offset: int
    timestamp: int | None = None
    key: bytes | None = None
    value: bytes | None = None

    @property
    def location(self) -> RecordLocation:
        return RecordLocation(self.topic, self.partition, self.offset)
