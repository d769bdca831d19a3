"""The Spark engine's way of feeding the state machine is equivalent to the loop engine's.

A simulated TiCDC (`consumer.simulate`: DDLs of every kind, among them RENAME, TRUNCATE, DROP and CREATE
again, BOOTSTRAPs, WATERMARKs, some exactly at a row's commit ts) writes to one or two topics of several
partitions, encoded in the Simple protocol, with a few records that do not decode. Two state machines
(ordering by watermark or by arrival) own the same partitions (from the start or mid-stream, so rows wait
for schemas) and get the same records, cut into micro-batches at arbitrary points:

- (a) the loop engine's way: every record decoded on the driver (`RecordIntake.decode`), the partitions'
  records interleaved in poll-sized runs;
- (b) the Spark engine's way: tasks encode each partition's range in one or more segments (`encode_range`,
  knowing the schemas the engine recorded before the batch, or none), and the driver feeds their untyped
  records (`Segment.decoded`, `RecordIntake.decoded_elsewhere`), then every segment's typed rows as blocks
  (`Segment.blocks`, through `process_blocks`).

Between batches both resolve, confirm (the same units, matched by what they hold), lose and regain
partitions, and let time pass (rows whose schema never comes expire). After every step they must agree on
the DDLs and dead letters and their order, every table's released rows (their typed values and metadata, as
the writer makes them) and their order, the offsets safe to commit, what waits and for what, and the schema
pins. Only the order of different tables' rows between two DDLs is free: they are different units either
way, cut differently (a block's rows are never in the same unit as rows decoded on the driver).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

import msgspec
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from consumer.batches.changes import block_changes, table_changes
from consumer.errors import DeadLetter, RecordLocation
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.pipeline.intake import RecordIntake
from consumer.protocol.model import (
    DDL,
    DML,
    TSO_PHYSICAL_SHIFT,
    Bootstrap,
    Message,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.spark.segments import Segment, encode_range
from consumer.state import BlockBatch, ConsumerState, DDLUnit, RowBatch, SchemaCache, Unit
from consumer.state.machine import Ordering
from consumer.state.resolver import ddl_identity

TOPICS = ("a", "b")
START_MS = int(dt.datetime(2024, 3, 1, tzinfo=dt.UTC).timestamp() * 1000)
TABLE_ID_SHIFT = 10_000  # the second topic's tables: one TiDB cluster, so table ids never collide
TIMEOUT = 100.0
POLICY = ValuePolicy()
ENCODER = MessageEncoder()
DECODER = MessageDecoder()


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def _moved(schema: TableSchema | None, shift: int) -> TableSchema | None:
    return None if schema is None else msgspec.structs.replace(schema, table_id=schema.table_id + shift)


def _tso(commit_ts: int, topic: int) -> int:
    """The topic's TSOs made unique across topics (one TiDB cluster), in the same order: the logical part
    doubled, plus the topic's index."""
    logical = commit_ts & ((1 << TSO_PHYSICAL_SHIFT) - 1)
    return commit_ts - logical + 2 * logical + topic


def _shifted(message: Message, topic: int) -> Message:
    """The message as a workload sharing the cluster with the other topic's writes it: its own table ids
    and TSOs."""
    shift = topic * TABLE_ID_SHIFT
    if isinstance(message, DML | Watermark):
        message = msgspec.structs.replace(message, commit_ts=_tso(message.commit_ts, topic))
    if isinstance(message, DML):
        return msgspec.structs.replace(message, table_id=message.table_id + shift)
    if isinstance(message, Bootstrap):
        return msgspec.structs.replace(message, table_schema=_moved(message.table_schema, shift))
    if isinstance(message, DDL):
        return msgspec.structs.replace(
            message,
            commit_ts=_tso(message.commit_ts, topic),
            table_schema=_moved(message.table_schema, shift),
            pre_table_schema=_moved(message.pre_table_schema, shift),
        )
    return message


Log = list[SourceRecord]  # one partition's records as Kafka holds them
GARBAGE = b"\xff not a message"


