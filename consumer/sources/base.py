"""The interface a pipeline drives, shared by the live Kafka source and the capture-file replay."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from consumer.sources.record import SourceRecord

Partition = tuple[str, int]
"""A (topic, partition) pair."""

OnAssign = Callable[[list[Partition]], Mapping[Partition, int] | None]
"""Called with newly assigned partitions; may return start offsets that override the committed ones
(so a sink that records its own offsets can resume exactly where it stopped)."""

OnRevoke = Callable[[list[Partition]], None]
"""Called before partitions are taken away, while offsets for them can still be committed."""


class Source(Protocol):
    """Yields batches of records and accepts "next offset to read" commits per partition."""

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        """Up to `max_records` records; waits until the batch is full or `timeout` seconds have passed."""
        ...

    def commit(self, offsets: Mapping[Partition, int]) -> None:
        """Durably record, per partition, the offset of the next record to read."""
        ...

    def committed(self, partitions: Iterable[Partition]) -> dict[Partition, int | None]:
        """The last committed "next offset" per partition, None where nothing was committed."""
        ...

    def pause(self, partitions: Iterable[Partition]) -> None:
        """Stop returning records of these partitions (backpressure) without losing the assignment."""
        ...

    def resume(self, partitions: Iterable[Partition]) -> None: ...

    def assignment(self) -> set[Partition]: ...

    def close(self) -> None: ...
