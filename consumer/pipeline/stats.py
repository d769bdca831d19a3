"""What a pipeline counts: per unit on the thread applying it, in total on the loop's thread."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from consumer.sources.ends import PartitionEnd
from consumer.state.machine import Unapplied


@dataclass
class UnitTally:
    """What applying one unit did, counted by the thread applying it. The loop's thread adds it to
    `PipelineStats` when it confirms the unit, so the totals have one writer: the thread that also runs
    `on_cycle` (the progress display iterates them)."""

    rows_by_table: dict[str, int] = field(default_factory=dict)
    ddls: int = 0
    dead_letters: int = 0
    integrity_failures: int = 0
    resent: int = 0  # records the sinks skipped as copies of changes they hold


@dataclass
class PipelineStats:
    """Running totals, read by the progress display and the metrics endpoint. Only the thread running
    `Pipeline.run` changes them."""

    records: int = 0
    rows: int = 0
    ddls: int = 0
    dead_letters: int = 0
    commits: int = 0
    failed_commits: int = 0
    verified_images: int = 0  # row images whose checksum matched
    integrity_failures: int = 0  # rows set aside for a checksum mismatch or TiCDC's `corrupted` flag
    claim_check_fetches: int = 0
    claim_check_bytes: int = 0
    claim_check_seconds: float = 0.0
    upstream_lookups: int = 0
    resent: int = 0  # records skipped as copies of changes already read or applied (TiCDC re-sent them)
    rows_by_table: dict[str, int] = field(default_factory=dict)
    sink_metrics: dict[str, int] = field(default_factory=dict)  # the sinks' operation counters, summed
    stalls: dict[str, float] = field(default_factory=dict)  # per operation that stalled, its longest wait
    started: float = field(default_factory=time.monotonic)
    stopped_on_request: bool = False  # Ctrl-C, SIGTERM...: not idle, not at the end of its input
    unapplied: list[Unapplied] = field(default_factory=list)  # per partition, when the run ended
    # per partition, where it was read to against its end offset, when an `until_idle` run went idle
    ends: list[PartitionEnd] = field(default_factory=list)
    # went idle (`until_idle`) holding no partition, for this many seconds: never assigned, or lost them
    unassigned_s: float | None = None

    def add(self, tally: UnitTally) -> None:
        for table, rows in tally.rows_by_table.items():
            self.rows += rows
            self.rows_by_table[table] = self.rows_by_table.get(table, 0) + rows
        self.ddls += tally.ddls
        self.dead_letters += tally.dead_letters
        self.integrity_failures += tally.integrity_failures
        self.resent += tally.resent

    def combined(self, other: PipelineStats) -> PipelineStats:
        """The totals of two members of one group (the earlier start); they went idle unassigned only if
        both did (with fewer partitions than members, some rightly hold none)."""
        tables = dict(self.rows_by_table)
        for table, rows in other.rows_by_table.items():
            tables[table] = tables.get(table, 0) + rows
        metrics = dict(self.sink_metrics)
        for name, value in other.sink_metrics.items():
            metrics[name] = metrics.get(name, 0) + value
        stalls = dict(self.stalls)
        for operation, seconds in other.stalls.items():
            stalls[operation] = max(seconds, stalls.get(operation, 0.0))
        return PipelineStats(
            records=self.records + other.records,
            rows=self.rows + other.rows,
            ddls=self.ddls + other.ddls,
            dead_letters=self.dead_letters + other.dead_letters,
            commits=self.commits + other.commits,
            failed_commits=self.failed_commits + other.failed_commits,
            verified_images=self.verified_images + other.verified_images,
            integrity_failures=self.integrity_failures + other.integrity_failures,
            claim_check_fetches=self.claim_check_fetches + other.claim_check_fetches,
            claim_check_bytes=self.claim_check_bytes + other.claim_check_bytes,
            claim_check_seconds=self.claim_check_seconds + other.claim_check_seconds,
            upstream_lookups=self.upstream_lookups + other.upstream_lookups,
            resent=self.resent + other.resent,
            rows_by_table=tables,
            sink_metrics=metrics,
            stalls=stalls,
            started=min(self.started, other.started),
            stopped_on_request=self.stopped_on_request or other.stopped_on_request,
            unapplied=[*self.unapplied, *other.unapplied],
            ends=[*self.ends, *other.ends],
            unassigned_s=_unassigned(self.unassigned_s, other.unassigned_s),
        )


def _unassigned(one: float | None, other: float | None) -> float | None:
    """The members together held no partition only if neither did; for as long as the shorter says."""
    return None if one is None or other is None else min(one, other)
