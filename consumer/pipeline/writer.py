"""Applying resolved units to the sinks, in resolve order, and confirming each to the state machine once
every sink has durably applied it (only confirmed units count towards the offsets committed to Kafka).

With decode workers the stages overlap: a pool of processes types each row batch's values while the loop
fetches and orders the next records, and one writer thread applies units to the sinks (delta-rs releases
the GIL). Without them, the loop's thread types and applies each unit itself.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from consumer.batches.changes import SpooledChanges, TableChanges, block_changes
from consumer.batches.decode_pool import DecodePool, Decoding
from consumer.errors import ConflictingResendError, DeadLetter, DecodeError
from consumer.pipeline.bad_rows import BadRowRetry
from consumer.pipeline.stats import UnitTally
from consumer.protocol.base import RecordDecoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import DecodeStats, ValuePolicy
from consumer.sinks.base import CommitContext, DDLEvent, Sink, WritesAhead, Written
from consumer.sinks.dead_letter import DeadLetterQueue
from consumer.state.machine import ConsumerState
from consumer.state.units import BlockBatch, DDLUnit, RowBatch, Unit
from consumer.watchdog import Watchdog

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Queued:
    """A resolved unit waiting to be applied, with its rows' decoding when a worker does it, and the global
    watermark it was resolved at: what the commit applying it may claim to be consistent at."""

    unit: Unit
    resolved_ts: int
    decoding: Decoding | None = None
    changes: TableChanges | None = None  # a `BlockBatch`'s, once made

    def ready(self) -> bool:
        return self.decoding is None or self.decoding.done()


def _rows(unit: Unit) -> int:
    if isinstance(unit, BlockBatch):
        return unit.row_count
    return len(unit.rows) if isinstance(unit, RowBatch) else 0


class UnitOutput:
    """One unit's way to the sinks and to the dead-letter destination, counting what it did (the thread
    applying the unit owns it), each write watched by `watchdog`."""

    def __init__(
        self,
        sinks: Sequence[Sink],
        dead_letters: DeadLetterQueue,
        context: CommitContext,
        watchdog: Watchdog,
        *,
        fail: bool = False,
    ) -> None:
        """`fail`: the error policy is "fail" (a conflicting copy stops the run)."""
        self.tally = UnitTally()
        self._fail = fail
        self._sinks = sinks
        self._dead_letters = dead_letters
        self._context = context
        self._watchdog = watchdog

    def deliver(self, changes: TableChanges) -> None:
        """Write to every sink; the first (the configured one) says what was committed: its rows, the
        re-sent copies it skipped, and those that conflict, which go to the error policy."""
        name, tables = f"{changes.database}.{changes.table}", self.tally.rows_by_table
        first: Written | None = None
        for sink in self._sinks:
            with self._watchdog.watching(f"{type(sink).__name__}.write {name}"):
                written = sink.write(changes, self._context)
            first = first or written or Written(changes.row_count)
        committed = first or Written(0)
        tables[name] = tables.get(name, 0) + committed.rows
        self.tally.resent += committed.resent
        for letter in committed.conflicts:
            if self._fail:
                raise ConflictingResendError(letter.reason, location=letter.location)
            self.dead_letter(letter)

    def apply_ddl(self, unit: DDLUnit) -> None:
        ddl = unit.ddl
        event = DDLEvent(ddl, ddl.database_name(), ddl.table_schema.table if ddl.table_schema else None)
        for sink in self._sinks:
            target = ".".join(name for name in (event.database, event.table) if name)
            with self._watchdog.watching(f"{type(sink).__name__}.apply_ddl {target}"):
                sink.apply_ddl(event, self._context)
        self.tally.ddls += 1

    def dead_letter(self, letter: DeadLetter) -> None:
        with self._watchdog.watching(f"{type(self._dead_letters).__name__}.write {letter.location}"):
            self._dead_letters.write(letter)
        self.tally.dead_letters += 1
        log.warning("dead-lettered %s: %s", letter.location, letter.reason)

    def count_integrity_failures(self, count: int) -> None:
        self.tally.integrity_failures += count


class SinkWriter:
    """Queues resolved units, applies them in order and confirms them, adding what each did to the totals
    through `count` (on the loop's thread: the one confirming). `max_batch_records` bounds the rows waiting
    in each stage: past it, the loop waits instead of running ahead.

    Once a unit failed to apply, nothing after it is applied or confirmed: the failure is raised when the
    loop confirms that unit (`failed` says it happened)."""

    def __init__(
        self,
        *,
        state: ConsumerState,
        sinks: Sequence[Sink],
        dead_letters: DeadLetterQueue,
        decoder: RecordDecoder,
        policy: ValuePolicy,
        decode_stats: DecodeStats,
        bad_rows: BadRowRetry,
        count: Callable[[UnitTally], None],
        max_batch_records: int,
        decode_workers: int = 0,
        watchdog: Watchdog,
    ) -> None:
        self.state = state
        self.watchdog = watchdog
        self.sinks = sinks
        self.dead_letters = dead_letters
        self.decoder = decoder
        self.policy = policy
        self.decode_stats = decode_stats
        self.bad_rows = bad_rows
        self.count = count
        self.max_batch_records = max_batch_records
        self._pool = (
            DecodePool(decode_workers, policy, decoder.protocol, decode_stats) if decode_workers else None
        )
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="sink-writer") if decode_workers else None
        self._queue: deque[_Queued] = deque()  # resolved, not handed to the sinks yet: in resolve order
        self._queued_rows = 0
        self._writing: deque[tuple[Unit, Future[UnitTally]]] = deque()  # handed to the writer, unconfirmed
        self._writing_rows = 0
        self._write_error: BaseException | None = None  # the unit the writer failed on stops everything
        self._codecs: dict[tuple[str, str, int], TableCodec] = {}

    @property
    def concurrent(self) -> bool:
        """Whether units decode and apply while the loop goes on (with decode workers)."""
        return self._writer is not None

    @property
    def failed(self) -> bool:
        """A unit failed to apply: nothing after it may be applied, committed or recorded."""
        return self._write_error is not None

    @property
    def backlogged(self) -> bool:
        """Applying in the loop, more than a cycle's rows are resolved and not applied yet. (The writer's
        thread bounds its own: the loop waits while it holds more, in `confirm_written`.)"""
        return self._writer is None and self._queued_rows > self.max_batch_records

    @property
    def idle(self) -> bool:
        """Every unit queued so far is applied and confirmed."""
        return not self._queue and not self._writing

    def enqueue(self, units: Sequence[Unit], resolved_ts: int) -> None:
        """Units resolved at global watermark `resolved_ts`; row batches start decoding in the pool."""
        self._queue.extend(self._queued(unit, resolved_ts) for unit in units)

    def write(
        self, context_for: Callable[[int], CommitContext], *, drain: bool, until: float | None = None
    ) -> None:
        """Apply queued units in order (handing them to the writer thread, if any); without `drain`, stop at
        a batch still decoding, unless more than a cycle's records are waiting. Past `until` (a
        `time.monotonic()` deadline), stop, after one unit at least.
        `context_for(resolved_ts)`: what the sinks record with the units resolved at that watermark."""
        context: CommitContext | None = None
        while self._queue and (drain or self._queue[0].ready() or self._queued_rows > self.max_batch_records):
            if until is not None and context is not None and time.monotonic() >= until:
                break  # the loop pauses intake while the rows left exceed a cycle's (`backlogged`)
            if (
                self._writer is None
                and isinstance(self._queue[0].unit, BlockBatch)
                and self._queue[0].changes is None
            ):
                self._write_ahead(context_for)
            queued = self._queue.popleft()
            self._queued_rows -= _rows(queued.unit)
            if context is None or context.resolved_ts != queued.resolved_ts:
                context = context_for(queued.resolved_ts)
            if self._writer:
                self._writing.append((queued.unit, self._writer.submit(self._write, queued, context)))
                self._writing_rows += _rows(queued.unit)
            else:
                self.count(self._apply(queued, context))
                self.state.confirm(queued.unit)

    def _write_ahead(self, context_for: Callable[[int], CommitContext]) -> None:
        """Hand the sinks that write ahead (`WritesAhead`) the spooled batches at the head of the queue, up
        to the first unit of another kind (a DDL may move a table), at once."""
        run = []
        for queued in self._queue:
            if not isinstance(queued.unit, BlockBatch):
                break
            queued.changes = block_changes(self._codec(queued.unit), queued.unit.blocks)
            if isinstance(queued.changes, SpooledChanges):
                run.append(queued.changes)
        ahead = [sink for sink in self.sinks if isinstance(sink, WritesAhead)]
        if len(run) > 1 and ahead:
            context = context_for(self._queue[0].resolved_ts)
            for sink in ahead:
                sink.write_ahead(run, context)

    def confirm_written(self, *, wait: bool) -> None:
        """Confirm, in order, the units the writer has applied, waiting while more than a cycle's records
        are in its hands (with `wait`, for all of them); a unit that failed to apply raises here."""
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
            self.count(tally)
            self.state.confirm(unit)

    def after_written(self, job: Callable[[], bool]) -> Future[bool]:
        """Run `job` on the writer's thread once the units handed to it are applied, so the loop goes on
        meanwhile and a sink is still used by one thread at a time; without that thread, run it now."""
        if self._writer is not None:
            return self._writer.submit(job)
        done: Future[bool] = Future()
        done.set_result(job())
        return done

    def close(self) -> None:
        """Stop the decode workers and the writer thread."""
        if self._pool:
            self._pool.close()
        if self._writer:
            self._writer.shutdown()

    def _queued(self, unit: Unit, resolved_ts: int) -> _Queued:
        self._queued_rows += _rows(unit)
        if not isinstance(unit, RowBatch) or self._pool is None:
            return _Queued(unit, resolved_ts)
        return _Queued(unit, resolved_ts, self._pool.submit(unit.schema, unit.rows))

    def _write(self, queued: _Queued, context: CommitContext) -> UnitTally:
        """The writer thread's job; once one unit failed, the later ones are left unapplied."""
        if self._write_error is not None:
            return UnitTally()
        try:
            return self._apply(queued, context)
        except BaseException as exc:
            self._write_error = exc
            raise

    def _apply(self, queued: _Queued, context: CommitContext) -> UnitTally:
        """Apply one unit to the sinks; returns what it did, for the loop's thread to add to the totals."""
        output = UnitOutput(
            self.sinks, self.dead_letters, context, self.watchdog, fail=self.state.policy == "fail"
        )
        unit = queued.unit
        if isinstance(unit, RowBatch):
            self._write_rows(unit, output, queued.decoding)
        elif isinstance(unit, BlockBatch):  # typed where they were decoded, with the same codec
            changes = (
                queued.changes
                if queued.changes is not None
                else block_changes(self._codec(unit), unit.blocks)
            )
            output.deliver(changes)
        elif isinstance(unit, DDLUnit):
            output.apply_ddl(unit)
        else:
            output.dead_letter(unit)
        return output.tally

    def _write_rows(self, unit: RowBatch, output: UnitOutput, decoding: Decoding | None) -> None:
        """Deliver the worker's decoding, or decode here: without workers, and to apply the error policy to
        a row that did not decode (a worker only says that one did not)."""
        decoded = self._pool.result(decoding, unit.schema) if self._pool and decoding else None
        if decoded is not None:
            output.deliver(decoded)
            return
        try:
            codec = self._codec(unit)
        except DecodeError as exc:  # a recorded schema this SDK refuses: no row of that version decodes
            self.bad_rows.set_aside(list(unit.rows), exc, output)
            return
        self.bad_rows.write(codec, unit, output)

    def _codec(self, unit: RowBatch | BlockBatch) -> TableCodec:
        codec = self._codecs.get(unit.schema.key)
        if codec is None or codec.schema != unit.schema:
            codec = self._codecs[unit.schema.key] = TableCodec(
                unit.schema, self.policy, protocol=self.decoder.protocol, stats=self.decode_stats
            )
        return codec
