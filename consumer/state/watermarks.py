"""Watermarks of the partitions this consumer owns, the global watermark they imply, and the ones their
offset commits carry."""

from __future__ import annotations

from collections import deque

from consumer.sources.record import TopicPartition


class PartitionWatermarks:
    """Per-(topic, partition) watermarks over the *owned* partitions only.

    A watermark W on a partition means every DML with commit_ts <= W was written to it before. The minimum
    over owned partitions is therefore complete for everything this consumer will ever see; partitions
    owned by other group members must not count (the reference consumer's weakness 9), and topics with
    the same partition numbers must not share a slot (weakness 8).
    """

    def __init__(self) -> None:
        self._marks: dict[TopicPartition, int | None] = {}

    def assign(self, tp: TopicPartition) -> None:
        self._marks.setdefault(tp, None)

    def revoke(self, tp: TopicPartition) -> None:
        self._marks.pop(tp, None)

    def advance(self, tp: TopicPartition, commit_ts: int) -> None:
        """Ignores regressions: TiCDC may resend an older checkpoint after a restart."""
        current = self._marks[tp]
        if current is None or commit_ts > current:
            self._marks[tp] = commit_ts

    def of(self, tp: TopicPartition) -> int | None:
        """The partition's watermark; None before its first WATERMARK (or when it is not owned)."""
        return self._marks.get(tp)

    def global_watermark(self) -> int | None:
        """None until every owned partition has reported one (nothing is complete before that)."""
        marks = self._marks.values()
        if not marks or None in marks:
            return None
        return min(m for m in marks if m is not None)

    def ahead(self) -> set[TopicPartition]:
        """Partitions whose watermark is past the global one: pausing them lets the laggards catch up."""
        floor = self.global_watermark()
        return {
            tp for tp, mark in self._marks.items() if mark is not None and (floor is None or mark > floor)
        }


class WatermarkTrail:
    """The WATERMARKs one partition's reader met, by offset, for its offset commits to carry.

    A WATERMARK W at offset o promises that every record of the partition after o has a commit ts above W,
    so a commit at offset c > o may carry W to whoever reads the partition next (from c or later): a
    partition read to its end then still lets the others resolve. A WATERMARK at or after c is carried only
    once the commit moves past it, i.e. once the records before it are applied.
    """

    __slots__ = ("_carried", "_read")

    def __init__(self) -> None:
        self._read: deque[tuple[int, int]] = deque()  # (offset, commit ts), both increasing
        self._carried: tuple[int, int] | None = None  # the newest (offset, commit ts) a commit passed

    def read(self, offset: int, commit_ts: int) -> None:
        """A WATERMARK at `offset`; one no newer than a WATERMARK already met adds nothing."""
        newest = self._read[-1] if self._read else self._carried
        if newest is None or commit_ts > newest[1]:
            self._read.append((offset, commit_ts))

    def carry(self, commit_ts: int) -> None:
        """A watermark the position this partition was assigned at carried: every commit may carry it."""
        if self._carried is None or commit_ts > self._carried[1]:
            self._carried = (-1, commit_ts)
        while self._read and self._read[0][1] <= commit_ts:  # kept: every one met is newer than it
            self._read.popleft()

    def below(self, offset: int) -> int | None:
        """The watermark a commit at `offset` carries. Offsets asked about only decrease after a failed
        commit; one below the WATERMARK carried last then carries none (never one it does not justify)."""
        read = self._read
        while read and read[0][0] < offset:
            self._carried = read.popleft()
        carried = self._carried
        return carried[1] if carried is not None and carried[0] < offset else None