def _logs(
    configs: list[WorkloadConfig], garbage: dict[TopicPartition, list[int]], tight: bool
) -> dict[TopicPartition, Log]:
    """The workloads' records per partition, with a record that does not decode at each `garbage` position,
    and at the end a WATERMARK past both topics' (theirs pass each other), so everything resolves. `tight`:
    each WATERMARK is the newest commit ts written before it (as TiCDC's resolved ts may be), so rows sit
    exactly at the watermark."""
    values: dict[TopicPartition, list[tuple[bytes | None, bytes]]] = {}
    for index, (topic, config) in enumerate(zip(TOPICS, configs, strict=False)):
        for partition in range(config.partitions):
            values[topic, partition] = []
        newest = 0
        for produced in Workload(config).records():
            message = _shifted(produced.message, index)
            if isinstance(message, Watermark) and tight and newest:
                message = msgspec.structs.replace(message, commit_ts=newest)
            elif isinstance(message, DML | DDL):
                newest = max(newest, message.commit_ts)
            key = b"" if isinstance(message, DML | Bootstrap) else None
            value = ENCODER.encode(message, _moved(produced.schema, index * TABLE_ID_SHIFT))
            values[topic, produced.partition].append((key, value))
    decoded = DECODER.decode_records(
        [SourceRecord("t", 0, 0, None, k, v) for log in values.values() for k, v in log]
    )
    last = max(
        message.commit_ts for message in decoded if isinstance(message, DML | DDL | RawDML | Watermark)
    )
    logs: dict[TopicPartition, Log] = {}
    for (topic, partition), log in values.items():
        log.append((None, ENCODER.encode(Watermark(commit_ts=last + 1, build_ts=0))))
        for position in sorted(garbage.get((topic, partition), []), reverse=True):
            log.insert(position % len(log), (None, GARBAGE))
        logs[topic, partition] = [
            SourceRecord(topic, partition, offset, None, key, value)
            for offset, (key, value) in enumerate(log)
        ]
    return logs


# -- what the two must agree on ---------------------------------------------------------------------
Rows = list[tuple[tuple[Any, ...], dict[str, Any]]]  # (the schema that types it, the changelog row) per row


@dataclass
class Section:
    """A resolve's rows between two DDLs: per table, in order, each with the schema that types it."""

    tables: dict[tuple[str, str], Rows] = field(default_factory=dict)
    units: dict[tuple[str, str], list[Unit]] = field(default_factory=dict)


@dataclass
class Resolved:
    """One resolve's output, normalised: dead letters (unordered), then sections split by DDLs."""

    dead: list[tuple[RecordLocation, str, str, bytes | None]]
    dead_units: list[Unit]
    sections: list[Section]
    ddls: list[tuple[Any, tuple[RecordLocation, ...]]]
    ddl_units: list[DDLUnit]

    def shape(self) -> tuple[Any, ...]:
        return (self.dead, [s.tables for s in self.sections], self.ddls)


class Codecs:
    """A codec per schema, as the sink writer keeps them."""

    def __init__(self) -> None:
        self._codecs: dict[TableSchema, TableCodec] = {}

    def changelog(self, unit: RowBatch | BlockBatch) -> list[dict[str, Any]]:
        """The unit's rows as the sink writer hands them to a sink."""
        codec = self._codecs.get(unit.schema)
        if codec is None:
            codec = self._codecs[unit.schema] = TableCodec(unit.schema, POLICY)
        if isinstance(unit, RowBatch):
            changes = table_changes(codec, unit.rows, unit.origins)
        else:
            changes = block_changes(codec, unit.blocks)
        rows: list[dict[str, Any]] = changes.changelog.to_pylist()
        return rows


def _place(dead: tuple[RecordLocation, str, str, bytes | None]) -> tuple[str, int, int]:
    return (dead[0].topic, dead[0].partition, dead[0].offset)


