"""Replays a capture file through the `Source` interface, so a pipeline runs offline and deterministically."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Iterable, Mapping

from consumer.sources.base import RebalanceListener
from consumer.sources.capture import read_capture
from consumer.sources.record import SourceRecord, TopicPartition


class RecordSource:
    """Serves records given up front (each partition's in offset order) as if they were a Kafka assignment of
    every partition among them.

    Commits live in memory only, so every source replays from the start unless `listener.on_assign` returns
    start offsets. The listener is told of the assignment once, here; nothing is ever revoked.
    """

    def __init__(self, records: Iterable[SourceRecord], *, listener: RebalanceListener | None = None) -> None:
        self._queued: dict[TopicPartition, deque[SourceRecord]] = {}
        for record in records:
            self._queued.setdefault((record.topic, record.partition), deque()).append(record)
        starts = (listener.on_assign(list(self._queued)) if listener else None) or {}
        for partition, start in starts.items():
            queue = self._queued.get(partition)
            while queue and queue[0].offset < start:
                queue.popleft()
        self._paused: set[TopicPartition] = set()
        self._committed: dict[TopicPartition, int] = {}

    @property
    def exhausted(self) -> bool:
        """True once every record (paused partitions included) has been returned."""
        return not any(self._queued.values())

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        """Up to `max_records` records, partition by partition in file order.

        With nothing to return it sleeps `timeout` like an idle Kafka poll, so a polling loop does not spin.
        """
        batch: list[SourceRecord] = []
        for partition, queue in self._queued.items():
            if partition in self._paused:
                continue
            while queue and len(batch) < max_records:
                batch.append(queue.popleft())
        if not batch:
            time.sleep(timeout)
        return batch

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        self._committed.update(offsets)

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        return {partition: self._committed.get(partition) for partition in partitions}

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self._paused.update(partitions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self._paused.difference_update(partitions)

    def assignment(self) -> set[TopicPartition]:
        return set(self._queued)

    def close(self) -> None:
        """Nothing to release: the records were given whole."""


class FileSource(RecordSource):
    """Serves a capture file's records as if it were a Kafka assignment of every partition in the file; the
    file is read up front (the assignment must be known before the first poll)."""

    def __init__(self, path: str | os.PathLike[str], *, listener: RebalanceListener | None = None) -> None:
        super().__init__(read_capture(path), listener=listener)
