"""`ConsumerState`: decoded records in, ordered units out, and the offsets that are safe to commit.

A driver loop looks like::

    state.assign(partitions)                       # from the source's rebalance callback
    state.process(record.location, message)        # or process_failed(...) when decoding failed
    for unit in state.resolve():
        apply(unit)                                # rows or DDL to every sink, or a letter to dead letters
        state.confirm(unit)                        # once durable
    source.commit(state.committable())
    source.pause(state.paused())                   # and resume the rest

Delivery is at least once: offsets never move past a record whose effect is not durable, so a crash or
a rebalance redelivers it. Within one assignment of a partition, a record is emitted at most once.

Ordering: with "watermark" (the Simple protocol, and streams that carry watermarks) a row resolves once
every owned partition's watermark has passed its commit ts, so tables are consistent at the watermark. With
"arrival" (protocols without watermarks: TiCDC Avro, Debezium without the TiDB extension) a row resolves
as soon as it arrives: TiCDC writes every change of a key to one partition in commit order, so applying each
partition in offset order applies each key's changes in commit order, and a mirror is exact per key, though
no cross-table consistency point exists. In both, a row without a commit ts (0: an Avro tombstone) takes
the newest commit ts seen before it on its partition, a lower bound that keeps it after every earlier change
of its key (and is 0 when it is the first record of an assignment).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import numpy as np
from cachetools import LRUCache

from consumer.errors import (
    ClaimCheckNotAllowedError,
    ConsumerError,
    DeadLetter,
    HandleKeyOnlyError,
    RecordLocation,
    SchemaNotFoundError,
    SchemaRejectedError,
)
from consumer.protocol.model import DDL, Bootstrap, DecodedMessage, KeyOnlyDML, RawDML, TableSchema, Watermark
from consumer.sources.record import TopicPartition
from consumer.state.offsets import PartitionOffsets
from consumer.state.pending import (
    DEFAULT_BUDGET_BYTES,
    DEFAULT_TIMEOUT_S,
    PAUSE_AT,
    PendingBuffer,
    missing_schema_reason,
)
from consumer.state.resolver import Resolver
from consumer.state.schema_cache import SchemaCache
from consumer.state.units import BlockBatch, DDLUnit, RowBatch, RowBlock, SchemaKey, Unit, topic_partition
from consumer.state.watermarks import PartitionWatermarks, WatermarkTrail

ErrorPolicy = Literal["dead-letter", "fail"]
# Schema keys whose schema was rejected, remembered so their rows are set aside as they arrive.
REJECTED_SCHEMAS_REMEMBERED = 10_000
Ordering = Literal["watermark", "arrival"]
# The resolve limit in "arrival" ordering: above every TSO, so everything known goes out.
EVERYTHING = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class StateStats:
    held_rows: int  # waiting for a schema
    held_bytes: int
    held_total: int  # rows that ever waited for a schema (a mid-stream join's, until the BOOTSTRAP)
    oldest_held_age: float  # seconds; 0.0 when nothing is held
    waiting_rows: int  # schema known, waiting for the watermark or a barrier
    waiting_bytes: int
    queued_ddls: int  # DDLs waiting for the watermark to pass their commit ts (a barrier)
    in_flight_units: int  # handed out, not confirmed
    cached_schemas: int
    global_watermark: int | None
    paused_partitions: int


@dataclass(frozen=True, slots=True)
class Unapplied:
    """What one partition still holds unapplied, and why: rows and DDLs waiting for the watermark (the
    minimum over every owned partition's WATERMARK), rows waiting for a schema."""

    partition: TopicPartition
    waiting_rows: int  # schema known, waiting for the watermark
    waiting_ddls: int
    needed_watermark: int  # the highest commit_ts among them: the global watermark must reach it
    partition_watermark: int | None  # this partition's last WATERMARK, None: none yet
    held_rows: int  # waiting for a schema
    held_for: tuple[SchemaKey, ...]

    def __str__(self) -> str:
        topic, partition = self.partition
        reasons = []
        if self.waiting_rows or self.waiting_ddls:
            mark = "none yet" if self.partition_watermark is None else str(self.partition_watermark)
            what = f"{self.waiting_rows} row(s)" + (
                f" and {self.waiting_ddls} DDL(s)" if self.waiting_ddls else ""
            )
            reasons.append(
                f"{what} wait for a WATERMARK >= {self.needed_watermark} on every partition "
                f"(this one's: {mark})"
            )
        if self.held_rows:
            keys = ", ".join(f"{d}.{t} version {v}" for d, t, v in self.held_for[:3])
            more = f" and {len(self.held_for) - 3} more" if len(self.held_for) > 3 else ""
            reasons.append(f"{self.held_rows} row(s) wait for a schema ({keys}{more})")
        return f"{topic}[{partition}]: {'; '.join(reasons)}"


@dataclass(frozen=True, slots=True)
class PartitionState:
    """Where an owned partition stands: the offset to resume it from (None before its first record),
    whether every record seen on it is durably applied, and its watermark."""

    resume_offset: int | None
    drained: bool
    watermark: int | None


@dataclass(slots=True, eq=False)
class _Partition:
    offsets: PartitionOffsets
    reported: int | None = None  # last offset `committable` returned
    newest_ts: int = 0  # newest commit ts seen on this assignment: the floor of a row without one
    trail: WatermarkTrail = field(default_factory=WatermarkTrail)  # the watermarks its commits carry


class ConsumerState:
    """The consumer state machine over every partition this consumer owns.

    `budget_bytes` bounds, separately, rows waiting for a schema and rows waiting for the watermark;
    reaching it pauses partitions (see `paused`), it never drops a row. `policy` decides what happens to
    undecodable records and to rows whose schema does not arrive within `pending_timeout` seconds:
    "dead-letter" hands them out as `DeadLetter` units, "fail" raises. `ordering`: see the module docstring.
    `described`: the schema a row's own record described (protocols whose records carry their schema, e.g.
    `ConfluentAvroDecoder.described_schema`), consulted when the cache lacks a row's version.
    """

    def __init__(
        self,
        *,
        policy: ErrorPolicy = "dead-letter",
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        pending_timeout: float = DEFAULT_TIMEOUT_S,
        schemas: SchemaCache | None = None,
        clock: Callable[[], float] = time.monotonic,
        ordering: Ordering = "watermark",
        described: Callable[[SchemaKey], TableSchema | None] | None = None,
    ) -> None:
        self.policy = policy
        self.ordering = ordering
        self._described = described
        self.budget_bytes = budget_bytes
        self.schemas = schemas if schemas is not None else SchemaCache()
        self._pending = PendingBuffer(budget_bytes=budget_bytes, timeout=pending_timeout, clock=clock)
        self._resolver = Resolver(self._pending)
        self._watermarks = PartitionWatermarks()
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._failed: list[DeadLetter] = []
        self._rejected: LRUCache[SchemaKey, str] = LRUCache(REJECTED_SCHEMAS_REMEMBERED)  # key -> reason
        # Units handed out and not confirmed: the offsets each one applies, per partition. Revoking a
        # partition removes its entry, so a late confirm cannot touch a later assignment of it.
        self._claims: dict[Unit, dict[TopicPartition, list[int]]] = {}

    # -- assignment --------------------------------------------------------------------------------
    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Start owning `partitions`, from scratch: the first record seen on each is a mid-stream join."""
        for tp in partitions:
            if tp not in self._partitions:
                self._partitions[tp] = _Partition(PartitionOffsets())
                self._watermarks.assign(tp)

    def revoke(self, partitions: Iterable[TopicPartition]) -> None:
        """Stop owning `partitions` and forget their unapplied records: Kafka redelivers them to the next
        owner from the committed offset. Units already handed out stay valid for other partitions."""
        for tp in partitions:
            if self._partitions.pop(tp, None) is None:
                continue
            self._watermarks.revoke(tp)
            for row in self._pending.drop_partition(tp):
                self.schemas.unpin(row.dml.schema_key)
            for key, count in self._resolver.revoke(tp):
                self.schemas.unpin(key, count)
            for unit, claim in self._claims.items():
                offsets = claim.pop(tp, None)
                if offsets and isinstance(unit, RowBatch | BlockBatch):
                    self.schemas.unpin(unit.schema.key, len(offsets))
            self._failed = [dead for dead in self._failed if topic_partition(dead.location) != tp]

    # -- input ---------------------------------------------------------------------------------------
    def process(self, location: RecordLocation, message: DecodedMessage) -> None:
        """Take one decoded record; records already seen on this assignment are ignored."""
        self.process_many(((location, message),))

    def process_many(self, records: Iterable[tuple[RecordLocation, DecodedMessage]]) -> None:
        """Take decoded records in arrival order, as `process` takes each.

        A poll's rows mostly share a few schema versions: their pins are counted up and their schemas
        looked up once, and both are settled before any other message (which may add or evict schemas).
        """
        partitions = self._partitions
        add_row = self._resolver.add_row
        pins: dict[SchemaKey, int] = {}
        known: dict[SchemaKey, TableSchema] = {}
        for location, message in records:
            partition = partitions.get((location.topic, location.partition))
            if partition is None:
                raise ValueError(f"{location}: partition is not assigned to this consumer")
            offsets = partition.offsets
            if not offsets.admit(location.offset):
                continue
            if not isinstance(message, RawDML):
                self._settle_pins(pins)
                known.clear()
                self._take(location, message, partition)
                continue
            offsets.hold(location.offset)
            if message.commit_ts > partition.newest_ts:
                partition.newest_ts = message.commit_ts
            elif not message.commit_ts and partition.newest_ts:
                message = msgspec.structs.replace(message, commit_ts=partition.newest_ts)
            key = (message.database, message.table, message.schema_version)
            schema = known.get(key)
            if schema is not None:
                pins[key] += 1
                add_row(message, location, schema)
                continue
            # pinned first: a row waiting for its schema keeps it from being evicted once it arrives
            self.schemas.pin(key)
            schema = self.schemas.lookup(key, message.table_id) or self._self_described(key)
            if schema is None:
                rejected = self._rejected.get(key) if self._rejected else None
                if rejected is None:
                    self._pending.hold(message, location)
                else:  # its schema will never decode it: set aside now, never held
                    self.schemas.unpin(key)
                    self._failed.append(
                        DeadLetter(location, rejected, message.payload, SchemaRejectedError.code)
                    )
                continue
            known[key] = schema
            pins[key] = 0
            add_row(message, location, schema)
        self._settle_pins(pins)

    def process_blocks(self, blocks: Iterable[RowBlock]) -> None:
        """Take rows typed elsewhere, a block per partition and schema version, after the records of the
        same feed (`process_many`: their BOOTSTRAPs and DDLs describe the blocks' versions). Each block is
        fed once: they are not checked for redelivery. A version known neither here nor by the block
        (`typed_by`) is a fault of the caller's."""
        held: dict[TopicPartition, list[np.ndarray]] = {}
        for block in blocks:
            partition = self._partitions.get(block.tp)
            if partition is None:
                raise ValueError(f"{block.tp}: partition is not assigned to this consumer")
            schema = self.schemas.lookup(block.key, block.table_id)
            if schema is None and block.typed_by is not None:
                self._learn(block.typed_by)
                schema = self.schemas.lookup(block.key, block.table_id)
            if schema is None:
                database, table, version = block.key
                raise ValueError(f"rows of {database}.{table} version {version}: a schema unknown here")
            self.schemas.pin(block.key, len(block.offsets))
            held.setdefault(block.tp, []).append(block.offsets)
            partition.newest_ts = max(partition.newest_ts, int(block.commit_ts.max()))
            self._resolver.add_block(block, schema)
        for tp, offsets in held.items():  # a partition's blocks interleave: held as one ascending run
            self._partitions[tp].offsets.hold_many(np.sort(np.concatenate(offsets)).tolist())

    def _settle_pins(self, pins: dict[SchemaKey, int]) -> None:
        for key, count in pins.items():
            if count:
                self.schemas.pin(key, count)
        pins.clear()

    def _take(self, location: RecordLocation, message: DecodedMessage, partition: _Partition) -> None:
        """A record other than a DML (rare: one per many rows)."""
        if isinstance(message, Watermark):
            self._watermarks.advance(topic_partition(location), message.commit_ts)
            partition.trail.read(location.offset, message.commit_ts)
        elif isinstance(message, Bootstrap):
            self._learn(message.table_schema)
        elif isinstance(message, DDL):
            self._learn(message.table_schema)
            self._learn(message.pre_table_schema)
            self._add_ddl(message, location, partition.offsets)
        elif isinstance(message, KeyOnlyDML):  # a large-message resolver makes these whole before here
            self._fail(location, partition.offsets, _unresolved(message), message.row.payload)
        else:
            raise TypeError(f"{location}: not a decoded message: {type(message).__name__}")

    def _self_described(self, key: SchemaKey) -> TableSchema | None:
        schema = self._described(key) if self._described is not None else None
        if schema is not None:
            self._learn(schema)
        return schema

    def learn_schemas(self, schemas: Iterable[TableSchema]) -> None:
        """Schemas known from outside the stream, such as a sink's recorded snapshot written by whichever
        group member owned a partition before: rows held for them are released like on a BOOTSTRAP."""
        for schema in schemas:
            self._learn(schema)

    def process_failed(
        self, location: RecordLocation, error: ConsumerError, value: bytes | None, *, key: bytes | None = None
    ) -> None:
        """Take a record that failed to decode: a `DeadLetter` (keeping its `key` and `value`), or `error`
        raised under policy "fail".

        A `SchemaRejectedError` also marks its schema keys rejected: rows held for them, and rows of them
        arriving later, are set aside rather than waiting for a schema that cannot decode them.
        """
        offsets = self._owned(topic_partition(location), location).offsets
        if offsets.admit(location.offset):
            if isinstance(error, SchemaRejectedError):
                self._reject(error)
            self._fail(location, offsets, error, value, key)

    def _fail(
        self,
        location: RecordLocation,
        offsets: PartitionOffsets,
        error: ConsumerError,
        value: bytes | None,
        key: bytes | None = None,
    ) -> None:
        if self.policy == "fail":
            raise error.with_location(location)
        offsets.hold(location.offset)
        self._failed.append(
            DeadLetter(location, f"{type(error).__name__}: {error.reason}", value, error.code, key)
        )

    def _reject(self, error: SchemaRejectedError) -> None:
        for key in error.keys:
            if key in self.schemas:  # a valid copy of that version is known: its rows decode with it
                continue
            database, table, version = key
            reason = f"schema ({database}.{table}, version {version}) was rejected: {error.reason}"
            self._rejected[key] = reason
            for row in self._pending.take(key):
                self.schemas.unpin(key)
                self._failed.append(DeadLetter(row.location, reason, row.dml.payload, error.code))

    # -- output --------------------------------------------------------------------------------------
    def resolve(self) -> list[Unit]:
        """Every unit ready now, in the order a sink must apply them (dead letters first, unordered)."""
        units: list[Unit] = [*self._expire(), *self._failed]
        self._failed = []
        limit = EVERYTHING if self.ordering == "arrival" else self._watermarks.global_watermark()
        units += self._resolver.resolve(limit)
        for unit in units:
            self._claims[unit] = _claim(unit)
        return units

    def confirm(self, unit: Unit) -> None:
        """The sink durably applied `unit`: its records may be committed. Confirming twice is harmless."""
        claim = self._claims.pop(unit, None)
        if claim is None:
            return
        if isinstance(unit, DDLUnit):
            self._resolver.confirm_ddl(unit)
        for tp, offsets in claim.items():
            if isinstance(unit, RowBatch | BlockBatch):
                self.schemas.unpin(unit.schema.key, len(offsets))
            partition = self._partitions.get(tp)
            if partition is not None:
                partition.offsets.apply(offsets)

    def committable(self, ceiling: Mapping[TopicPartition, int] | None = None) -> dict[TopicPartition, int]:
        """Per owned partition, the offset to commit (the lowest record not durably applied), when it moved
        since the previous call. Commits are cumulative, so a caller that misses one loses nothing.
        With a `ceiling`, only its partitions, and no further than it says."""
        result: dict[TopicPartition, int] = {}
        for tp, partition in self._partitions.items():
            offset = partition.offsets.committable()
            if ceiling is not None and offset is not None:
                offset = _below(offset, ceiling.get(tp), partition.reported)
            if offset is not None and offset != partition.reported:
                result[tp] = partition.reported = offset
        return result

    def commit_watermarks(self, offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
        """Per partition of `offsets` (from `committable`), the watermark its commit carries, where one is
        known: the newest read below the offset, which holds for whoever reads the partition from there."""
        marks: dict[TopicPartition, int] = {}
        for tp, offset in offsets.items():
            partition = self._partitions.get(tp)
            mark = partition.trail.below(offset) if partition is not None else None
            if mark is not None:
                marks[tp] = mark
        return marks

    def unapplied_offsets(self) -> dict[TopicPartition, list[int]]:
        """Per owned partition, the offsets of records taken and not durably applied (rows held or waiting,
        DDL copies, records set aside but not yet written), in order."""
        return {tp: partition.offsets.unapplied() for tp, partition in self._partitions.items()}

    def commit_failed(self, offsets: dict[TopicPartition, int]) -> None:
        """A commit of `offsets` (from `committable`) did not go through: offer them again next time, so a
        partition that stays quiet afterwards still gets its offset committed."""
        for tp, offset in offsets.items():
            partition = self._partitions.get(tp)
            if partition is not None and partition.reported == offset:
                partition.reported = None

    def partition_states(self) -> dict[TopicPartition, PartitionState]:
        return {
            tp: PartitionState(p.offsets.committable(), p.offsets.drained(), self._watermarks.of(tp))
            for tp, p in self._partitions.items()
        }

    def seed_watermarks(self, marks: Mapping[TopicPartition, int]) -> None:
        """Watermarks known from outside the stream for owned partitions: a sink's record that every change
        of the partition up to them is applied. A partition resumed at its end has no WATERMARK left to
        read, and would otherwise hold every other partition back until TiCDC's next one."""
        for tp, commit_ts in marks.items():
            if tp in self._partitions:
                self._watermarks.advance(tp, commit_ts)

    def resume_watermarks(self, marks: Mapping[TopicPartition, int]) -> None:
        """Watermarks the positions owned partitions were assigned at carried (`commit_watermarks` of an
        earlier commit): seeded, and carried on by their next commits, so a partition resumed at its end
        keeps resolving the others for whoever owns it next."""
        self.seed_watermarks(marks)
        for tp, commit_ts in marks.items():
            partition = self._partitions.get(tp)
            if partition is not None:
                partition.trail.carry(commit_ts)

    def paused(self) -> set[TopicPartition]:
        """Partitions the source should pause now (and resume every other one).

        Rows waiting for a schema near the budget pause the partitions holding them; rows waiting for the
        watermark near the budget pause the partitions ahead of the global watermark, so the lagging ones
        catch up. A schema that can only arrive on a paused partition then comes after the pending
        timeout has expired the rows holding it up: the budget is a safety valve, size it for a BOOTSTRAP
        interval of traffic.
        """
        paused = self._pending.paused()
        if self._resolver.bytes >= PAUSE_AT * self.budget_bytes:
            paused |= self._watermarks.ahead()
        return paused

    def unapplied(self) -> list[Unapplied]:
        """Per owned partition holding any, the records not applied yet and what they wait for."""
        waiting = self._resolver.waiting_by_partition()
        held = self._pending.by_partition()
        report = []
        for tp in sorted(waiting.keys() | held.keys()):
            rows, highest, ddls = waiting.get(tp, (0, 0, 0))
            held_rows, keys = held.get(tp, (0, set()))
            report.append(
                Unapplied(tp, rows, ddls, highest, self._watermarks.of(tp), held_rows, tuple(sorted(keys)))
            )
        return report

    def stats(self) -> StateStats:
        return StateStats(
            held_rows=self._pending.rows,
            held_bytes=self._pending.bytes,
            held_total=self._pending.held_total,
            oldest_held_age=self._pending.oldest_age(),
            waiting_rows=self._resolver.rows,
            waiting_bytes=self._resolver.bytes,
            queued_ddls=self._resolver.queued_ddls,
            in_flight_units=len(self._claims),
            cached_schemas=len(self.schemas),
            global_watermark=self._watermarks.global_watermark(),
            paused_partitions=len(self.paused()),
        )

    # -- internals -----------------------------------------------------------------------------------
    def _owned(self, tp: TopicPartition, location: RecordLocation) -> _Partition:
        partition = self._partitions.get(tp)
        if partition is None:
            raise ValueError(f"{location}: partition is not assigned to this consumer")
        return partition

    def _learn(self, schema: TableSchema | None) -> None:
        if schema is None or not self.schemas.add(schema):
            return
        self._rejected.pop(schema.key, None)  # a valid copy after a corrupt one
        for row in self._pending.release(schema):
            self._resolver.add_row(row.dml, row.location, self.schemas.alias(schema, row.dml.schema_key))

    def _add_ddl(self, ddl: DDL, location: RecordLocation, offsets: PartitionOffsets) -> None:
        if self._resolver.ddl_done(ddl):
            return  # a late copy of a DDL already applied
        offsets.hold(location.offset)
        unit = self._resolver.add_ddl(ddl, location)
        if unit is not None:
            self._claims[unit].setdefault(topic_partition(location), []).append(location.offset)

    def _expire(self) -> list[DeadLetter]:
        overdue = self._pending.overdue()
        if overdue is None:
            return []
        if self.policy == "fail":
            raise SchemaNotFoundError(missing_schema_reason(overdue.dml), location=overdue.location)
        expired = self._pending.expire()
        for row in expired:
            self.schemas.unpin(row.dml.schema_key)
        return [
            DeadLetter(
                row.location, missing_schema_reason(row.dml), row.dml.payload, SchemaNotFoundError.code
            )
            for row in expired
        ]


def _unresolved(message: KeyOnlyDML) -> ConsumerError:
    """Why a key-only DML that reached the state machine is not applied: nothing made it whole."""
    if message.claim_check_location:
        return ClaimCheckNotAllowedError(
            f"claim-check location not allowed: {message.claim_check_location!r} (no claim-check storage "
            "is configured)"
        )
    return HandleKeyOnlyError("handle-key-only row needs an upstream lookup")


def _claim(unit: Unit) -> dict[TopicPartition, list[int]]:
    """The offsets a unit applies, per partition."""
    if isinstance(unit, RowBatch):
        return unit.origins.claim()
    if isinstance(unit, BlockBatch):
        return unit.claim()
    claim: dict[TopicPartition, list[int]] = {}
    for location in unit.locations if isinstance(unit, DDLUnit) else (unit.location,):
        claim.setdefault((location.topic, location.partition), []).append(location.offset)
    return claim


def _below(offset: int, limit: int | None, reported: int | None) -> int | None:
    """`offset` held to `limit`, or None where that would not move past the offset last reported (a
    ceiling never takes a commit back)."""
    if limit is None:
        return None
    offset = min(offset, limit)
    return offset if reported is None or offset > reported else None
