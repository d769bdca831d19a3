"""Dead letters, listed and replayed once their cause is fixed (a claim-check root added, the registry
back, a schema recorded late, a newer SDK).

A replay sends the letters' own bytes (key and value) through the pipeline `run` builds from the current
configuration: the same decoder, large-message resolver, state machine and sinks, into the same lake. What
makes it safe:

- Exactly once: a run commits under its own consumer group, `<group>:dead-letters:<run id>`, and feeds each
  partition's letters in offset order, so the sinks' app transactions (next offset per group and partition)
  skip what a run already applied when it is finished after a stop. The run's id and letters are recorded
  before it applies anything, its failures as they happen, its applied letters when done
  (`consumer.redrive.outcomes`); a letter resolved is never replayed again, so a second replay commits
  nothing. A run never records progress in `_progress`: the lake's consistent point stays the stream's.
- Never older over newer: the rows are old (a letter's commit ts is below the lake's progress), so a
  replay orders by arrival, per key in offset order, and needs no watermark; against the lake the mirror's
  MERGE keeps the newer change (a change older than the row's `_commit_ts`, or than a later delete of the
  key, never wins). A DML without a commit ts (a TiCDC Avro tombstone without the TiDB extension) cannot be
  ordered against the lake: it keeps its letter (`replay-without-commit-ts`).
- Schemas: the pipeline learns the lake's recorded schemas when it opens, before any letter; a row whose
  schema is still unknown after its batch fails again at once (the pending timeout is 0), as does any
  record that does not decode, under the "dead-letter" policy whatever `errors.policy` says.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from consumer.batches.changes import TableChanges
from consumer.config import RunConfig, kafka_source_parts
from consumer.configured import (
    build_decoder,
    build_large_messages,
    build_policy,
    build_sinks,
    build_state,
    dead_letter_target,
)
from consumer.errors import ConsumerError, DeadLetter, ReplayWithoutCommitTsError
from consumer.pipeline import Pipeline
from consumer.protocol.base import Protocol, RecordDecoder
from consumer.protocol.containment import KeyedValue
from consumer.protocol.model import DecodedMessage, KeyOnlyDML, RawDML, TableSchema
from consumer.redrive.outcomes import Origin, Outcomes, Run
from consumer.sinks.base import CommitContext, DDLEvent, Sink
from consumer.sinks.dead_letter import DeadLetterQueue, StoredLetter, letter_of_record, read_letters
from consumer.sources.files import RecordSource
from consumer.sources.lookups import read_topic
from consumer.sources.record import SourceRecord, TopicPartition


class LetterState(msgspec.Struct, frozen=True):
    """A letter as `dead-letters list` shows it: its origin, the reason it is set aside now (the last
    replay's, when one failed it again), and whether a replay applied it."""

    topic: str
    partition: int
    offset: int
    reason_code: str
    reason: str
    resolved: bool


class ReplayReport(msgspec.Struct):
    """What `replay` did: the runs it made or finished, the letters it applied, and those that failed
    again (with their new reasons)."""

    runs: list[str] = msgspec.field(default_factory=list)
    resolved: int = 0
    failed: list[LetterState] = msgspec.field(default_factory=list)


def stored_letters(config: RunConfig) -> list[StoredLetter]:
    """Every letter the configured destination holds, each origin once, in origin order."""
    target = dead_letter_target(config)
    if not target.startswith("kafka://"):
        where = target if "://" in target else target.partition(":")[2]
        return read_letters(where, config.sink.storage_options)
    servers, topics = kafka_source_parts(target)
    letters: dict[Origin, StoredLetter] = {}
    for key, value, headers in read_topic(servers, topics[0], config=config.errors.kafka):
        try:
            letter = letter_of_record(key, value, headers)
        except ValueError:  # a record someone else produced to the topic
            continue
        letters[letter.topic, letter.partition, letter.offset] = letter
    return [letters[origin] for origin in sorted(letters)]


def letter_states(config: RunConfig, reason_code: str | None = None) -> list[LetterState]:
    """The configured destination's letters as the lake's replay log leaves them (`reason_code`: only
    those set aside for it now)."""
    runs = _outcomes(config).runs()
    states = [_state(letter, runs) for letter in stored_letters(config)]
    return [s for s in states if reason_code is None or s.reason_code == reason_code]


def replay(config: RunConfig, reason_code: str | None = None) -> ReplayReport:
    """Apply the unresolved letters (`reason_code`: only those set aside for it now) to the configured
    lake; first finish any run a stop left in doubt (all of its letters, whatever `reason_code` says)."""
    outcomes = _outcomes(config)
    letters = {(x.topic, x.partition, x.offset): x for x in stored_letters(config)}
    report = ReplayReport()
    for run in outcomes.runs():
        if run.resolved is None:
            doubtful = [letters[o] for o in run.letters if o in letters and o not in run.failed]
            _apply(config, outcomes, run, doubtful, report)
    runs = outcomes.runs()
    todo = [
        letter
        for letter in letters.values()
        if not (state := _state(letter, runs)).resolved
        and (reason_code is None or state.reason_code == reason_code)
    ]
    if todo:
        run = outcomes.start(config.source.group, [(x.topic, x.partition, x.offset) for x in todo])
        _apply(config, outcomes, run, todo, report)
    return report


def _outcomes(config: RunConfig) -> Outcomes:
    return Outcomes(config.sink.url.partition(":")[2], config.sink.storage_options)


def _state(letter: StoredLetter, runs: Sequence[Run]) -> LetterState:
    origin = (letter.topic, letter.partition, letter.offset)
    code, reason, resolved = letter.reason_code, letter.reason, False
    for run in runs:
        if origin in run.failed:
            (code, reason), resolved = run.failed[origin], False
        elif run.resolved is not None and origin in run.resolved:
            resolved = True
    return LetterState(letter.topic, letter.partition, letter.offset, code, reason, resolved)


def _apply(
    config: RunConfig, outcomes: Outcomes, run: Run, letters: list[StoredLetter], report: ReplayReport
) -> None:
    """One run over `letters` (in origin order); what it applied is recorded resolved, what it left
    unapplied (nothing, normally) stays as it was."""
    failures = _Failures(outcomes.failures(run))
    pipeline = _pipeline(_replaying(config), run.group, failures)
    try:
        source = RecordSource(map(_record, letters), listener=pipeline)
        pipeline.run(source, until_idle=pipeline.poll_timeout)
    finally:
        pipeline.close()
    left = {(tp[0], tp[1], o) for tp, offsets in pipeline.state.unapplied_offsets().items() for o in offsets}
    resolved = {(x.topic, x.partition, x.offset) for x in letters} - set(failures.letters) - left
    outcomes.finish(run, resolved)
    report.runs.append(run.id)
    report.resolved += len(resolved)
    report.failed += [
        LetterState(*origin, letter.reason_code, letter.reason, False)
        for origin, letter in sorted(failures.letters.items())
    ]


def _replaying(config: RunConfig) -> RunConfig:
    """The configuration a replay runs with: arrival ordering (see the module docstring), letters that
    fail again set aside (never a stop), no wait for schemas, and compression sniffed (a row's letter holds
    its decompressed payload, a record's letter the value as sent)."""
    return msgspec.structs.replace(
        config,
        decode=msgspec.structs.replace(config.decode, ordering="arrival", compression="auto"),
        errors=msgspec.structs.replace(config.errors, policy="dead-letter"),
        budget=msgspec.structs.replace(config.budget, pending_timeout_s=0.0),
    )


def _pipeline(config: RunConfig, group: str, failures: DeadLetterQueue) -> Pipeline:
    policy = build_policy(config)
    decoder = _Ordered(build_decoder(config.decode, policy))
    return Pipeline(
        group=group,
        state=build_state(config, decoder),
        sinks=[_Unrecorded(sink) for sink in build_sinks(config)],
        dead_letters=failures,
        decoder=decoder,
        policy=policy,
        max_batch_records=config.budget.max_batch_records,
        large_messages=build_large_messages(config, policy),
    )


def _record(letter: StoredLetter) -> SourceRecord:
    return SourceRecord(letter.topic, letter.partition, letter.offset, None, letter.key, letter.value)


class _Failures:
    """The run's failure log, remembering which letters failed again (by origin)."""

    def __init__(self, queue: DeadLetterQueue) -> None:
        self._queue = queue
        self.letters: dict[Origin, DeadLetter] = {}

    def write(self, letter: DeadLetter) -> None:
        self._queue.write(letter)
        where = letter.location
        self.letters[where.topic, where.partition, where.offset] = letter

    def close(self) -> None:
        self._queue.close()


class _Unrecorded:
    """A sink without its progress records: a replay's group must not enter the lake's consistent point,
    nor its resume offsets anyone's."""

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        self._sink.write(changes, context)

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        self._sink.apply_ddl(event, context)

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return self._sink.recorded_offsets(group)

    def recorded_schema_snapshot(self) -> bytes | None:
        return self._sink.recorded_schema_snapshot()

    def close(self) -> None:
        self._sink.close()


class _Ordered:
    """The configured decoder, refusing DMLs without a commit ts (see the module docstring)."""

    def __init__(self, decoder: RecordDecoder) -> None:
        self._decoder = decoder

    @property
    def protocol(self) -> Protocol:
        return self._decoder.protocol

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        message = _ordered(self._decoder.decode_record(key, value))
        if isinstance(message, ConsumerError):
            raise message
        return message

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        return [
            m if isinstance(m, ConsumerError) else _ordered(m) for m in self._decoder.decode_records(records)
        ]

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None:
        return self._decoder.described_schema(key)


def _ordered(message: DecodedMessage) -> DecodedMessage | ConsumerError:
    row = message.row if isinstance(message, KeyOnlyDML) else message
    if isinstance(row, RawDML) and not row.commit_ts:
        return ReplayWithoutCommitTsError(
            f"{row.type.name} of {row.database}.{row.table} has no commit ts: it cannot be ordered against "
            "the lake's newer changes"
        )
    return message