def normalised(units: list[Unit], codecs: Codecs) -> Resolved:
    dead = [unit for unit in units if isinstance(unit, DeadLetter)]
    resolved = Resolved(
        sorted(((d.location, d.reason, d.reason_code, d.value) for d in dead), key=_place),
        dead,
        [Section()],
        [],
        [],
    )
    seen_rows = False
    for unit in units:
        if isinstance(unit, DeadLetter):
            assert not seen_rows, "dead letters come first"
            continue
        seen_rows = True
        if isinstance(unit, DDLUnit):
            locations = tuple(sorted(unit.locations, key=lambda loc: (loc.topic, loc.partition, loc.offset)))
            resolved.ddls.append((ddl_identity(unit.ddl), locations))
            resolved.ddl_units.append(unit)
            resolved.sections.append(Section())
            continue
        assert isinstance(unit, RowBatch | BlockBatch)
        schema = unit.schema
        name = (schema.database, schema.table)
        section = resolved.sections[-1]
        identity = (schema.key, schema.table_id, schema.columns, schema.indexes)
        section.tables.setdefault(name, []).extend((identity, row) for row in codecs.changelog(unit))
        section.units.setdefault(name, []).append(unit)
    return resolved


def observed(state: ConsumerState) -> tuple[Any, ...]:
    """Everything a caller sees of the state between steps, but what depends on how units were cut (the
    units in flight) and the byte estimates (a block's rows cost what its Arrow table does)."""
    stats = state.stats()
    keys = {schema.key for schema in msgspec.msgpack.decode(state.schemas.snapshot(), type=list[TableSchema])}
    return (
        state.committable(),
        state.unapplied_offsets(),
        state.partition_states(),
        state.unapplied(),
        (
            stats.held_rows,
            stats.waiting_rows,
            stats.queued_ddls,
            stats.global_watermark,
            stats.cached_schemas,
        ),
        {key: state.schemas.pins(key) for key in keys},
    )


# -- the two feeds --------------------------------------------------------------------------------------
@dataclass
class Owned:
    cursor: int


