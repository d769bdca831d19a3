"""The consumer loop: source -> decoder -> state machine -> typed batches -> sinks -> offset commits.

Offsets flow back only as confirmations: a unit is confirmed to the state machine after every sink has
durably applied it, and Kafka is only ever committed to `ConsumerState.committable()`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from consumer.batches.changes import TableChanges, table_changes
from consumer.batches.decode_pool import DecodePool, Decoding
from consumer.errors import (
    ConsumerError,
    DecodeError,
    DependencyError,
    RecordLocation,
    RejectedRowsError,
)
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.protocol.codec import MessageDecoder
from consumer.protocol.model import DecodedMessage, KeyOnlyDML, RawDML, TableSchema, Watermark
from consumer.protocol.protocols import RecordDecoder
from consumer.protocol.rows import TableCodec
from consumer.protocol.types import DecodeStats, ValuePolicy
from consumer.sinks.base import (
    CommitContext,
    DDLEvent,
    ProgressRecorder,
    ReportsMetrics,
    Sink,
    TopicPartition,
)
from consumer.sinks.dead_letter import DeadLetterSink
from consumer.sources.base import RebalanceListener, Source
from consumer.sources.errors import SourceError
from consumer.sources.record import SourceRecord
from consumer.sources.retry import SourceRetry
from consumer.state.machine import ConsumerState, Unapplied
from consumer.state.schema_cache import snapshot_schemas
from consumer.state.units import DDLUnit, DeadLetter, RowBatch, RowOrigins, Unit
from consumer.stopping import StopRequest

RowDecoder = Callable[[TableCodec, Sequence[tuple[RawDML, RecordLocation]], RowOrigins | None], TableChanges]
"""Types a resolved batch's rows (`table_changes`, or one that takes rows already decoded elsewhere, like the
Spark engine's); raises `ValueDecodeError` naming the bad row's index in `rows`."""
DecodedRecord = tuple[RecordLocation, DecodedMessage | ConsumerError, bytes | None]
"""A record decoded before it reached the pipeline: its message, or the error decoding it met, and its value
(kept for the dead-letter destination)."""

log = logging.getLogger(__name__)
SCHEMA_REFRESH_SECONDS = 5.0  # while rows wait for a schema, look for it in the sinks' records this often
# Buffered rows are many small objects living about a cycle: the collector's automatic passes re-scan them
# over and over (a third of the time with Python's default thresholds), and the loop makes next to no
# reference cycles. With `pause_gc`, a full collection runs this often instead while running.
GC_EVERY_SECONDS = 30.0
JOIN_GRACE_SECONDS = 30.0  # an unassigned member waits this much longer before judging the topic idle
PROGRESS_SECONDS = 5.0  # sinks keeping progress record it this often, when schemas change, and at the end


@dataclass(slots=True)
class _Queued:
    """A resolved unit waiting to be applied, with its rows' decoding when a worker does it, and the global
    watermark it was resolved at: what the commit applying it may claim to be consistent at."""

    unit: Unit
    resolved_ts: int
    decoding: Decoding | None = None

    def ready(self) -> bool:
        return self.decoding is None or self.decoding.done()


def _rows(unit: Unit) -> int:
    return len(unit.rows) if isinstance(unit, RowBatch) else 0


@dataclass(frozen=True, slots=True)
class _Failed:
    """A record that goes to the error policy instead of the state machine's ordering, and why."""

    error: ConsumerError
    value: bytes | None


