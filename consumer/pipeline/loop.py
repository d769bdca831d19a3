"""The poll loop: source -> `RecordIntake` -> state machine -> `SinkWriter` -> sinks -> offset commits.

Offsets flow back only as confirmations: a unit is confirmed to the state machine after every sink has
durably applied it, and Kafka is only ever committed to `ConsumerState.committable()`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial

from consumer.batches.changes import table_changes
from consumer.errors import SinkError
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.pipeline.bad_rows import BadRowRetry, RowDecoder
from consumer.pipeline.intake import DecodedRecord, RecordIntake
from consumer.pipeline.resume import PROGRESS_SECONDS, RecordedProgress, later_starts, resumed_watermarks
from consumer.pipeline.stats import PipelineStats, UnitTally
from consumer.pipeline.writer import SinkWriter
from consumer.protocol.base import RecordDecoder
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.types import DecodeStats, ValuePolicy
from consumer.sinks.base import CommitContext, CountsCommits, ReportsMetrics, Sink
from consumer.sinks.dead_letter import DeadLetterQueue
from consumer.sources.base import (
    CarriesWatermarks,
    CountsPartitions,
    FindsItsEnds,
    KnowsItsEnd,
    RebalanceListener,
    Source,
)
from consumer.sources.ends import EARLIEST, unread
from consumer.sources.errors import SourceError
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.sources.retry import SourceRetry
from consumer.state.machine import ConsumerState
from consumer.state.units import RowBlock
from consumer.stopping import StopRequest
from consumer.watchdog import Watchdog

log = logging.getLogger(__name__)
# Buffered rows are many small objects living about a cycle: the collector's automatic passes re-scan them
# over and over (a third of the time with Python's default thresholds), and the loop makes next to no
# reference cycles. With `pause_gc`, a full collection runs this often instead while running.
GC_EVERY_SECONDS = 30.0
JOIN_GRACE_SECONDS = 30.0  # an unassigned member waits this much longer before judging the topic idle
BEHIND_GRACE_S = 30.0  # a source that says it is behind yet returns nothing is taken at its end after this
# A loop applying units itself (no decode workers) applies them about this long a cycle, then polls again:
# a group rebalances only as fast as its slowest member polls, and past `max.poll.interval.ms` a member is
# put out of the group (on an object store, applying everything one watermark resolved took a minute)
APPLY_SECONDS = 2.0


class Pipeline(RebalanceListener):
    """Owns the loop. It is its source's rebalance listener: build the pipeline first, then the source with
    `listener=pipeline`, then call `run(source)`.

    Building one reads nothing from the sinks, so it can be built, and handed to a source, before anything
    is reachable. `open` reads what they recorded (the schemas learned so far); `run`, and the first
    assignment, open it; a caller feeding `step_decoded` itself (the Spark engine) calls `open` first.

    `decode_workers` > 0 runs the stages side by side: that many processes decode values into typed
    columns and a thread applies units to the sinks, while the loop fetches, orders and commits. Call
    `close` when done (it stops them).

    `large_messages` makes key-only DMLs (docs/protocols/simple.md §7) whole before the state machine sees
    them; without one, every claim-check is refused and every handle-key-only row goes to the error policy.

    `source_retry`: how often, and how patiently, a transient source error is retried before the run stops
    on it (a permanent one stops it at once).

    `join_grace`: how much longer than `until_idle` a member holding no partition waits for some.

    `watchdog`: what tells of a sink, the dead-letter destination or the claim-check storage hanging.

    `progress_seconds`: how often sinks keeping progress record it (also when schemas change, and at the
    end); 0: every cycle (the Spark engine's micro-batches, when its mirrors are MERGEd as progress is).

    `pause_gc`: while `run` runs, turn the garbage collector's automatic passes off for the whole process
    and collect every GC_EVERY_SECONDS instead (buffered rows are many short-lived objects the automatic
    passes re-scan over and over). Process-wide state, so off by default; the `run` command turns it on.
    """

    def __init__(
        self,
        *,
        group: str,
        state: ConsumerState,
        sinks: Sequence[Sink],
        dead_letters: DeadLetterQueue,
        decoder: RecordDecoder | None = None,
        policy: ValuePolicy | None = None,
        max_batch_records: int = 100_000,
        poll_timeout: float = 0.2,
        decode_workers: int = 0,
        large_messages: LargeMessageResolver | None = None,
        source_retry: SourceRetry | None = None,
        pause_gc: bool = False,
        row_decoder: RowDecoder = table_changes,
        apply_seconds: float = APPLY_SECONDS,
        join_grace: float = JOIN_GRACE_SECONDS,
        watchdog: Watchdog | None = None,
        progress_seconds: float = PROGRESS_SECONDS,
    ) -> None:
        self.group = group
        self.join_grace = join_grace
        self.watchdog = watchdog or Watchdog()
        self.apply_seconds = apply_seconds
        self.source_retry = source_retry or SourceRetry()
        self.pause_gc = pause_gc
        self.state = state
        self.sinks = list(sinks)
        self.dead_letters = dead_letters
        self.decoder: RecordDecoder = decoder or MessageDecoder()
        self.policy = policy or ValuePolicy()
        self.large_messages = large_messages or LargeMessageResolver(MessageDecoder(), ClaimCheckStore([]))
        self.row_decoder = row_decoder
        self.max_batch_records = max_batch_records
        self.poll_timeout = poll_timeout
        self.stats = PipelineStats()
        self.decode_stats = DecodeStats()  # values the policy nulled, images verified (any thread adds)
        self.large_messages.watchdog = self.watchdog
        self._intake = RecordIntake(state=state, decoder=self.decoder, large_messages=self.large_messages)
        self._writer = SinkWriter(
            state=state,
            sinks=self.sinks,
            dead_letters=dead_letters,
            decoder=self.decoder,
            policy=self.policy,
            decode_stats=self.decode_stats,
            bad_rows=BadRowRetry(
                error_policy=state.policy, row_decoder=row_decoder, decode_stats=self.decode_stats
            ),
            count=self._count,
            max_batch_records=max_batch_records,
            decode_workers=decode_workers,
            watchdog=self.watchdog,
        )
        self._progress = RecordedProgress(
            group=group,
            state=state,
            sinks=self.sinks,
            writer=self._writer,
            watchdog=self.watchdog,
            every=progress_seconds,
        )
        self._opened = False
        self._source: Source | None = None
        self._resume: dict[TopicPartition, int] = {}  # the offsets of the last Kafka commit
        # per partition, (offset, watermark) of this member's last commit carrying one, kept when the
        # partition goes: a broker may drop commit metadata, and the member may be given it back
        self._carried: dict[TopicPartition, tuple[int, int]] = {}
        self._paused: set[TopicPartition] = set()
        self._read: dict[TopicPartition, int] = {}  # per owned partition, the next offset to read
        self._idle = 0.0  # seconds spent waiting in polls since the last change record
        self._unassigned_since: float | None = None  # holding no partition since (with `until_idle`)
        self._changed = False  # a change record arrived in the current cycle

    # -- lifecycle -------------------------------------------------------------------------------------
    def open(self) -> None:
        """Learn the schemas the sinks recorded, before any record arrives; once (later calls do nothing)."""
        if not self._opened:
            self._opened = True
            self._progress.learn_schemas()

    def run(
        self,
        source: Source,
        *,
        until_idle: float | None = None,
        on_cycle: Callable[[Pipeline], None] | None = None,
        stop: StopRequest | None = None,
    ) -> PipelineStats:
        """Consume until `stop` is requested or, with `until_idle`, until no change record arrived for that
        many seconds (TiCDC keeps broadcasting WATERMARKs while the upstream is idle: those don't count) and
        every partition is read to its end; everything resolved by then is applied and committed. The totals
        say what was left unapplied, where each partition was read to against its end offset (`ends`), and
        whether the run went idle holding no partition (`unassigned_s`)."""
        self.open()
        self.attach(source)
        self._idle = 0.0
        self._unassigned_since = None
        paused = self.pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        collected = time.monotonic()
        try:
            while True:
                polled = time.monotonic()
                # with intake paused for a backlog, a poll only serves the group: no waiting for records
                timeout = 0.0 if self._writer.backlogged else self.poll_timeout
                records = self.source_retry.call(
                    "poll", partial(source.poll_batch, self.max_batch_records, timeout)
                )
                waited = time.monotonic() - polled
                self.step(records)
                self._idle = 0.0 if self._changed or not self._writer.idle else self._idle + waited
                if on_cycle:
                    on_cycle(self)
                if stop is not None and stop.requested:
                    self.stats.stopped_on_request = True
                    break
                if until_idle is not None and self._idle_at_end(source, until_idle):
                    self._went_idle()
                    break
                if paused and polled - collected > GC_EVERY_SECONDS:
                    gc.collect()
                    collected = time.monotonic()
        finally:
            try:
                self._flush_and_commit(final=True)
            finally:
                self._count_kept_totals()
                if paused:
                    gc.enable()
        self._check_committed()
        self.stats.unapplied = self.state.unapplied()
        return self.stats

    def finish(self) -> None:
        """The last flush and commit of records fed by `step_decoded` (`run` does its own): the sinks record
        their progress, due or not, so the lake says how far it is consistent."""
        self._flush_and_commit(final=True)
        self._count_kept_totals()
        self._check_committed()
        self.stats.unapplied = self.state.unapplied()

    def _check_committed(self) -> None:
        """The totals' rows are what the first sink committed, read back from its own records (its commits'
        metadata, its manifests): a difference would make the summary a false claim, so it stops the run."""
        sink = self.sinks[0] if self.sinks else None
        held = sink.committed_rows() if isinstance(sink, CountsCommits) else None
        if held is not None and held != self.stats.rows:
            raise SinkError(
                f"{type(sink).__name__}'s own records hold {held} rows committed by this run, the totals "
                f"{self.stats.rows}: the lake is not what the run applied"
            )

    def close(self) -> None:
        """Release the sinks, the dead-letter destination and the decode workers (after `run` has flushed
        and committed)."""
        for sink in self.sinks:
            sink.close()
        self.dead_letters.close()
        self.large_messages.close()
        self._writer.close()

    def _idle_for(self, source: Source) -> float:
        """Seconds spent waiting for records without a change record arriving: time spent writing is not
        idleness (records may have queued meanwhile). While joining a group (no partitions yet) a grace
        period first applies, so a slow join is not mistaken for an idle topic, but a member never assigned
        still stops (and says so: `unassigned_s`)."""
        if source.assignment():
            self._unassigned_since = None
            return self._idle
        if self._unassigned_since is None:
            self._unassigned_since = time.monotonic()
        return self._idle - self.join_grace

    def _idle_at_end(self, source: Source, until_idle: float) -> bool:
        """Idle for `until_idle` seconds, and at the end of the partitions where the source can tell
        (`KnowsItsEnd`): polls that come back empty on a loaded machine while records wait are no idle
        topic. A source that stays behind without returning anything (e.g. offsets of transaction
        markers past the last record) counts as at its end after `BEHIND_GRACE_S` more. Then the ends are
        checked (`_read_to_the_end`)."""
        idle = self._idle_for(source)
        if idle < until_idle:
            return False
        patient = idle < until_idle + BEHIND_GRACE_S
        if patient and isinstance(source, KnowsItsEnd) and source.behind():
            return False
        return self._read_to_the_end(source, patient=patient)

    def _read_to_the_end(self, source: Source, *, patient: bool) -> bool:
        """Whether to stop: a fetch from where each owned partition was read to finds its end (`ends`,
        paused partitions included). Records left on a partition this loop reads are read on while
        `patient`; those of a partition it holds back cannot be, and the totals say so."""
        if not isinstance(source, FindsItsEnds):
            return True
        positions = {tp: EARLIEST if offset is None else offset for tp, offset in self._positions().items()}
        self.stats.ends = source.end_offsets(positions, self._paused)
        readable = [end for end in unread(self.stats.ends) if not end.paused]
        return not (readable and patient)

    def _positions(self) -> dict[TopicPartition, int | None]:
        """Per owned partition, the next offset to read (None: its earliest)."""
        return {tp: self._read.get(tp) for tp in self.state.partition_states()}

    def _went_idle(self) -> None:
        """Say if this member went idle holding no partition: whether that fails the command is for the
        command to judge (with fewer partitions than members, some rightly hold none)."""
        if self._unassigned_since is None:
            return
        self.stats.unassigned_s = time.monotonic() - self._unassigned_since
        log.warning(
            "went idle holding no partition of group %s for %.0f s (never assigned, or lost them)",
            self.group,
            self.stats.unassigned_s,
        )

    # -- cycles ----------------------------------------------------------------------------------------
    def step(self, records: Sequence[SourceRecord]) -> None:
        """One cycle: ingest, apply what resolved, commit, adjust backpressure.

        With decode workers, a batch still decoding is left for a later cycle (at most about one cycle's
        records wait so), so the workers decode while this loop fetches and orders the next records."""
        self.stats.records += len(records)
        self._read.update({(record.topic, record.partition): record.offset + 1 for record in records})
        self._changed = self._intake.take(self._intake.decode(records))
        self._settle(until=None if self._writer.concurrent else time.monotonic() + self.apply_seconds)

    def step_decoded(self, records: Iterable[DecodedRecord], blocks: Sequence[RowBlock]) -> bool:
        """One cycle over records decoded elsewhere (the Spark engine's executors), in each partition's
        offset order, and rows typed there (`blocks`, which the records' BOOTSTRAPs and DDLs may describe);
        whether a change record (anything but a WATERMARK) was among them. Call `open` first."""
        batch = self._intake.decoded_elsewhere(records)
        self.stats.records += len(batch.records) + sum(len(block.offsets) for block in blocks)
        changed = self._intake.take(batch)
        self.state.process_blocks(blocks)
        self._changed = changed or bool(blocks)
        self._settle(until=None)  # a micro-batch is applied whole
        return self._changed

    def attach(self, source: Source) -> None:
        """The source `step`/`step_decoded` commit to and take backpressure from (`run` attaches its own)."""
        self._source = source
        if isinstance(source, CountsPartitions):
            self._progress.partition_counts = source.partition_counts

    def _settle(self, *, until: float | None) -> None:
        """The end of a cycle: apply what resolved (until about `until`), commit, adjust backpressure."""
        self._progress.refresh_schemas_if_due()
        self._flush_and_commit(drain=not self._writer.concurrent, until=until)
        self._backpressure()
        self._count_kept_totals()

    # -- rebalance listener ----------------------------------------------------------------------------
    def on_assign(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int] | None:
        """A fresh assignment is a mid-stream join; resume from the sinks' records where they are ahead,
        learn the schemas the partitions' previous owner recorded (BOOTSTRAPs only announce the latest), and
        the watermarks the commits resumed from carried (a partition at its end has none left to read)."""
        self.open()  # a source with a fixed assignment calls this from its constructor, before `run`
        self.state.assign(partitions)
        self._idle = 0.0  # joining a group is not idleness
        recorded = self._progress.assigned()
        committed = self._committed(partitions)
        starts = later_starts(partitions, recorded, committed)
        for tp in partitions:
            start = starts.get(tp, committed.get(tp))
            if start is not None:
                self._read[tp] = start
        carried = self._committed_watermarks(partitions)
        self.state.resume_watermarks(
            resumed_watermarks(partitions, {**committed, **starts}, carried, self._carried)
        )
        if starts:
            log.info("resuming %d partition(s) from sink-recorded offsets: %s", len(starts), starts)
        return starts or None

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Flush and commit what can be, then drop the partitions' state (the next owner re-reads it)."""
        self._flush_and_commit(final=True)
        self.state.revoke(partitions)
        for tp in partitions:
            self._resume.pop(tp, None)
            self._read.pop(tp, None)
            self._paused.discard(tp)

    def _committed(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int | None]:
        source = self._source
        if source is None:
            return {}
        return self.source_retry.call("reading committed offsets", lambda: source.committed(partitions))

    def _committed_watermarks(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int]:
        source = self._source
        if not isinstance(source, CarriesWatermarks):
            return {}
        return self.source_retry.call(
            "reading committed watermarks", lambda: source.committed_watermarks(partitions)
        )

    # -- applying and committing -----------------------------------------------------------------------
    def _flush_and_commit(
        self, *, drain: bool = True, final: bool = False, until: float | None = None
    ) -> None:
        """Apply resolved units in order, then commit what they made durable. Without `drain`, stop at a
        batch still decoding, unless more than a cycle's records are waiting. `final`: the last before the
        run ends or partitions go: the sinks record their progress whenever it is due or not."""
        if self._writer.failed:
            try:
                self._writer.confirm_written(wait=True)  # confirms the units before the failed one, raises
            finally:
                self._commit(final=final)
            return  # nothing after a unit that failed to apply may be applied or committed
        before = self.state.stats()  # rows waiting for a schema may be older than the watermark
        watermark = before.global_watermark if not before.held_rows else None
        units = self.state.resolve()
        if units:
            self._writer.enqueue(units, self.state.stats().global_watermark or 0)
        self._writer.write(self._context, drain=drain, until=until)
        try:
            self._writer.confirm_written(wait=drain)
            if watermark is not None and self._writer.idle:
                self._progress.applied_ts = watermark  # every change up to it is applied
        finally:
            self._commit(final=final)  # what was applied, even when a later unit failed

    def _count(self, tally: UnitTally) -> None:
        """What a confirmed unit did, into the totals (on the loop's thread)."""
        self.stats.add(tally)

    def _context(self, resolved_ts: int) -> CommitContext:
        """What the sinks record with a commit: the offsets of the last Kafka commit, which are conservative
        (everything before them is durable; sinks skip replayed rows themselves), and the watermark the
        applied units were resolved at."""
        return CommitContext(
            group=self.group,
            resume_offsets=dict(self._resume),
            resolved_ts=resolved_ts,
            schema_snapshot=self.state.schemas.snapshot(),
        )

    def _commit(self, *, final: bool = False) -> None:
        self._progress.record(force=final)
        offsets = self.state.committable(self._progress.commit_ceiling())
        self._sink_metrics()
        if not offsets or self._source is None:
            return
        marks = self.state.commit_watermarks(offsets)
        source = self._source
        try:
            # watched: a broker can leave an offset commit unanswered (confluent-kafka's has no timeout)
            with self.watchdog.watching(_commit_operation(source, offsets)):
                if isinstance(source, CarriesWatermarks):
                    source.commit(offsets, marks)
                else:
                    source.commit(offsets)
        except SourceError as exc:
            # e.g. a rebalance took the partitions away: the next owner re-reads from the last commit,
            # so a failed commit can only cause redelivery (recognisable by offset), never loss
            self.stats.failed_commits += 1
            self.state.commit_failed(offsets)  # tried again next cycle
            log.warning("offset commit failed, records after the last commit will be redelivered: %s", exc)
            return
        self._resume.update(offsets)
        self._carried.update((tp, (offsets[tp], mark)) for tp, mark in marks.items())
        self.stats.commits += 1

    def _backpressure(self) -> None:
        """Pause what the state machine asks to, and every partition while more than a cycle's rows wait
        to be applied: the loop goes on polling (staying in the group) without taking more records."""
        if self._source is None:
            return
        wanted = self.state.paused()
        if self._writer.backlogged:
            wanted = wanted | self._source.assignment()
        if wanted - self._paused:
            self._source.pause(wanted - self._paused)
        if self._paused - wanted:
            self._source.resume(self._paused - wanted)
        self._paused = set(wanted)

    # -- totals the stages keep themselves -------------------------------------------------------------
    def _count_kept_totals(self) -> None:
        """Totals the stages keep themselves (decode workers report theirs through `decode_stats`)."""
        self.stats.stalls = self.watchdog.longest()
        storage = self.large_messages.store.stats
        self.stats.verified_images = self.decode_stats.verified
        self.stats.claim_check_fetches = storage.fetches
        self.stats.claim_check_bytes = storage.bytes
        self.stats.claim_check_seconds = storage.seconds
        upstream = self.large_messages.upstream
        self.stats.upstream_lookups = upstream.lookups if upstream is not None else 0

    def _sink_metrics(self) -> None:
        totals: dict[str, int] = {}
        for sink in self.sinks:
            if isinstance(sink, ReportsMetrics):
                for name, value in sink.operation_metrics().items():
                    totals[name] = totals.get(name, 0) + value
        self.stats.sink_metrics = totals


def _commit_operation(source: Source, offsets: Mapping[TopicPartition, int]) -> str:
    """An offset commit as the watchdog names it: the source and its first partitions' offsets."""
    shown = [f"{topic}[{partition}]@{offset}" for (topic, partition), offset in sorted(offsets.items())[:3]]
    more = f" and {len(offsets) - 3} more" if len(offsets) > 3 else ""
    return f"{type(source).__name__}.commit {', '.join(shown)}{more}"
