"""The interface a pipeline drives, shared by the live Kafka source and the capture-file replay, and the one
object a source tells about its assignment changing.

Wiring without a construction cycle: the listener (a `Pipeline`) is built first, and its constructor takes
no source; the source is built second, given the listener once (`listener=`); then `Pipeline.run(source)`
joins the two. A source fires the listener's methods from inside its own calls (`poll_batch`, `close`) or,
for a fixed assignment, from its constructor.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

from consumer.sources.ends import PartitionEnd
from consumer.sources.record import SourceRecord, TopicPartition


class RebalanceListener(Protocol):
    """Told by a source when partitions are assigned, revoked or lost. Subclass it to inherit `on_lost`'s
    default (what revocation does); any object with the three methods will do."""

    def on_assign(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int] | None:
        """Newly assigned partitions; may return start offsets that override the committed ones (so a sink
        that records its own offsets can resume exactly where it stopped)."""
        ...

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Partitions about to be taken away, while offsets for them can still be committed."""
        ...

    def on_lost(self, partitions: list[TopicPartition]) -> None:
        """Partitions already taken away (their offsets can no longer be committed): by default, what
        revocation does, since the partitions' state must go either way."""
        self.on_revoke(partitions)


class FixedStarts(RebalanceListener):
    """Starts each partition it names at its offset, whatever the committed offsets say; `then`, if given,
    is told of every change first (its own start offsets are overruled). For a reader of exact ranges, or a
    consumer joining a stream at chosen places."""

    def __init__(self, starts: Mapping[TopicPartition, int], then: RebalanceListener | None = None) -> None:
        self._starts = dict(starts)
        self._then = then

    def on_assign(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int] | None:
        if self._then is not None:
            self._then.on_assign(partitions)
        return {tp: self._starts[tp] for tp in partitions if tp in self._starts}

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        if self._then is not None:
            self._then.on_revoke(partitions)

    def on_lost(self, partitions: list[TopicPartition]) -> None:
        if self._then is not None:
            self._then.on_lost(partitions)


class Source(Protocol):
    """Yields batches of records and accepts "next offset to read" commits per partition."""

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        """Up to `max_records` records; waits until the batch is full or `timeout` seconds have passed."""
        ...

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Durably record, per partition, the offset of the next record to read."""
        ...

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The last committed "next offset" per partition, None where nothing was committed."""
        ...

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        """Stop returning records of these partitions (backpressure) without losing the assignment."""
        ...

    def resume(self, partitions: Iterable[TopicPartition]) -> None: ...

    def assignment(self) -> set[TopicPartition]: ...

    def close(self) -> None: ...


@runtime_checkable
class KnowsItsEnd(Protocol):
    """A source that can tell records it has not returned yet from an end it reached: a member whose polls
    come back empty on a loaded machine is slow, not idle."""

    def behind(self) -> bool:
        """Whether an assigned partition is known to hold records past those returned (or not known yet
        to be at its end)."""
        ...


@runtime_checkable
class FindsItsEnds(Protocol):
    """A source that can find where its partitions' records end by fetching (`consumer.sources.ends`): a
    run that went idle checks it read everything before it says so."""

    def end_offsets(
        self, positions: Mapping[TopicPartition, int], paused: Iterable[TopicPartition]
    ) -> list[PartitionEnd]:
        """Per partition of `positions` (the next offset the reader reads, or `ends.EARLIEST`), where its
        records end; `paused`: those the reader held back."""
        ...


@runtime_checkable
class CountsPartitions(Protocol):
    """A source that knows how many partitions each of its topics has (Kafka's metadata), whichever it is
    given: a group's output is consistent at a commit ts only once every partition recorded reaching it,
    including those no member recorded anything for yet."""

    def partition_counts(self) -> dict[str, int]:
        """Per topic, its partition count; empty when not known (the metadata could not be read)."""
        ...


@runtime_checkable
class CarriesWatermarks(Protocol):
    """A source whose offset commits can carry each partition's watermark (Kafka commit metadata), so
    whoever reads a partition next, this member after losing it or another one, resumes with it."""

    def commit(
        self, offsets: Mapping[TopicPartition, int], watermarks: Mapping[TopicPartition, int] | None = None
    ) -> None:
        """`Source.commit`, each partition of `watermarks` carrying its watermark."""
        ...

    def committed_watermarks(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """The watermarks the last commits of `partitions` carried, where they carried one."""
        ...
