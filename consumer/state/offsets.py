"""Per-partition offset bookkeeping: what is safe to commit, and which records are redeliveries."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class PartitionOffsets:
    """Tracks one partition's records from assignment on.

    Kafka delivers a partition in offset order, so anything below the next expected offset is a
    redelivery (a rewind) and is ignored. The committable offset is the lowest record not yet durably
    applied: committing past it would lose that record on a crash (the reference consumer's weakness 3).
    """

    __slots__ = ("_applied", "_next", "_unapplied")

    def __init__(self) -> None:
        self._next: int | None = None
        self._unapplied: deque[int] = deque()
        self._applied: set[int] = set()

    def admit(self, offset: int) -> bool:
        """Record `offset` as seen; False when it was already seen since assignment."""
        if self._next is not None and offset < self._next:
            return False
        self._next = offset + 1
        return True

    def hold(self, offset: int) -> None:
        """The record just admitted at `offset` is not applied until `apply` names it."""
        self._unapplied.append(offset)

    def hold_many(self, offsets: list[int]) -> None:
        """Records at `offsets` (ascending, at or above every offset admitted so far but the records of the
        same feed held just before, which they may interleave with) are not applied yet; they count as
        admitted."""
        if not offsets:
            return
        unapplied, first = self._unapplied, offsets[0]
        later: list[int] = []
        while unapplied and unapplied[-1] > first:
            later.append(unapplied.pop())
        unapplied.extend(sorted(offsets + later) if later else offsets)
        if self._next is None or offsets[-1] >= self._next:
            self._next = offsets[-1] + 1

    def apply(self, offsets: Iterable[int]) -> None:
        """The records at `offsets` (each held before) are durably applied."""
        self._applied.update(offsets)

    def unapplied(self) -> list[int]:
        """The held offsets not applied yet, in order: what a consumer restarting from its own record of them
        (instead of from the committable offset) must see again."""
        applied = self._applied
        return [offset for offset in self._unapplied if offset not in applied]

    def committable(self) -> int | None:
        """The offset to commit, or None before the first record."""
        unapplied, applied = self._unapplied, self._applied
        while unapplied and unapplied[0] in applied:
            applied.discard(unapplied.popleft())
        return unapplied[0] if unapplied else self._next

    def drained(self) -> bool:
        """Every record seen since assignment is durably applied (or none was seen)."""
        return self.committable() == self._next
