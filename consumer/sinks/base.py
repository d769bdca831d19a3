"""The one small interface every sink implements, and what the pipeline tells it with each write.

A sink's `write`/`apply_ddl` must be durable when they return: the pipeline then confirms the unit to the
state machine, and only confirmed records' offsets are ever committed to Kafka.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from consumer.batches.changes import SpooledChanges, TableChanges
from consumer.errors import DeadLetter
from consumer.protocol.model import DDL
from consumer.sources.record import TopicPartition
from consumer.state.machine import Unapplied


@dataclass(frozen=True)
class CommitContext:
    """Recorded with every sink commit, so the output itself says how far it is consistent.

    `resume_offsets`: per (topic, partition), an offset from which re-reading loses nothing (everything
    before it is durably applied everywhere). `resolved_ts`: the global watermark the commit is consistent
    at. `schema_snapshot`: the schema cache, so a restarted consumer need not wait for a BOOTSTRAP.
    `applied_ts`: per (topic, partition), a commit ts every change of that partition up to which is
    durably applied (given to `ProgressRecorder.record_progress`). `stopped`: in the record made as the run
    ends or partitions go, what each partition left unapplied (None: no stop), so the lake says what a
    restart must read again. `topic_partitions`: per topic, its partition count as the member knows it
    (empty: not known), so a group's records say when every partition has recorded.
    """

    group: str
    resume_offsets: dict[TopicPartition, int] = field(default_factory=dict)
    resolved_ts: int = 0
    schema_snapshot: bytes = b""
    applied_ts: dict[TopicPartition, int] = field(default_factory=dict)
    stopped: tuple[Unapplied, ...] | None = None
    topic_partitions: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class DDLEvent:
    """A DDL as the sinks see it: the typed DDL plus the name of the table it acted on, if any."""

    ddl: DDL
    database: str | None
    table: str | None


@dataclass(frozen=True)
class Written:
    """What a sink's `write` committed of a batch: its rows (an UPDATE's two images count two), the records
    it skipped as copies of changes it holds (TiCDC re-sent them), and the copies whose image differs from
    the change it holds (`conflicting-resend`), for the error policy."""

    rows: int
    resent: int = 0
    conflicts: tuple[DeadLetter, ...] = ()

    @classmethod
    def of(cls, parts: Sequence[Written]) -> Written:
        """What writing the parts of one batch committed together."""
        return cls(
            sum(part.rows for part in parts),
            sum(part.resent for part in parts),
            tuple(letter for part in parts for letter in part.conflicts),
        )


class Sink(Protocol):
    def write(self, changes: TableChanges, context: CommitContext) -> Written | None:
        """Durably apply one resolved batch of one table. Must be idempotent for replayed rows: rows
        already applied (same table, topic, partition, offset) are skipped, and so should be copies of
        changes it holds that TiCDC sent again (`consumer.lakehouse.resends`). None: every row of the
        batch was committed."""

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        """Durably apply a DDL barrier (schema evolution, truncate, drop, rename) and log it."""

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        """The resume offsets this sink recorded for the group (where to restart after a crash)."""

    def recorded_schema_snapshot(self) -> bytes | None:
        """The newest schema-cache snapshot recorded with a commit, if any."""

    def close(self) -> None: ...


@runtime_checkable
class ProgressRecorder(Protocol):
    """A sink that keeps the pipeline's progress beside its output, so any member resumes exactly where the
    group stopped and partitions that had nothing more to read resolve at once (their watermark)."""

    def record_progress(self, context: CommitContext) -> None:
        """Durably record `context.resume_offsets`, `context.applied_ts` and, when not empty,
        `context.schema_snapshot`; called after units were applied, before Kafka offsets are committed."""

    def recorded_watermarks(self, group: str) -> dict[TopicPartition, int]:
        """Per partition, the furthest `applied_ts` recorded for the group."""


@runtime_checkable
class MergesWhenDue(Protocol):
    """A progress recorder with work on a cadence of its own that it does as it records progress (the Delta
    sink's lazy mirror MERGEs): the pipeline records progress as soon as `merge_due()` says some is due,
    on an idle stream too, not only every few seconds. Called from the pipeline's thread while the sink may
    be writing on another: it only reads."""

    def merge_due(self) -> bool: ...


@runtime_checkable
class WritesAhead(Protocol):
    """A sink that writes several batches of spooled rows at once before they are applied one by one (the
    Delta sink in the Spark engine: one Spark job writes every table's changelog files); nothing it writes
    here is durable or visible until `write` commits it."""

    def write_ahead(self, batches: Sequence[SpooledChanges], context: CommitContext) -> None: ...


@runtime_checkable
class ReportsMetrics(Protocol):
    """A sink with operation counters (e.g. delta-rs MERGE metrics) for the metrics endpoint and summary."""

    def operation_metrics(self) -> dict[str, int]: ...


@runtime_checkable
class CountsCommits(Protocol):
    """A sink whose own records (commit metadata, manifests) say how many rows it committed, so a run's
    totals are checked against the lake, not against what the pipeline handed it."""

    def committed_rows(self) -> int | None:
        """The rows this sink committed since it was made, read back from its records (None: it keeps
        none, e.g. a lake without a changelog); raises `SinkError` where they disagree with its count."""