@dataclass
class _Tally:
    """What applying one unit did, counted by the thread applying it. The loop's thread adds it to
    `PipelineStats` when it confirms the unit, so the totals have one writer: the thread that also runs
    `on_cycle` (the progress display iterates them)."""

    rows_by_table: dict[str, int] = field(default_factory=dict)
    ddls: int = 0
    dead_letters: int = 0
    integrity_failures: int = 0


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
    rows_by_table: dict[str, int] = field(default_factory=dict)
    sink_metrics: dict[str, int] = field(default_factory=dict)  # the sinks' operation counters, summed
    started: float = field(default_factory=time.monotonic)
    stopped_on_request: bool = False  # Ctrl-C, SIGTERM...: not idle, not at the end of its input
    unapplied: list[Unapplied] = field(default_factory=list)  # per partition, when the run ended

    def add(self, tally: _Tally) -> None:
        for table, rows in tally.rows_by_table.items():
            self.rows += rows
            self.rows_by_table[table] = self.rows_by_table.get(table, 0) + rows
        self.ddls += tally.ddls
        self.dead_letters += tally.dead_letters
        self.integrity_failures += tally.integrity_failures

    def combined(self, other: PipelineStats) -> PipelineStats:
        """The totals of two members of one group (the earlier start)."""
        tables = dict(self.rows_by_table)
        for table, rows in other.rows_by_table.items():
            tables[table] = tables.get(table, 0) + rows
        metrics = dict(self.sink_metrics)
        for name, value in other.sink_metrics.items():
            metrics[name] = metrics.get(name, 0) + value
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
            rows_by_table=tables,
            sink_metrics=metrics,
            started=min(self.started, other.started),
            stopped_on_request=self.stopped_on_request or other.stopped_on_request,
            unapplied=[*self.unapplied, *other.unapplied],
        )