@dataclass
class Twins:
    logs: dict[TopicPartition, Log]
    clock: Clock = field(default_factory=Clock)
    owned: dict[TopicPartition, Owned] = field(default_factory=dict)
    committed: dict[TopicPartition, int] = field(default_factory=dict)
    marks: dict[TopicPartition, int] = field(default_factory=dict)  # the watermarks commits carried
    in_flight: dict[Any, tuple[list[Unit], list[Unit]]] = field(default_factory=dict)
    resolves: int = 0
    codecs: Codecs = field(default_factory=Codecs)
    blocks_fed: int = 0
    rows_typed_elsewhere: int = 0
    rows_released: int = 0
    described: str = ""  # what generated it: shown instead of the records
    ordering: Ordering = "watermark"

    def __repr__(self) -> str:
        return f"Twins({self.described})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # hypothesis prints examples with it
        printer.text(repr(self))

    def __post_init__(self) -> None:
        self.loop = ConsumerState(clock=self.clock, pending_timeout=TIMEOUT, ordering=self.ordering)
        self.spark = ConsumerState(clock=self.clock, pending_timeout=TIMEOUT, ordering=self.ordering)
        claim_checks = LargeMessageResolver(DECODER, ClaimCheckStore([]))
        self.loop_intake = RecordIntake(state=self.loop, decoder=DECODER, large_messages=claim_checks)
        self.spark_intake = RecordIntake(state=self.spark, decoder=DECODER, large_messages=claim_checks)

    def assign(self, tp: TopicPartition, start: int) -> None:
        """Own `tp` from its committed offset (else `start`), resuming the watermark its commit carried."""
        self.owned[tp] = Owned(self.committed.get(tp, start))
        for state in (self.loop, self.spark):
            state.assign([tp])
            if tp in self.marks:
                state.resume_watermarks({tp: self.marks[tp]})

    def revoke(self, tp: TopicPartition) -> None:
        del self.owned[tp]
        self.loop.revoke([tp])
        self.spark.revoke([tp])

    def feed(self, counts: dict[TopicPartition, int], run: int, cuts: list[int], knows: str) -> None:
        """The next `counts` records of each partition, to both: (a) in runs of `run` records per partition
        in turn, as a poll returns them, (b) a partition's range in segments (cut at `cuts`, as a task
        yields one per so many records), fed as the engine feeds them. `knows`: the schemas the tasks know,
        "recorded" (what the engine recorded before the batch, shared by the batch's tasks as a Python
        worker's are), "own" (as recorded, a copy per task) or "none" (no batch recorded yet)."""
        ranges = {}
        for tp, count in counts.items():
            part = self.owned.get(tp)
            if part is None:
                continue
            end = min(part.cursor + count, len(self.logs[tp]))
            if end > part.cursor:
                ranges[tp] = (part.cursor, end)
                part.cursor = end
        if not ranges:
            return
        # (a) the loop engine: a poll's records decoded on the driver, partitions interleaved in runs
        turns = {tp: self.logs[tp][start:end] for tp, (start, end) in ranges.items()}
        polled: list[SourceRecord] = []
        while any(turns.values()):
            for records in turns.values():
                polled += records[:run]
                del records[:run]
        self.loop_intake.take(self.loop_intake.decode(polled))
        # (b) the Spark engine: tasks' segments through the wire form, their untyped records, then the blocks
        snapshot = self.spark.schemas.snapshot()
        shared = SchemaCache.restore(snapshot)
        segments = []
        for (topic, partition), (start, end) in ranges.items():
            schemas = {"recorded": shared, "own": SchemaCache.restore(snapshot), "none": SchemaCache()}[knows]
            inner = sorted({start + cut % (end - start) for cut in cuts} - {start})
            for low, high in zip([start, *inner], [*inner, end], strict=True):
                records = self.logs[topic, partition][low:high]
                segment = encode_range(topic, partition, low, high, records, schemas, DECODER, POLICY)
                segments.append(Segment.from_row(segment.to_row()))
        decoded = (record for segment in segments for record in segment.decoded(DECODER))
        self.spark_intake.take(self.spark_intake.decoded_elsewhere(decoded))
        blocks = [block for segment in segments for block in segment.blocks()]
        self.spark.process_blocks(blocks)
        self.blocks_fed += len(blocks)
        self.rows_typed_elsewhere += sum(len(block.offsets) for block in blocks)

    def resolve(self) -> None:
        loop = normalised(self.loop.resolve(), self.codecs)
        spark = normalised(self.spark.resolve(), self.codecs)
        assert spark.shape() == loop.shape()
        self.resolves += 1
        number = self.resolves
        if loop.dead_units:
            self.in_flight[number, "dead"] = (loop.dead_units, spark.dead_units)
        for unit_a, unit_b in zip(loop.ddl_units, spark.ddl_units, strict=True):
            self.in_flight[number, "ddl", ddl_identity(unit_a.ddl)] = ([unit_a], [unit_b])
        for index, (section_a, section_b) in enumerate(zip(loop.sections, spark.sections, strict=True)):
            for name, units in section_a.units.items():
                self.in_flight[number, index, name] = (units, section_b.units[name])
                self.rows_released += len(section_a.tables[name])

    def confirm(self, picks: list[int]) -> None:
        """Confirm the in-flight units at `picks` (indexes into them, modulo their count), in that order."""
        keys = list(self.in_flight)
        for pick in picks:
            if not keys:
                return
            key = keys.pop(pick % len(keys))
            loop, spark = self.in_flight.pop(key)
            for unit in loop:
                self.loop.confirm(unit)
            for unit in spark:
                self.spark.confirm(unit)

    def check(self) -> None:
        """Both agree; what they may commit is committed, with the watermarks the commits carry."""
        loop, spark = observed(self.loop), observed(self.spark)
        assert spark == loop
        offsets = loop[0]
        marks = self.loop.commit_watermarks(offsets)
        assert self.spark.commit_watermarks(offsets) == marks
        self.committed.update(offsets)
        self.marks.update(marks)

    def drain(self) -> None:
        """Every owned partition read to its end (the workloads end with BOOTSTRAPs and a WATERMARK),
        resolved and confirmed, with time for rows whose schema never came to expire."""
        self.feed({tp: len(log) for tp, log in self.logs.items()}, 4, [], "recorded")
        self.check()
        for _ in range(3):
            self.resolve()
            self.confirm(list(range(len(self.in_flight))))
            self.check()
            self.clock.now += TIMEOUT
        loop = self.loop.stats()
        assert (loop.held_rows, loop.waiting_rows, loop.in_flight_units, loop.queued_ddls) == (0, 0, 0, 0)
        assert self.spark.stats().in_flight_units == 0
        for tp, part in self.owned.items():
            assert self.loop.partition_states()[tp].drained
            assert self.committed.get(tp, part.cursor) == len(self.logs[tp])


