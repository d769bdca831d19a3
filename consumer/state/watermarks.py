"""Watermarks of the partitions this consumer owns, and the global watermark they imply."""

from __future__ import annotations

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