class Pipeline(RebalanceListener):
    """Owns the loop. It is its source's rebalance listener: build the source with `listener=pipeline`.

    `decode_workers` > 0 runs the stages side by side: that many processes decode values into typed
    columns and a thread applies units to the sinks, while the loop fetches, orders and commits. Call
    `close` when done (it stops them).

    `large_messages` makes key-only DMLs (spec §7) whole before the state machine sees them; without one,
    every claim-check is refused and every handle-key-only row goes to the error policy.

    `source_retry`: how often, and how patiently, a transient source error is retried before the run stops
    on it (a permanent one stops it at once).

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
        dead_letters: DeadLetterSink,
        decoder: RecordDecoder | None = None,
        policy: ValuePolicy | None = None,
        max_batch_records: int = 100_000,
        poll_timeout: float = 0.2,
        decode_workers: int = 0,
        large_messages: LargeMessageResolver | None = None,
        source_retry: SourceRetry | None = None,
        pause_gc: bool = False,
        row_decoder: RowDecoder = table_changes,
    ) -> None:
        self.group = group
        self.source_retry = source_retry or SourceRetry()
        self.pause_gc = pause_gc
        self.state = state
        self.sinks = list(sinks)
        self.dead_letters = dead_letters
        self.decoder: RecordDecoder = decoder or MessageDecoder()
        self.policy = policy or ValuePolicy()
        self.large_messages = large_messages or LargeMessageResolver(MessageDecoder(), ClaimCheckStore([]))
        self.large_messages.schemas = self._schema_of
        self.row_decoder = row_decoder
        self.max_batch_records = max_batch_records
        self.poll_timeout = poll_timeout
        self.stats = PipelineStats()
        self.decode_stats = DecodeStats()  # values the policy nulled, images verified (any thread adds)
        # With decode workers the stages overlap: workers decode, a writer thread applies units to the sinks
        # in order (delta-rs releases the GIL), and this loop fetches, orders and confirms.
        self._pool = (
            DecodePool(decode_workers, self.policy, self.decoder.registry, self.decode_stats)
            if decode_workers
            else None
        )
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sink-writer") if decode_workers else None
        self._queue: deque[_Queued] = deque()  # resolved, not handed to the sinks yet: in resolve order
        self._queued_rows = 0
        self._writing: deque[tuple[Unit, Future[_Tally]]] = deque()  # handed to the writer, not confirmed
        self._writing_rows = 0
        self._write_error: BaseException | None = None  # the unit the writer failed on stops everything
        self._tally = _Tally()  # what the unit being applied did (one unit is applied at a time)
        self._source: Source | None = None
        self._codecs: dict[tuple[str, str, int], TableCodec] = {}
        self._resume: dict[TopicPartition, int] = {}
        self._paused: set[TopicPartition] = set()
        self._schemas_refreshed = 0.0
        self._idle = 0.0  # seconds spent waiting in polls since the last change record
        self._changed = False  # a change record arrived in the current cycle
        # Progress the sinks record: every change of every owned partition up to `_applied_ts` is applied
        # (None until a cycle applied all it resolved since the last assignment).
        self._recorders = [sink for sink in self.sinks if isinstance(sink, ProgressRecorder)]
        self._applied_ts: int | None = None
        self._recorded_at = 0.0
        self._recorded_schemas = -1  # `SchemaCache.learned` when the sinks last recorded the schemas
        self._learn_recorded_schemas()

    # -- lifecycle -------------------------------------------------------------------------------------
    def run(
        self,
        source: Source,
        *,
        until_idle: float | None = None,
        on_cycle: Callable[[Pipeline], None] | None = None,
        stop: StopRequest | None = None,
    ) -> PipelineStats:
        """Consume until `stop` is requested or, with `until_idle`, until no change record arrived for that
        many seconds (TiCDC keeps broadcasting WATERMARKs while the upstream is idle: those don't count);
        everything resolved by then is applied and committed. The totals say what was left unapplied."""
        self._source = source
        self._idle = 0.0
        paused = self.pause_gc and gc.isenabled()
        if paused:
            gc.disable()
        collected = time.monotonic()
        try:
            while True:
                polled = time.monotonic()
                records = self.source_retry.call(
                    "poll", lambda: source.poll_batch(self.max_batch_records, self.poll_timeout)
                )
                waited = time.monotonic() - polled
                self.step(records)
                self._idle = 0.0 if self._changed else self._idle + waited
                if on_cycle:
                    on_cycle(self)
                if stop is not None and stop.requested:
                    self.stats.stopped_on_request = True
                    break
                if until_idle is not None and self._idle_for(source) >= until_idle:
                    break
                if paused and polled - collected > GC_EVERY_SECONDS:
                    gc.collect()
                    collected = time.monotonic()
        finally:
            try:
                self._flush_and_commit(final=True)
            finally:
                self._count_integrity_and_fetches()
                if paused:
                    gc.enable()
        self.stats.unapplied = self.state.unapplied()
        return self.stats

    def finish(self) -> None:
        """The last flush and commit of records fed by `step_decoded` (`run` does its own): the sinks record
        their progress, due or not, so the lake says how far it is consistent."""
        self._flush_and_commit(final=True)
        self.stats.unapplied = self.state.unapplied()

    def close(self) -> None:
        """Release the sinks, the dead-letter destination and the decode workers (after `run` has flushed
        and committed)."""
        for sink in self.sinks:
            sink.close()
        self.dead_letters.close()
        self.large_messages.close()
        if self._pool:
            self._pool.close()
        if self._writer:
            self._writer.shutdown()

    def _idle_for(self, source: Source) -> float:
        """Seconds spent waiting for records without a change record arriving: time spent writing is not
        idleness (records may have queued meanwhile). While joining a group (no partitions yet) a grace
        period first applies, so a slow join is not mistaken for an idle topic, but a member never assigned
        still stops."""
        return self._idle if source.assignment() else self._idle - JOIN_GRACE_SECONDS

    def step(self, records: Sequence[SourceRecord]) -> None:
        """One cycle: ingest, apply what resolved, commit, adjust backpressure.

        With decode workers, a batch still decoding is left for a later cycle (at most about one cycle's
        records wait so), so the workers decode while this loop fetches and orders the next records."""
        self._changed = False
        self._ingest(records)
        self._settle()

    def step_decoded(self, records: Iterable[DecodedRecord]) -> bool:
        """One cycle over records decoded elsewhere (the Spark engine's executors), in each partition's
        offset order; whether a change record (anything but a WATERMARK) was among them."""
        self._changed = False
        decoded: list[tuple[RecordLocation, DecodedMessage | _Failed]] = []
        values: list[bytes | None] = []
        exceptional = False
        for location, message, value in records:
            if isinstance(message, ConsumerError):
                decoded.append((location, _Failed(message, value)))
                exceptional = True
            else:
                exceptional = exceptional or message.__class__ is KeyOnlyDML
                decoded.append((location, message))
            values.append(value)
        self.stats.records += len(decoded)
        self._take(decoded, values if exceptional else None)
        self._settle()
        return self._changed

    def attach(self, source: Source) -> None:
        """The source `step`/`step_decoded` commit to and take backpressure from (`run` attaches its own)."""
        self._source = source

    def _settle(self) -> None:
        """The end of a cycle: apply what resolved, commit, adjust backpressure."""
        if (
            self.state.stats().held_rows
            and time.monotonic() - self._schemas_refreshed > SCHEMA_REFRESH_SECONDS
        ):
            self._learn_recorded_schemas()
        self._flush_and_commit(drain=self._pool is None)
        self._backpressure()
        self._count_integrity_and_fetches()

    # -- rebalance listener ----------------------------------------------------------------------------
    def on_assign(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int] | None:
        """A fresh assignment is a mid-stream join; resume from the sinks' records where they are ahead, and
        learn the schemas the partitions' previous owner recorded (BOOTSTRAPs only announce the latest)."""
        self.state.assign(partitions)
        self._idle = 0.0  # joining a group is not idleness
        self._applied_ts = None  # not known for the new partitions until a cycle applies all it resolved
        self._learn_recorded_schemas()
        recorded = self._sink_resume_offsets()
        self.state.seed_watermarks(self._sink_watermarks())
        committed = self._committed(partitions)
        starts = {}
        for tp in partitions:
            sink_offset = recorded.get(tp)
            kafka_offset = committed.get(tp)
            if sink_offset is not None and (kafka_offset is None or sink_offset > kafka_offset):
                starts[tp] = sink_offset
        if starts:
            log.info("resuming %d partition(s) from sink-recorded offsets: %s", len(starts), starts)
        return starts or None

    def _committed(self, partitions: list[TopicPartition]) -> Mapping[TopicPartition, int | None]:
        source = self._source
        if source is None:
            return {}
        return self.source_retry.call("reading committed offsets", lambda: source.committed(partitions))

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        """Flush and commit what can be, then drop the partitions' state (the next owner re-reads it)."""
        self._flush_and_commit(final=True)
        self.state.revoke(partitions)
        for tp in partitions:
            self._resume.pop(tp, None)
            self._paused.discard(tp)

    # -- stages ----------------------------------------------------------------------------------------
    def _ingest(self, records: Sequence[SourceRecord]) -> None:
        """Decode the records and hand them to the state in one call. Key-only DMLs are made whole first,
        each kept at its record's place; a record that does not decode (or cannot be made whole) goes to
        the state's error path between the records before and after it."""
        self.stats.records += len(records)
        decode = self.decoder.decode_record
        decoded: list[tuple[RecordLocation, DecodedMessage | _Failed]] = []
        exceptional = False
        for record in records:
            location = record.location
            try:
                message = decode(record.key, record.value)
            except DependencyError:  # e.g. the schema registry is down: stop, set nothing aside
                raise
            except ConsumerError as exc:
                decoded.append((location, _Failed(exc, record.value)))
                exceptional = True
                continue
            exceptional = exceptional or message.__class__ is KeyOnlyDML
            decoded.append((location, message))
        self._take(decoded, [record.value for record in records] if exceptional else None)

    def _take(
        self,
        decoded: list[tuple[RecordLocation, DecodedMessage | _Failed]],
        values: list[bytes | None] | None,
    ) -> None:
        """Hand decoded records to the state in one call; `values` (the records' own) when some of them
        failed or are key-only."""
        if values is not None:
            self._ingest_exceptional(decoded, values)
        else:
            self.state.process_many(decoded)  # type: ignore[arg-type]
        if not self._changed:
            self._changed = any(not isinstance(message, Watermark) for _, message in decoded)

    def _ingest_exceptional(
        self, decoded: list[tuple[RecordLocation, DecodedMessage | _Failed]], values: list[bytes | None]
    ) -> None:
        """Resolve the poll's key-only DMLs together (their claim-checks are fetched concurrently), then
        feed the state in runs split at the records that go to the error policy."""
        positions = [i for i, (_, message) in enumerate(decoded) if message.__class__ is KeyOnlyDML]
        if positions:
            resolved = self.large_messages.resolve([decoded[i][1] for i in positions])  # type: ignore[misc]
            for position, whole in zip(positions, resolved, strict=True):
                location = decoded[position][0]
                if isinstance(whole, ConsumerError):
                    decoded[position] = (location, _Failed(whole, values[position]))
                else:
                    decoded[position] = (location, whole)
        run: list[tuple[RecordLocation, DecodedMessage]] = []
        for location, message in decoded:
            if isinstance(message, _Failed):
                self.state.process_many(run)
                run = []
                self.state.process_failed(location, message.error.with_location(location), message.value)
                self._changed = True
            else:
                run.append((location, message))
        self.state.process_many(run)

    def _schema_of(self, message: KeyOnlyDML) -> TableSchema | None:
        """The known schema of a handle-key-only row (what an upstream lookup is typed by)."""
        return self.state.schemas.lookup(message.row.schema_key, message.row.table_id)

    def _flush_and_commit(self, *, drain: bool = True, final: bool = False) -> None:
        """Apply resolved units in order, then commit what they made durable. Without `drain`, stop at a
        batch still decoding, unless more than a cycle's records are waiting. `final`: the last before the
        run ends or partitions go: the sinks record their progress whenever it is due or not."""
        if self._write_error is not None:
            try:
                self._confirm_written(wait=True)  # confirms the units before the failed one, raises its error
            finally:
                self._commit(final=final)
            return  # nothing after a unit that failed to apply may be applied or committed
        before = self.state.stats()  # rows waiting for a schema may be older than the watermark
        watermark = before.global_watermark if not before.held_rows else None
        units = self.state.resolve()
        if units:
            resolved_ts = self.state.stats().global_watermark or 0
            self._queue.extend(self._queued(unit, resolved_ts) for unit in units)
        context: CommitContext | None = None
        while self._queue and (drain or self._queue[0].ready() or self._queued_rows > self.max_batch_records):
            queued = self._queue.popleft()
            self._queued_rows -= _rows(queued.unit)
            if context is None or context.resolved_ts != queued.resolved_ts:
                context = self._context(queued.resolved_ts)
            if self._writer:
                self._writing.append((queued.unit, self._writer.submit(self._write, queued, context)))
                self._writing_rows += _rows(queued.unit)
            else:
                self.stats.add(self._apply(queued, context))
                self.state.confirm(queued.unit)
        try:
            self._confirm_written(wait=drain)
            if watermark is not None and not self._queue and not self._writing:
                self._applied_ts = watermark  # every change up to it is applied
        finally:
            self._commit(final=final)  # what was applied, even when a later unit failed

    def _write(self, queued: _Queued, context: CommitContext) -> _Tally:
        """The writer thread's job; once one unit failed, the later ones are left unapplied."""
        if self._write_error is not None:
            return _Tally()
        try:
            return self._apply(queued, context)
        except BaseException as exc:
            self._write_error = exc
            raise

    def _confirm_written(self, *, wait: bool) -> None:
        """Confirm, in order, the units the writer has applied, waiting while more than a cycle's records
        are in its hands; a unit that failed to apply raises here."""
        while self._writing and (
            wait or self._writing[0][1].done() or self._writing_rows > self.max_batch_records
        ):
            unit, writing = self._writing.popleft()
            self._writing_rows -= _rows(unit)
            try:
                tally = writing.result()
            except BaseException:
                self._writing.clear()  # the units after it were not applied: never confirmed
                self._writing_rows = 0
                raise
            self.stats.add(tally)
            self.state.confirm(unit)

    def _queued(self, unit: Unit, resolved_ts: int) -> _Queued:
        self._queued_rows += _rows(unit)
        if not isinstance(unit, RowBatch) or self._pool is None:
            return _Queued(unit, resolved_ts)
        return _Queued(unit, resolved_ts, self._pool.submit(unit.schema, unit.rows))

    def _apply(self, queued: _Queued, context: CommitContext) -> _Tally:
        """Apply one unit to the sinks; returns what it did, for the loop's thread to add to the totals."""
        self._tally = _Tally()
        unit = queued.unit
        if isinstance(unit, RowBatch):
            self._write_rows(unit, context, queued.decoding)
        elif isinstance(unit, DDLUnit):
            schema = unit.ddl.table_schema
            event = DDLEvent(unit.ddl, schema.database if schema else None, schema.table if schema else None)
            for sink in self.sinks:
                sink.apply_ddl(event, context)
            self._tally.ddls += 1
        else:
            self._dead_letter(unit)
        return self._tally

    def _write_rows(self, unit: RowBatch, context: CommitContext, decoding: Decoding | None) -> None:
        """Deliver the worker's decoding, or decode here: without workers, and to apply the error policy to
        a row that did not decode (a worker only says that one did not)."""
        decoded = self._pool.result(decoding, unit.schema) if self._pool and decoding else None
        if decoded is not None:
            self._deliver(decoded, context)
            return
        try:
            codec = self._codec(unit)
        except DecodeError as exc:  # a recorded schema this SDK refuses: no row of that version decodes
            self._set_aside(list(unit.rows), exc)
            return
        rows = list(unit.rows)
        origins: RowOrigins | None = unit.origins  # until a bad row is taken out
        while rows:
            counted = self.decode_stats.unrepresentable
            try:
                changes = self.row_decoder(codec, rows, origins)
            except DecodeError as exc:
                if self.state.policy == "fail":
                    raise
                self.decode_stats.unrepresentable = counted  # the retry counts the batch's values again
                origins = None
                row = getattr(exc, "row", None)
                if row is None:  # which row is unknown: each alone tells, and is delivered alone
                    self._write_one_by_one(codec, rows, context)
                    return
                self._set_aside([rows.pop(row)], exc)
                continue
            except RejectedRowsError as exc:  # every row that failed verification, at once
                if self.state.policy == "fail":
                    raise exc.rejected[min(exc.rejected)] from exc
                self.decode_stats.unrepresentable = counted
                self._tally.integrity_failures += len(exc.rejected)
                for index in sorted(exc.rejected, reverse=True):
                    bad_raw, bad_location = rows.pop(index)
                    error = exc.rejected[index]
                    self._dead_letter(DeadLetter(bad_location, str(error), bad_raw.payload, error.code))
                origins = None
                continue
            self._deliver(changes, context)
            return

    def _write_one_by_one(
        self, codec: TableCodec, rows: list[tuple[RawDML, RecordLocation]], context: CommitContext
    ) -> None:
        """A batch that failed without naming its row: each row on its own (a rare, slow path)."""
        for row in rows:
            try:
                changes = table_changes(codec, [row])
            except DecodeError as exc:
                self._set_aside([row], exc)
            else:
                self._deliver(changes, context)

    def _set_aside(self, rows: list[tuple[RawDML, RecordLocation]], error: DecodeError) -> None:
        if self.state.policy == "fail":
            raise error.with_location(rows[0][1])
        reason = f"{type(error).__name__}: {error.reason}"
        for raw, location in rows:
            self._dead_letter(DeadLetter(location, reason, raw.payload, error.code))

    def _deliver(self, changes: TableChanges, context: CommitContext) -> None:
        for sink in self.sinks:
            sink.write(changes, context)
        name, tables = f"{changes.database}.{changes.table}", self._tally.rows_by_table
        tables[name] = tables.get(name, 0) + changes.changelog.num_rows

    def _dead_letter(self, unit: DeadLetter) -> None:
        self.dead_letters.write(unit)
        self._tally.dead_letters += 1
        log.warning("dead-lettered %s: %s", unit.location, unit.reason)

    def _count_integrity_and_fetches(self) -> None:
        """Totals the stages keep themselves (decode workers report theirs through `decode_stats`)."""
        storage = self.large_messages.store.stats
        self.stats.verified_images = self.decode_stats.verified
        self.stats.claim_check_fetches = storage.fetches
        self.stats.claim_check_bytes = storage.bytes
        self.stats.claim_check_seconds = storage.seconds
        upstream = self.large_messages.upstream
        self.stats.upstream_lookups = upstream.lookups if upstream is not None else 0

    def _codec(self, unit: RowBatch) -> TableCodec:
        codec = self._codecs.get(unit.schema.key)
        if codec is None or codec.schema != unit.schema:
            codec = self._codecs[unit.schema.key] = TableCodec(
                unit.schema, self.policy, registry=self.decoder.registry, stats=self.decode_stats
            )
        return codec

    def _commit(self, *, final: bool = False) -> None:
        offsets = self.state.committable()
        self._record_progress(force=final)
        self._sink_metrics()
        if not offsets or self._source is None:
            return
        try:
            self._source.commit(offsets)
        except SourceError as exc:
            # e.g. a rebalance took the partitions away: the next owner re-reads from the last commit,
            # so a failed commit can only cause redelivery (recognisable by offset), never loss
            self.stats.failed_commits += 1
            self.state.commit_failed(offsets)  # tried again next cycle
            log.warning("offset commit failed, records after the last commit will be redelivered: %s", exc)
            return
        self._resume.update(offsets)
        self.stats.commits += 1

    def _backpressure(self) -> None:
        if self._source is None:
            return
        wanted = self.state.paused()
        if wanted - self._paused:
            self._source.pause(wanted - self._paused)
        if self._paused - wanted:
            self._source.resume(self._paused - wanted)
        self._paused = set(wanted)

    # -- recorded progress -----------------------------------------------------------------------------
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

    def _record_progress(self, *, force: bool) -> None:
        """Let the sinks that keep progress record where each owned partition can resume and up to which
        commit ts its changes are applied (`CommitContext.applied_ts`): a partition whose every record seen
        is applied is complete up to its own watermark, the others up to the last watermark whose units all
        applied. Nothing is claimed while rows wait for their schema. Before the Kafka commit, so the
        schemas a resumed member needs are recorded before Kafka moves past the records that told them."""
        if not self._recorders or self._write_error is not None:
            return
        learned = self.state.schemas.learned
        fresh = learned != self._recorded_schemas
        if not (force or fresh or time.monotonic() - self._recorded_at >= PROGRESS_SECONDS):
            return
        resume: dict[TopicPartition, int] = {}
        applied: dict[TopicPartition, int] = {}
        held = self.state.stats().held_rows
        for tp, partition in self.state.partition_states().items():
            if partition.resume_offset is None:
                continue
            resume[tp] = partition.resume_offset
            applied_ts = partition.watermark if partition.drained else self._applied_ts
            if applied_ts is not None and not held:
                applied[tp] = applied_ts
        if not resume and not fresh:
            return
        self._confirm_written(wait=True)  # a sink is used by one thread at a time
        context = CommitContext(
            group=self.group,
            resume_offsets=resume,
            resolved_ts=self._applied_ts or 0,
            schema_snapshot=self.state.schemas.snapshot() if fresh else b"",
            applied_ts=applied,
        )
        for sink in self._recorders:
            sink.record_progress(context)
        self._recorded_at, self._recorded_schemas = time.monotonic(), learned

    def _sink_metrics(self) -> None:
        totals: dict[str, int] = {}
        for sink in self.sinks:
            if isinstance(sink, ReportsMetrics):
                for name, value in sink.operation_metrics().items():
                    totals[name] = totals.get(name, 0) + value
        self.stats.sink_metrics = totals

    def _sink_watermarks(self) -> dict[TopicPartition, int]:
        """Per partition, a commit ts every sink that keeps progress recorded its changes applied up to."""
        if not self._recorders:
            return {}
        per_sink = [sink.recorded_watermarks(self.group) for sink in self._recorders]
        common = set(per_sink[0]).intersection(*per_sink[1:])
        return {tp: min(marks[tp] for marks in per_sink) for tp in common}

    def _sink_resume_offsets(self) -> dict[TopicPartition, int]:
        """A partition can resume from a sink-recorded offset only if every sink recorded one (the min)."""
        self._confirm_written(wait=True)  # a sink is read by one thread at a time
        if not self.sinks:
            return {}
        per_sink = [sink.recorded_offsets(self.group) for sink in self.sinks]
        common = set(per_sink[0]).intersection(*per_sink[1:])
        return {tp: min(offsets[tp] for offsets in per_sink) for tp in common}

    def _learn_recorded_schemas(self) -> None:
        """Schemas recorded with the sinks' commits: a restarted or rebalanced member need not wait for the
        next BOOTSTRAP, and rows written at a version no BOOTSTRAP will announce again still decode."""
        self._schemas_refreshed = time.monotonic()
        self._confirm_written(wait=True)  # a sink is read by one thread at a time
        recorded = self.state.schemas.learned == self._recorded_schemas
        for sink in self.sinks:
            snapshot = sink.recorded_schema_snapshot()
            if snapshot:
                self.state.learn_schemas(snapshot_schemas(snapshot))
        if recorded or self._recorded_schemas < 0:  # what it knows now is what the sinks hold
            self._recorded_schemas = self.state.schemas.learned
