"""The resume policy: what the sinks record about a group's progress, and what a member reads back from
them to resume where the group stopped.

Sinks that keep progress (`ProgressRecorder`) record, beside their output, where each owned partition can
resume, up to which commit ts its changes are applied, and the schemas learned. A member reads that back
when it opens and when partitions are assigned: it starts a partition at the sink-recorded offset where that
is ahead of Kafka's commit, resolves partitions that had nothing more to read at once (their recorded
watermark), and decodes rows of schema versions no BOOTSTRAP will announce again. Kafka offset commits
carry each partition's watermark too (`resumed_watermarks`), whatever the sinks keep.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from consumer.pipeline.writer import SinkWriter
from consumer.sinks.base import CommitContext, MergesWhenDue, ProgressRecorder, Sink
from consumer.sources.record import TopicPartition
from consumer.state.machine import ConsumerState
from consumer.state.schema_cache import snapshot_schemas
from consumer.watchdog import Watchdog

log = logging.getLogger(__name__)
SCHEMA_REFRESH_SECONDS = 5.0  # while rows wait for a schema, look for it in the sinks' records this often
PROGRESS_SECONDS = 5.0  # sinks keeping progress record it this often, when schemas change, and at the end


def later_starts(
    partitions: Sequence[TopicPartition],
    recorded: Mapping[TopicPartition, int],
    committed: Mapping[TopicPartition, int | None],
) -> dict[TopicPartition, int]:
    """Start offsets overriding Kafka's: a partition's sink-recorded offset where it is ahead of Kafka's
    commit, or Kafka has none."""
    starts = {}
    for tp in partitions:
        sink_offset = recorded.get(tp)
        kafka_offset = committed.get(tp)
        if sink_offset is not None and (kafka_offset is None or sink_offset > kafka_offset):
            starts[tp] = sink_offset
    return starts


def recorded_offsets(sinks: Sequence[Sink], group: str) -> dict[TopicPartition, int]:
    """Where the group resumes each partition by the sinks' records: only where every sink recorded an
    offset (the lowest of them)."""
    if not sinks:
        return {}
    per_sink = [sink.recorded_offsets(group) for sink in sinks]
    common = set(per_sink[0]).intersection(*per_sink[1:])
    return {tp: min(offsets[tp] for offsets in per_sink) for tp in common}


def resumed_watermarks(
    partitions: Sequence[TopicPartition],
    starts: Mapping[TopicPartition, int | None],
    carried: Mapping[TopicPartition, int],
    remembered: Mapping[TopicPartition, tuple[int, int]],
) -> dict[TopicPartition, int]:
    """The watermark each partition resumes with: the one its last commit carried, or the one this member's
    own last commit of it carried, `remembered` as (offset, watermark), where the partition starts at or
    after that offset (the broker dropped the metadata, or another member committed since without any).

    Either holds for the whole rest of the partition: it was read below the offset committed with it."""
    marks = {}
    for tp in partitions:
        start, mine = starts.get(tp), remembered.get(tp)
        candidates = [carried[tp]] if tp in carried else []
        if mine is not None and start is not None and start >= mine[0]:
            candidates.append(mine[1])
        if candidates:
            marks[tp] = max(candidates)
    return marks


@dataclass(frozen=True)
class _Recording:
    """A record of progress handed to the writer's thread: the schemas it holds (`SchemaCache.learned`)
    and the resume offsets it records. `done` says whether it was recorded (not when the writer failed)."""

    learned: int
    offsets: dict[TopicPartition, int]
    done: Future[bool]


class RecordedProgress:
    """Reads the sinks' records of the group's progress into the state machine, and records it.

    A sink is used by one thread at a time: reads wait until the writer's thread is idle; records run on
    that thread, behind the units handed to it, so the loop never waits for a backlog of writes (on an
    object store with many DDLs, a minute). Kafka is committed past a record that taught a schema only once
    a record holding that schema is durable (`commit_ceiling`)."""

    def __init__(
        self,
        *,
        group: str,
        state: ConsumerState,
        sinks: Sequence[Sink],
        writer: SinkWriter,
        watchdog: Watchdog,
        every: float = PROGRESS_SECONDS,
    ) -> None:
        self.group = group
        self.every = every  # seconds between records (0: every cycle)
        self.watchdog = watchdog
        self.state = state
        self.sinks = sinks
        self.writer = writer
        self._recorders = [sink for sink in sinks if isinstance(sink, ProgressRecorder)]
        self._merging = [sink for sink in self._recorders if isinstance(sink, MergesWhenDue)]
        # Every change of every owned partition up to `applied_ts` is applied (None until a cycle applied
        # all it resolved since the last assignment).
        self.applied_ts: int | None = None
        self._recorded_at = 0.0
        self._recorded_schemas = -1  # `SchemaCache.learned` when a record of the schemas was last made
        self._durable_schemas = -1  # ... and when such a record is known durable
        self._durable_offsets: dict[TopicPartition, int] = {}  # the resume offsets of that record
        self._recording: _Recording | None = None  # on the writer's thread, not known durable yet
        self._schemas_refreshed = 0.0
        # per topic, its partition count (the source's, when it knows them: `CountsPartitions`)
        self.partition_counts: Callable[[], dict[str, int]] = dict

    # -- reading back ----------------------------------------------------------------------------------
    def learn_schemas(self) -> None:
        """Schemas recorded with the sinks' commits: a restarted or rebalanced member need not wait for the
        next BOOTSTRAP, and rows written at a version no BOOTSTRAP will announce again still decode."""
        self._schemas_refreshed = time.monotonic()
        self._settle()
        recorded = self.state.schemas.learned == self._durable_schemas
        for sink in self.sinks:
            snapshot = sink.recorded_schema_snapshot()
            if snapshot:
                self.state.learn_schemas(snapshot_schemas(snapshot))
        if recorded or self._durable_schemas < 0:  # what it knows now is what the sinks hold
            self._recorded_schemas = self._durable_schemas = self.state.schemas.learned

    def refresh_schemas_if_due(self) -> None:
        """While rows wait for their schema, another member may have recorded it: look every
        SCHEMA_REFRESH_SECONDS."""
        if (
            self.state.stats().held_rows
            and time.monotonic() - self._schemas_refreshed > SCHEMA_REFRESH_SECONDS
        ):
            self.learn_schemas()

    def assigned(self) -> dict[TopicPartition, int]:
        """Partitions were assigned: learn the schemas their previous owner recorded (BOOTSTRAPs only
        announce the latest), seed their recorded watermarks, and return the offsets the sinks recorded."""
        self.applied_ts = None  # not known for the new partitions until a cycle applies all it resolved
        self.learn_schemas()
        recorded = self._resume_offsets()
        self.state.seed_watermarks(self._watermarks())
        return recorded

    def _resume_offsets(self) -> dict[TopicPartition, int]:
        """A partition can resume from a sink-recorded offset only if every sink recorded one (the min)."""
        self._settle()
        return recorded_offsets(self.sinks, self.group)

    def _watermarks(self) -> dict[TopicPartition, int]:
        """Per partition, a commit ts every sink that keeps progress recorded its changes applied up to."""
        if not self._recorders:
            return {}
        per_sink = [sink.recorded_watermarks(self.group) for sink in self._recorders]
        common = set(per_sink[0]).intersection(*per_sink[1:])
        return {tp: min(marks[tp] for marks in per_sink) for tp in common}

    # -- recording -------------------------------------------------------------------------------------
    def record(self, *, force: bool) -> None:
        """Let the sinks that keep progress record where each owned partition can resume and up to which
        commit ts its changes are applied (`CommitContext.applied_ts`): a partition whose every record seen
        is applied is complete up to its own watermark, the others up to the last watermark whose units all
        applied. Nothing is claimed while rows wait for their schema. Without `force`, only every
        PROGRESS_SECONDS, when schemas changed or when a sink has a MERGE due (`MergesWhenDue`: checked
        every cycle, idle ones included), on the writer's thread, one record at a time; with it
        (the run ends, partitions go), once every unit is applied, before this returns, with what each
        partition leaves unapplied."""
        if not self._recorders or self.writer.failed:
            return
        self._collect()
        learned = self.state.schemas.learned
        fresh = learned != self._recorded_schemas
        due = any(sink.merge_due() for sink in self._merging)  # e.g. a lazy mirror's, on an idle stream
        if not (force or fresh or due or time.monotonic() - self._recorded_at >= self.every):
            return
        if force:
            self._settle()
        elif self._recording is not None:
            return  # the next cycle records what is new
        context = self._context(fresh, stopping=force)
        if context is None:
            return
        recording = self.writer.after_written(lambda: self._record(context))
        self._recording = _Recording(learned, context.resume_offsets, recording)
        self._recorded_at, self._recorded_schemas = time.monotonic(), learned
        if force:
            self._collect(wait=True)

    def commit_ceiling(self) -> dict[TopicPartition, int] | None:
        """How far Kafka may be committed: anywhere while the sinks durably hold every schema learned (None),
        else up to the resume offsets of the last durable record: every record past them that taught a
        schema is read after that record was made."""
        if not self._recorders:
            return None
        self._collect()
        if self._durable_schemas == self.state.schemas.learned:
            return None
        return self._durable_offsets

    def _context(self, fresh: bool, *, stopping: bool) -> CommitContext | None:
        resume: dict[TopicPartition, int] = {}
        applied: dict[TopicPartition, int] = {}
        held = self.state.stats().held_rows
        for tp, partition in self.state.partition_states().items():
            if partition.resume_offset is None:
                continue
            resume[tp] = partition.resume_offset
            applied_ts = partition.watermark if partition.drained else self.applied_ts
            if applied_ts is not None and not held:
                applied[tp] = applied_ts
        if not resume and not fresh:
            return None
        return CommitContext(
            group=self.group,
            resume_offsets=resume,
            resolved_ts=self.applied_ts or 0,
            schema_snapshot=self.state.schemas.snapshot() if fresh else b"",
            applied_ts=applied,
            stopped=tuple(self.state.unapplied()) if stopping else None,
            topic_partitions=self.partition_counts(),
        )

    def _record(self, context: CommitContext) -> bool:
        """The writer thread's job: nothing is recorded after a unit that failed to apply."""
        if self.writer.failed:
            return False
        for sink in self._recorders:
            with self.watchdog.watching(f"{type(sink).__name__}.record_progress"):
                sink.record_progress(context)
        return True

    def _collect(self, *, wait: bool = False) -> None:
        """A record the writer's thread finished is durable; a sink's failure to record raises here, on the
        loop's thread."""
        recording = self._recording
        if recording is None or not (wait or recording.done.done()):
            return
        self._recording = None
        if recording.done.result():
            self._durable_schemas, self._durable_offsets = recording.learned, recording.offsets

    def _settle(self) -> None:
        """The sinks are the loop's alone: every unit handed to the writer is applied, and any record."""
        self.writer.confirm_written(wait=True)
        self._collect(wait=True)
