"""Model-based test of `ConsumerState`: random TiCDC-shaped streams, random consumer behaviour.

A simulated TiCDC writes to two topics with the same partition numbers and keeps the producer's
guarantees (spec §9): a table's rows in commit_ts order on each partition, a BOOTSTRAP before a table's
first row (to every partition on topic "a", to partition 0 only on topic "b"), DDL copies on every
partition of the topic after the table's earlier rows, and a watermark W on every partition only after
every row <= W. The consumer side assigns (from the start or mid-stream), revokes, delivers, rewinds,
feeds undecodable records, resolves, confirms out of order, commits and lets the clock run, while the
model checks: no row emitted twice within an assignment, rows of a table in order, DDL barriers, dead
letters only for schemas never seen, never a committable offset past an unapplied record, and, at the
end, every delivered row emitted or dead-lettered.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from consumer.errors import DeadLetter, MalformedMessageError, RecordLocation
from consumer.protocol.model import (
    DDL,
    Bootstrap,
    Column,
    DataType,
    DDLType,
    DMLType,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.sources.record import TopicPartition
from consumer.state import ConsumerState, DDLUnit, RowBatch, Unit
from consumer.state.resolver import DDLIdentity, ddl_identity
from consumer.state.units import SchemaKey

TOPICS = ("a", "b")
PARTITIONS = 3
ALL_TPS = [(t, p) for t in TOPICS for p in range(PARTITIONS)]
BOOTSTRAP_TO_ALL = {"a": True, "b": False}
DEFAULT_TOPIC = "a"  # where schema-less DDLs (CREATE DATABASE) go
TIMEOUT = 240.0
TABLE_DDLS = [
    DDLType.ALTER,
    DDLType.CINDEX,
    DDLType.DINDEX,
    DDLType.RENAME,
    DDLType.TRUNCATE,
    DDLType.ERASE,
    DDLType.CREATE,
]

Record = tuple[str, object]  # (kind, message); kind in dml, ddl, bootstrap, watermark, bad


@dataclass
class Table:
    topic: str
    name: str
    table_id: int
    version: int
    partitions: tuple[int, ...]
    alive: bool = True
    bootstrapped: bool = False

    def schema(self) -> TableSchema:
        column = Column(name=f"c{self.version}", data_type=DataType(mysql_type="int"))
        return TableSchema(
            database="db", table=self.name, table_id=self.table_id, version=self.version, columns=(column,)
        )


@dataclass
class EmittedDDL:
    commit_ts: int
    names: set[tuple[str, str]]
    table_ids: set[int]
    everything: bool
    epochs: dict[TopicPartition, int]  # assignment epochs when it went out
    seq: int

    def covers(self, dml: RawDML) -> bool:
        return self.everything or (dml.database, dml.table) in self.names or dml.table_id in self.table_ids


def scope(ddl: DDL, epochs: dict[TopicPartition, int], seq: int) -> EmittedDDL:
    schemas = [s for s in (ddl.table_schema, ddl.pre_table_schema) if s is not None]
    return EmittedDDL(
        ddl.commit_ts,
        {(s.database, s.table) for s in schemas},
        {s.table_id for s in schemas},
        not schemas,
        dict(epochs),
        seq,
    )


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class PartitionModel:
    epoch: int
    start: int  # first offset of this assignment
    cursor: int
    high: int  # one past the highest offset delivered in this assignment
    assigned_seq: int  # emission sequence number when assigned
    emitted: set[int] = field(default_factory=set)


class ConsumerStateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.state = ConsumerState(clock=self.clock, pending_timeout=TIMEOUT)
        self.logs: dict[TopicPartition, list[Record]] = {tp: [] for tp in ALL_TPS}
        self.ts = 100
        self.next_table_id = 1
        self.tables = [
            self._table("a", "t1", (0,)),
            self._table("a", "t2", (1,)),
            self._table("a", "t3", (0, 2)),  # a multi-partition dispatcher (index-value)
            self._table("b", "u1", (0,)),
            self._table("b", "u2", (1, 2)),
        ]
        self.db_count = 0
        # consumer-side model
        self.owned: dict[TopicPartition, PartitionModel] = {}
        self.epochs: dict[TopicPartition, int] = dict.fromkeys(ALL_TPS, 0)
        self.committed: dict[TopicPartition, int] = {}
        self.seq = 0
        self.outstanding: set[tuple[TopicPartition, int]] = set()  # delivered rows not emitted yet
        self.bad_outstanding: set[tuple[TopicPartition, int]] = set()
        self.confirmed: set[tuple[TopicPartition, int]] = set()
        self.confirmed_ddls: set[DDLIdentity] = set()
        self.emitted_ddls: dict[DDLIdentity, EmittedDDL] = {}
        self.ddl_copies: dict[DDLIdentity, set[TopicPartition]] = {}  # delivered, this assignment
        self.ddl_pending_since: dict[DDLIdentity, int] = {}
        self.ddl_by_identity: dict[DDLIdentity, DDL] = {}
        self.last_ddl: EmittedDDL | None = None
        self.last_row: dict[tuple[str, str], tuple[tuple[int, str, int, int], int]] = {}
        self.known_keys: set[tuple[str, str, int]] = set()
        self.known_ids: set[tuple[int, int]] = set()
        self.columns: dict[tuple[int, int], tuple[Column, ...]] = {}
        self.in_flight: list[Unit] = []
        self.emitted_in: dict[int, dict[TopicPartition, int]] = {}  # unit id -> assignment epochs then

    def _table(self, topic: str, name: str, partitions: tuple[int, ...]) -> Table:
        self.next_table_id += 1
        return Table(topic, name, self.next_table_id, self.ts, partitions)

    # -- producer ------------------------------------------------------------------------------------
    def _append(self, tp: TopicPartition, kind: str, message: object) -> None:
        self.logs[tp].append((kind, message))

    def _broadcast(self, topic: str, kind: str, message: object) -> None:
        for p in range(PARTITIONS):
            self._append((topic, p), kind, message)

    def _bootstrap(self, table: Table) -> None:
        schema = table.schema()
        self.columns[(schema.table_id, schema.version)] = schema.columns
        message = Bootstrap(table_schema=schema, build_ts=0)
        if BOOTSTRAP_TO_ALL[table.topic]:
            self._broadcast(table.topic, "bootstrap", message)
        else:
            self._append((table.topic, 0), "bootstrap", message)
        table.bootstrapped = True

    @rule(
        writes=st.lists(
            st.tuples(st.integers(0, 4), st.integers(1, 3), st.booleans(), st.integers(0, 7)),
            min_size=1,
            max_size=6,
        )
    )
    def write_transactions(self, writes: list[tuple[int, int, bool, int]]) -> None:
        """Each write is one transaction: table, row count, primary-key change, partition choice bits."""
        for index, count, pk_change, spread in writes:
            self._write_rows(index, count, pk_change, spread)

    def _write_rows(self, index: int, count: int, pk_change: bool, spread: int) -> None:
        table = self.tables[index]
        if not table.alive:
            return
        if not table.bootstrapped:
            self._bootstrap(table)
        self.ts += 1
        kinds = [DMLType.DELETE, DMLType.INSERT] if pk_change else [DMLType.UPDATE] * count
        for i, kind in enumerate(kinds):
            # a primary-key change stays on one partition; other rows may spread (index-value dispatch)
            bit = spread & 1 if pk_change else (spread >> i) & 1
            partition = table.partitions[bit % len(table.partitions)]
            dml = RawDML(
                type=kind,
                database="db",
                table=table.name,
                table_id=table.table_id,
                commit_ts=self.ts,
                build_ts=0,
                schema_version=table.version,
                payload=b"r",
                encoding="json",
            )
            self._append((table.topic, partition), "dml", dml)

    @rule(index=st.integers(0, 4))
    def periodic_bootstrap(self, index: int) -> None:
        table = self.tables[index]
        if table.alive and table.bootstrapped:
            self._bootstrap(table)

    @rule(index=st.integers(0, 4), kind=st.sampled_from(TABLE_DDLS))
    def table_ddl(self, index: int, kind: DDLType) -> None:
        table = self.tables[index]
        if table.alive == (kind is DDLType.CREATE):
            return
        self.ts += 1
        topic = table.topic
        if kind is DDLType.ERASE:
            table.alive = False
        elif kind is DDLType.CREATE:
            table.alive, table.table_id, table.version = True, self._new_table_id(), self.ts
            table.bootstrapped = False
        elif kind is DDLType.RENAME:
            table.name += "r"
        elif kind is DDLType.TRUNCATE:
            table.table_id, table.version = self._new_table_id(), self.ts
        else:
            table.version = self.ts
        schema = table.schema()
        self.columns[(schema.table_id, schema.version)] = schema.columns
        sql = f"{kind} {table.name} at {self.ts}"
        self._broadcast(
            topic, "ddl", DDL(type=kind, sql=sql, commit_ts=self.ts, build_ts=0, table_schema=schema)
        )

    @rule()
    def create_database(self) -> None:
        self.ts += 1
        self.db_count += 1
        sql = f"CREATE DATABASE db{self.db_count}"
        self._broadcast(DEFAULT_TOPIC, "ddl", DDL(type=DDLType.QUERY, sql=sql, commit_ts=self.ts, build_ts=0))

    @rule()
    def watermark(self) -> None:
        for topic in TOPICS:
            self._broadcast(topic, "watermark", Watermark(commit_ts=self.ts, build_ts=0))

    @rule(tp=st.sampled_from(ALL_TPS))
    def corrupt_record(self, tp: TopicPartition) -> None:
        self._append(tp, "bad", b"\xff garbage")

    def _new_table_id(self) -> int:
        self.next_table_id += 1
        return self.next_table_id

    # -- consumer ------------------------------------------------------------------------------------
    @initialize(tps=st.sets(st.sampled_from(ALL_TPS), min_size=1))
    def start(self, tps: set[TopicPartition]) -> None:
        for tp in sorted(tps):
            self._assign(tp, mid_stream=False)

    @rule(tp=st.sampled_from(ALL_TPS), mid_stream=st.booleans())
    def assign(self, tp: TopicPartition, mid_stream: bool) -> None:
        if tp not in self.owned:
            self._assign(tp, mid_stream)

    def _assign(self, tp: TopicPartition, mid_stream: bool) -> None:
        if tp not in self.committed:  # never owned: from the beginning, or (offset reset latest) the end
            self.committed[tp] = len(self.logs[tp]) if mid_stream else 0
        start = self.committed[tp]
        self.epochs[tp] += 1
        self.owned[tp] = PartitionModel(self.epochs[tp], start, start, start, self.seq)
        self.state.assign([tp])

    @rule(tp=st.sampled_from(ALL_TPS))
    def revoke(self, tp: TopicPartition) -> None:
        if tp not in self.owned:
            return
        self.state.revoke([tp])
        del self.owned[tp]
        self.outstanding = {item for item in self.outstanding if item[0] != tp}
        self.bad_outstanding = {item for item in self.bad_outstanding if item[0] != tp}
        for identity, copies in self.ddl_copies.items():
            copies.discard(tp)
            if not copies:
                self.ddl_pending_since.pop(identity, None)

    @rule(tp=st.sampled_from(ALL_TPS), count=st.integers(1, 12))
    def deliver(self, tp: TopicPartition, count: int) -> None:
        part = self.owned.get(tp)
        if part is not None:
            self._deliver([(tp, part)] * count)

    @rule()
    def deliver_everything(self) -> None:
        self._deliver(self._every_remaining_record())

    def _every_remaining_record(self) -> list[tuple[TopicPartition, PartitionModel]]:
        """Turns for every owned partition's remaining records, interleaved in runs as a poll returns them."""
        left = {tp: len(self.logs[tp]) - part.cursor for tp, part in self.owned.items()}
        turns: list[tuple[TopicPartition, PartitionModel]] = []
        while any(left.values()):
            for tp, part in self.owned.items():
                run = min(5, left[tp])
                left[tp] -= run
                turns += [(tp, part)] * run
        return turns

    @rule(tp=st.sampled_from(ALL_TPS), count=st.integers(1, 6))
    def rewind(self, tp: TopicPartition, count: int) -> None:
        part = self.owned.get(tp)
        if part is not None:
            part.cursor = max(part.start, part.cursor - count)

    def _deliver(self, turns: list[tuple[TopicPartition, PartitionModel]]) -> None:
        """The next record of each turn's partition; records go to the state in batches, as a poll's do,
        split around undecodable ones."""
        batch: list[tuple[RecordLocation, object]] = []
        for tp, part in turns:
            offset = part.cursor
            if offset >= len(self.logs[tp]):
                continue
            kind, message = self.logs[tp][offset]
            location = RecordLocation(tp[0], tp[1], offset)
            if kind == "bad":
                assert isinstance(message, bytes)
                self.state.process_many(batch)  # type: ignore[arg-type]
                batch = []
                self.state.process_failed(location, MalformedMessageError("garbage"), message)
            else:
                batch.append((location, message))
            part.cursor += 1
            self._delivered(tp, part, offset, kind, message)
        self.state.process_many(batch)  # type: ignore[arg-type]

    def _same_assignment(self, location: RecordLocation, epochs: dict[TopicPartition, int]) -> bool:
        part = self.owned.get((location.topic, location.partition))
        return part is not None and epochs.get((location.topic, location.partition)) == part.epoch

    def _delivered(
        self, tp: TopicPartition, part: PartitionModel, offset: int, kind: str, message: object
    ) -> None:
        if offset < part.high:
            return  # a redelivery: the consumer must ignore it
        part.high = offset + 1
        if kind == "dml":
            self.outstanding.add((tp, offset))
        elif kind == "bad":
            self.bad_outstanding.add((tp, offset))
        elif kind in ("bootstrap", "ddl"):
            self._learn(message)  # type: ignore[arg-type]
        if kind == "ddl":
            assert isinstance(message, DDL)
            identity = ddl_identity(message)
            self.ddl_by_identity[identity] = message
            self.ddl_copies.setdefault(identity, set()).add(tp)
            if identity not in self.emitted_ddls:
                self.ddl_pending_since.setdefault(identity, self.seq)

    def _learn(self, message: Bootstrap | DDL) -> None:
        for schema in (message.table_schema, getattr(message, "pre_table_schema", None)):
            if schema is not None:
                self.known_keys.add(schema.key)
                self.known_ids.add((schema.table_id, schema.version))

    def _check_units(self, units: list[Unit]) -> None:
        for unit in units:
            self.seq += 1
            if isinstance(unit, RowBatch):
                self._check_batch(unit)
            elif isinstance(unit, DDLUnit):
                self._check_ddl(unit)
            else:
                self._check_dead_letter(unit)

    def _check_batch(self, batch: RowBatch) -> None:
        assert batch.rows
        for dml, location in batch.rows:
            tp = (location.topic, location.partition)
            self._mark_emitted(tp, location.offset)
            assert dml.schema_key == batch.schema.key
            assert batch.schema.table_id == dml.table_id
            assert batch.schema.columns == self.columns[(dml.table_id, dml.schema_version)]
            self._check_barriers(dml, tp)
            self._check_table_order(dml, location, tp)

    def _mark_emitted(self, tp: TopicPartition, offset: int) -> None:
        part = self.owned.get(tp)
        assert part is not None, "a unit of a revoked partition"
        assert offset not in part.emitted, f"{tp}@{offset} emitted twice"
        part.emitted.add(offset)
        self.outstanding.discard((tp, offset))
        self.bad_outstanding.discard((tp, offset))

    def _check_barriers(self, dml: RawDML, tp: TopicPartition, *, dead: bool = False) -> None:
        """A row (or its dead letter) never follows a later DDL of its table that went out while its partition
        was owned; a row (not a dead letter: expiry does not wait) never precedes a known earlier DDL."""
        epoch = self.owned[tp].epoch
        for emitted in self.emitted_ddls.values():
            if emitted.covers(dml) and dml.commit_ts < emitted.commit_ts:
                assert emitted.epochs.get(tp) != epoch, "a row came out after a later DDL of its table"
        if dead:
            return
        for identity in self.ddl_pending_since:
            pending = scope(self.ddl_by_identity[identity], {}, 0)
            if pending.covers(dml) and pending.commit_ts < dml.commit_ts:
                raise AssertionError("a row overtook an earlier DDL of its table")

    def _check_table_order(self, dml: RawDML, location: RecordLocation, tp: TopicPartition) -> None:
        name = (dml.database, dml.table)
        key = (dml.commit_ts, location.topic, location.partition, location.offset)
        last = self.last_row.get(name)
        if last is not None and self.owned[tp].assigned_seq < last[1]:
            assert key > last[0], f"rows of {name} out of order: {key} after {last[0]}"
        self.last_row[name] = (key, self.seq)

    def _check_ddl(self, unit: DDLUnit) -> None:
        identity = ddl_identity(unit.ddl)
        assert identity not in self.emitted_ddls, "a DDL emitted twice"
        assert unit.locations
        for location in unit.locations:
            tp = (location.topic, location.partition)
            assert tp in self.owned and location.offset < self.owned[tp].high
        since = self.ddl_pending_since.pop(identity)
        if self.last_ddl is not None and since < self.last_ddl.seq:
            assert unit.ddl.commit_ts >= self.last_ddl.commit_ts, "DDLs out of commit order"
        epochs = {tp: part.epoch for tp, part in self.owned.items()}
        self.emitted_ddls[identity] = self.last_ddl = scope(unit.ddl, epochs, self.seq)

    def _check_dead_letter(self, dead: DeadLetter) -> None:
        tp = (dead.location.topic, dead.location.partition)
        kind, message = self.logs[tp][dead.location.offset]
        if kind == "bad":
            assert dead.reason.startswith("MalformedMessageError")
        else:
            assert isinstance(message, RawDML)
            assert message.schema_key not in self.known_keys
            assert (message.table_id, message.schema_version) not in self.known_ids
            assert "never arrived" in dead.reason
            self._check_barriers(message, tp, dead=True)
        self._mark_emitted(tp, dead.location.offset)

    @rule(data=st.data())
    def confirm_some(self, data: st.DataObject) -> None:
        if not self.in_flight:
            return
        chosen = data.draw(st.sets(st.integers(0, len(self.in_flight) - 1), min_size=1))
        for index in sorted(chosen, reverse=True):
            self._confirm(self.in_flight.pop(index))

    def _confirm(self, unit: Unit) -> None:
        self.state.confirm(unit)
        if isinstance(unit, RowBatch):
            self.confirmed.update(((loc.topic, loc.partition), loc.offset) for _, loc in unit.rows)
        elif isinstance(unit, DDLUnit):
            self.confirmed_ddls.add(ddl_identity(unit.ddl))
        else:
            self.confirmed.add(((unit.location.topic, unit.location.partition), unit.location.offset))

    @rule()
    def commit(self) -> None:
        for tp, offset in self.state.committable().items():
            part = self.owned[tp]
            assert part.start <= offset <= part.high
            for position in range(part.start, offset):
                kind, message = self.logs[tp][position]
                if kind in ("dml", "bad"):
                    assert (tp, position) in self.confirmed, (
                        f"commit {tp}@{offset} passes unapplied {position}"
                    )
                elif kind == "ddl":
                    assert isinstance(message, DDL)
                    assert ddl_identity(message) in self.confirmed_ddls, f"commit {tp}@{offset} passes a DDL"
            assert offset >= self.committed[tp]
            self.committed[tp] = offset

    @rule(seconds=st.sampled_from([1.0, 30.0, TIMEOUT]))
    def tick(self, seconds: float) -> None:
        self.clock.now += seconds

    @invariant()
    def buffered_rows_match_the_model(self) -> None:
        stats = self.state.stats()
        assert stats.held_rows + stats.waiting_rows == len(self.outstanding)

    @invariant()
    def every_unapplied_row_pins_its_schema(self) -> None:
        """A schema stays in the cache (and in the snapshots sinks record) while a row of it is unapplied."""
        rows: Counter[SchemaKey] = Counter()
        for tp, offset in self.outstanding:
            rows[self.logs[tp][offset][1].schema_key] += 1  # type: ignore[union-attr]
        for unit in self.in_flight:
            if isinstance(unit, RowBatch):  # a revoke releases its rows of the partition, for good
                epochs = self.emitted_in[id(unit)]
                rows.update(raw.schema_key for raw, loc in unit.rows if self._same_assignment(loc, epochs))
        for key, count in rows.items():
            assert self.state.schemas.pins(key) == count, key

    @rule()
    def resolve(self) -> None:
        units = self.state.resolve()
        self._check_units(units)
        assert not self.bad_outstanding, "every undecodable record is dead-lettered on the next resolve"
        self.in_flight += units
        epochs = {tp: part.epoch for tp, part in self.owned.items()}
        self.emitted_in.update((id(unit), epochs) for unit in units)

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a step already failed: report that, not a drain on top of it
        self._drain()
        assert not self.outstanding, f"rows never emitted: {sorted(self.outstanding)[:5]}"
        stats = self.state.stats()
        assert (stats.held_rows, stats.waiting_rows, stats.in_flight_units) == (0, 0, 0)
        for identity, copies in self.ddl_copies.items():
            if copies:
                assert identity in self.emitted_ddls, "a delivered DDL never came out"
        self.commit()
        for tp, part in self.owned.items():
            assert self.committed[tp] == len(self.logs[tp]) or part.start == len(self.logs[tp])

    def _drain(self) -> None:
        """The producer announces every table and the checkpoint; the consumer reads and applies it all."""
        for table in self.tables:
            if table.alive:
                self._bootstrap(table)
        self.watermark()
        for part in self.owned.values():
            part.cursor = max(part.cursor, part.high)
        self._deliver(self._every_remaining_record())
        for _ in range(3):
            self.resolve()
            while self.in_flight:
                self._confirm(self.in_flight.pop())
            self.clock.now += TIMEOUT


ConsumerStateMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestConsumerStateMachine = ConsumerStateMachine.TestCase