# -- the generated runs ---------------------------------------------------------------------------------
@st.composite
def workload_configs(draw: st.DrawFn, topic: int) -> WorkloadConfig:
    seed = draw(st.integers(0, 2**16))
    return WorkloadConfig(
        database=("shop", "mall")[topic],
        tables=draw(st.integers(2, 3)),
        rows=draw(st.integers(24, 70)),
        partitions=draw(st.integers(1, 3)),
        seed=seed,
        dispatch=draw(st.sampled_from(["table", "primary-key"])),
        bootstrap_every_rows=draw(st.integers(6, 30)),
        bootstrap_to_all_partitions=draw(st.booleans()),
        watermark_every_txns=draw(st.integers(2, 8)),
        start_physical_ms=START_MS + seed % 7,  # the topics' clocks differ a little: their TSOs interleave
    )


@st.composite
def twins(draw: st.DrawFn) -> Twins:
    topics = draw(st.integers(1, 2))
    configs = [draw(workload_configs(topic)) for topic in range(topics)]
    partitions = [
        (TOPICS[topic], p) for topic, config in enumerate(configs) for p in range(config.partitions)
    ]
    garbage = {tp: draw(st.lists(st.integers(0, 200), max_size=2)) for tp in partitions}
    tight = draw(st.booleans())
    logs = _logs(configs, garbage, tight)
    # from the start or mid-stream, but before the closing WATERMARK: a partition that reads none holds
    # every other one back (a consumer gets its watermark from the sinks then: `seed_watermarks`)
    starts = {tp: draw(st.one_of(st.just(0), st.integers(0, len(log) - 1))) for tp, log in logs.items()}
    ordering = draw(st.sampled_from(["watermark", "arrival"]))
    run = Twins(
        logs,
        described=f"{configs}, garbage={garbage}, tight={tight}, starts={starts}, {ordering}",
        ordering=ordering,
    )
    for tp, start in starts.items():
        run.assign(tp, start)
    return run


Step = tuple[str, Any]
steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("feed"),
            st.tuples(
                st.lists(st.integers(0, 24), min_size=6, max_size=6),
                st.integers(1, 6),
                st.lists(st.integers(0, 24), max_size=2),
                st.sampled_from(["recorded", "own", "none"]),
            ),
        ),
        st.tuples(st.just("resolve"), st.none()),
        st.tuples(st.just("confirm"), st.lists(st.integers(0, 50), max_size=6)),
        st.tuples(st.just("revoke"), st.integers(0, 5)),
        st.tuples(st.just("assign"), st.integers(0, 5)),
        st.tuples(st.just("tick"), st.sampled_from([10.0, TIMEOUT])),
    ),
    max_size=24,
)


def _step(run: Twins, action: str, argument: Any) -> None:
    tps = sorted(run.logs)
    if action == "feed":
        counts, poll_run, cuts, knows = argument
        run.feed(dict(zip(tps, counts, strict=False)), poll_run, cuts, knows)
    elif action == "resolve":
        run.resolve()
    elif action == "confirm":
        run.confirm(argument)
    elif action == "revoke":
        tp = tps[argument % len(tps)]
        if tp in run.owned and len(run.owned) > 1:
            run.revoke(tp)
    elif action == "assign":
        tp = tps[argument % len(tps)]
        if tp not in run.owned:
            run.assign(tp, 0)
    else:
        run.clock.now += argument


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(twins(), steps)
def test_blocks_and_records_fed_one_by_one_give_the_same_units_offsets_and_waits(
    run: Twins, plan: list[Step]
) -> None:
    for action, argument in plan:
        _step(run, action, argument)
        run.check()
    run.drain()
    event(f"rows typed elsewhere: {'some' if run.rows_typed_elsewhere else 'none'}")
    event(f"rows released: {'some' if run.rows_released else 'none'}")
