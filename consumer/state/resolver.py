"""Orders decodable rows and DDLs into units.

Emission rule:

- A row goes out once the global watermark has reached its commit_ts: by then every owned partition has
  delivered every row at or below it, so a table's rows can be merged across partitions in
  (commit_ts, topic, partition, offset) order. Rows are never dropped for being below the watermark.
- A row also waits while an earlier-or-equal commit_ts row of its table is still held for a schema
  (a per-table barrier until that row is released or expires), so held rows are never overtaken.
- A table's rows of one partition go out in offset order: a row waits while a row of its table that
  came before it on its partition still waits (TiCDC re-sent it at a later offset, with an older commit
  ts; or the rows of two partitions of a partitioned table interleave). Sinks record how far they hold a
  partition by offset, so a row that went out ahead of an earlier one would make the earlier one look
  applied. Such rows then go out together, in commit-ts order.
- A DDL goes out once the global watermark has reached its commit_ts (TiCDC writes a DDL to every
  partition before any checkpoint at or past it, so by then every owned copy has arrived) and no row of a
  table it touches with commit_ts <= its own is still held. DDLs go out in (commit_ts, arrival) order.
  Every row of a table it touches with commit_ts <= the DDL's goes out before it and every later row
  after it; a DDL without a table schema (CREATE/DROP DATABASE, ...) touches every table. Waiting for the
  watermark rather than for "a copy on every partition" costs at most one watermark interval (~1 s) and
  keeps each row batch within the watermark.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter

import numpy as np
from cachetools import LRUCache

from consumer.errors import RecordLocation
from consumer.protocol.model import DDL, DDLType, RawDML, TableSchema
from consumer.sources.record import TopicPartition
from consumer.state.pending import PendingBuffer, row_size
from consumer.state.units import (
    BlockBatch,
    DDLUnit,
    RowBatch,
    RowBlock,
    RowOrigins,
    SchemaKey,
    TableName,
    Unit,
    topic_partition,
)

# Confirmed DDLs remembered so a copy redelivered later (a partition re-read after a rebalance, or
# TiCDC resending after a restart) is recognised as applied instead of running the DDL twice.
DONE_DDLS_REMEMBERED = 4096

# commit_ts, topic, partition, offset, row, location, schema, its `row_size`: sorts in emission order, and
# the first four fields are unique, so tuple comparison never reaches the objects.
_Entry = tuple[int, str, int, int, RawDML, RecordLocation, TableSchema, int]
_commit_ts = itemgetter(0)
_size = itemgetter(7)
DDLIdentity = tuple[int, DDLType, str, SchemaKey | None]
SortKey = tuple[int, str, int, int]  # commit_ts, topic, partition, offset: a row's place in emission order


def ddl_identity(ddl: DDL) -> DDLIdentity:
    schema = ddl.table_schema
    return (ddl.commit_ts, ddl.type, ddl.sql, schema.key if schema is not None else None)


@dataclass(frozen=True, slots=True)
class TableScope:
    """The tables a DDL is a barrier for: by name (RENAME: the new one) or by table id (RENAME: rows under
    the old name share it); a DDL without any table schema is a barrier for every table."""

    names: frozenset[TableName]
    table_ids: frozenset[int]
    everything: bool

    @classmethod
    def of(cls, ddl: DDL) -> TableScope:
        schemas = [s for s in (ddl.table_schema, ddl.pre_table_schema) if s is not None]
        return cls(
            names=frozenset((s.database, s.table) for s in schemas),
            table_ids=frozenset(s.table_id for s in schemas),
            everything=not schemas,
        )

    def covers(self, table: TableName, table_ids: set[int]) -> bool:
        return self.everything or table in self.names or not self.table_ids.isdisjoint(table_ids)


@dataclass(slots=True, eq=False)
class _TableRows:
    entries: list[_Entry]
    table_ids: set[int]
    ordered: bool = True  # entries sorted; appends from one partition usually keep them so
    unsure: bool = False  # entries were appended out of order since it was last empty: check each take
    blocks: list[tuple[RowBlock, TableSchema]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.entries or self.blocks)

    def take(self, limit: int) -> tuple[list[_Entry], list[tuple[RowBlock, TableSchema]]]:
        """Remove and return the rows with commit_ts <= limit, each partition's up to its first row that
        stays (`_first_kept`): the entries in emission order, and the blocks' (a block splits where it
        straddles)."""
        entries = self._take_entries(limit)
        if not self.blocks and not self.unsure:
            return entries, []
        belows = [block.commit_ts <= limit for block, _ in self.blocks]
        stays = _first_kept(
            [
                *(((e[1], e[2]), e[3]) for e in (self.entries if self.unsure else ())),
                *(
                    (block.tp, int(block.offsets[~below].min()))
                    for (block, _), below in zip(self.blocks, belows, strict=True)
                    if not below.all()
                ),
            ]
        )
        entries = self._held_back(entries, stays)
        self.unsure = self.unsure and bool(self.entries)
        return entries, self._take_blocks(belows, stays)

    def _take_entries(self, limit: int) -> list[_Entry]:
        entries = self.entries
        if not entries:
            return []
        if not self.ordered:
            entries.sort()
            self.ordered, self.unsure = True, True
        if entries[-1][0] <= limit:
            self.entries = []
            return entries
        cut = bisect_right(entries, limit, key=_commit_ts)
        taken = entries[:cut]
        del entries[:cut]
        return taken

    def _held_back(self, taken: list[_Entry], stays: dict[TopicPartition, int]) -> list[_Entry]:
        """`taken` but the entries after a row of their partition that stays: those go back."""
        if not stays:
            return taken
        late = [e for e in taken if e[3] > stays.get((e[1], e[2]), e[3])]
        if late:
            taken = [e for e in taken if e[3] <= stays.get((e[1], e[2]), e[3])]
            self.entries[:0] = late  # still sorted: every entry kept is later than every one taken
        return taken

    def _take_blocks(
        self, belows: list[np.ndarray], stays: dict[TopicPartition, int]
    ) -> list[tuple[RowBlock, TableSchema]]:
        taken: list[tuple[RowBlock, TableSchema]] = []
        kept: list[tuple[RowBlock, TableSchema]] = []
        for (block, schema), below in zip(self.blocks, belows, strict=True):
            first = stays.get(block.tp)
            if first is not None:
                below = below & (block.offsets < first)
            if below.all():
                taken.append((block, schema))
            elif below.any():
                taken.append((block.select(below), schema))
                kept.append((block.select(~below), schema))
            else:
                kept.append((block, schema))
        self.blocks = kept
        return taken


def _first_kept(kept: Iterable[tuple[TopicPartition, int]]) -> dict[TopicPartition, int]:
    """Per partition, the lowest offset among rows that stay: its rows after it stay too."""
    first: dict[TopicPartition, int] = {}
    for tp, offset in kept:
        if offset < first.get(tp, offset + 1):
            first[tp] = offset
    return first


@dataclass(slots=True, eq=False)
class _QueuedDDL:
    ddl: DDL
    identity: DDLIdentity
    scope: TableScope
    seq: int
    copies: list[RecordLocation]


class Resolver:
    """Rows whose schema is known and DDLs, waiting for the watermark and their barriers."""

    def __init__(self, held: PendingBuffer) -> None:
        self._held = held
        self._tables: dict[TableName, _TableRows] = {}
        self._queued_ddls: dict[DDLIdentity, _QueuedDDL] = {}
        self._in_flight_ddls: dict[DDLIdentity, DDLUnit] = {}
        self._done_ddls: LRUCache = LRUCache(DONE_DDLS_REMEMBERED)
        self._ddl_seq = 0
        self.rows = 0
        self.bytes = 0

    @property
    def queued_ddls(self) -> int:
        return len(self._queued_ddls)

    def add_row(self, dml: RawDML, location: RecordLocation, schema: TableSchema) -> None:
        name = (dml.database, dml.table)
        table = self._tables.get(name)
        if table is None:
            table = self._tables[name] = _TableRows([], set())
        size = row_size(dml)
        entry = (
            dml.commit_ts,
            location.topic,
            location.partition,
            location.offset,
            dml,
            location,
            schema,
            size,
        )
        entries = table.entries
        if table.ordered and entries and entry < entries[-1]:
            table.ordered = False
        entries.append(entry)
        table.table_ids.add(dml.table_id)
        self.rows += 1
        self.bytes += size

    def add_block(self, block: RowBlock, schema: TableSchema) -> None:
        """Rows decoded elsewhere, ordered as rows `add_row` takes are."""
        name = block.key[:2]
        table = self._tables.get(name)
        if table is None:
            table = self._tables[name] = _TableRows([], set())
        table.blocks.append((block, schema))
        table.table_ids.add(block.table_id)
        self.rows += len(block.offsets)
        self.bytes += len(block.offsets) * block.row_bytes

    def ddl_done(self, ddl: DDL) -> bool:
        """Whether this DDL was already confirmed (a late copy of it is applied on arrival)."""
        return ddl_identity(ddl) in self._done_ddls

    def add_ddl(self, ddl: DDL, location: RecordLocation) -> DDLUnit | None:
        """Queue one copy; returns the unit it joins if the DDL was already handed out, unconfirmed."""
        identity = ddl_identity(ddl)
        unit = self._in_flight_ddls.get(identity)
        if unit is not None:
            return unit
        queued = self._queued_ddls.get(identity)
        if queued is None:
            self._ddl_seq += 1
            queued = _QueuedDDL(ddl, identity, TableScope.of(ddl), self._ddl_seq, [])
            self._queued_ddls[identity] = queued
        queued.copies.append(location)
        return None

    def confirm_ddl(self, unit: DDLUnit) -> None:
        identity = ddl_identity(unit.ddl)
        self._in_flight_ddls.pop(identity, None)
        self._done_ddls[identity] = True

    def revoke(self, tp: TopicPartition) -> list[tuple[SchemaKey, int]]:
        """Forget a revoked partition's rows and DDL copies; returns how many rows of each schema key went."""
        dropped: list[_Entry] = []
        dropped_blocks: list[RowBlock] = []
        for table in self._tables.values():
            kept = [e for e in table.entries if (e[1], e[2]) != tp]
            if len(kept) != len(table.entries):
                dropped += [e for e in table.entries if (e[1], e[2]) == tp]
                table.entries = kept
            dropped_blocks += [block for block, _ in table.blocks if block.tp == tp]
            table.blocks = [(block, schema) for block, schema in table.blocks if block.tp != tp]
        self.rows -= len(dropped) + sum(len(block.offsets) for block in dropped_blocks)
        self.bytes -= sum(map(_size, dropped)) + sum(len(b.offsets) * b.row_bytes for b in dropped_blocks)
        for identity, queued in list(self._queued_ddls.items()):
            queued.copies = [loc for loc in queued.copies if topic_partition(loc) != tp]
            if not queued.copies:
                del self._queued_ddls[identity]
        return [(e[4].schema_key, 1) for e in dropped] + [(b.key, len(b.offsets)) for b in dropped_blocks]

    def waiting_by_partition(self) -> dict[TopicPartition, tuple[int, int, int]]:
        """Per partition: rows waiting, the highest commit_ts among them, and DDL copies waiting."""
        waiting: dict[TopicPartition, tuple[int, int, int]] = {}
        for table in self._tables.values():
            for entry in table.entries:
                rows, highest, ddls = waiting.get((entry[1], entry[2]), (0, 0, 0))
                waiting[entry[1], entry[2]] = (rows + 1, max(highest, entry[0]), ddls)
            for block, _ in table.blocks:
                rows, highest, ddls = waiting.get(block.tp, (0, 0, 0))
                newest = int(block.commit_ts.max())
                waiting[block.tp] = (rows + len(block.offsets), max(highest, newest), ddls)
        for queued in self._queued_ddls.values():
            for location in queued.copies:
                tp = topic_partition(location)
                rows, highest, ddls = waiting.get(tp, (0, 0, 0))
                waiting[tp] = (rows, max(highest, queued.ddl.commit_ts), ddls + 1)
        return waiting

    def resolve(self, watermark: int | None) -> list[Unit]:
        """Every unit that may go out under `watermark`, in order (see the module docstring)."""
        if watermark is None:
            return []
        units: list[Unit] = []
        floors = self._held.floors()
        queue = sorted(self._queued_ddls.values(), key=lambda d: (d.ddl.commit_ts, d.seq))
        for index, queued in enumerate(queue):
            if queued.ddl.commit_ts > watermark or self._waits_for_held_rows(queued):
                barriers = [d for d in queue[index:] if d.ddl.commit_ts <= watermark]
                return units + self._flush(watermark, floors, barriers)
            units += self._flush(queued.ddl.commit_ts, floors, [])
            units.append(self._emit(queued))
        return units + self._flush(watermark, floors, [])

    def _waits_for_held_rows(self, queued: _QueuedDDL) -> bool:
        earliest = self._held.earliest(queued.scope.covers)
        return earliest is not None and earliest <= queued.ddl.commit_ts

    def _emit(self, queued: _QueuedDDL) -> DDLUnit:
        del self._queued_ddls[queued.identity]
        unit = DDLUnit(queued.ddl, tuple(queued.copies))
        self._in_flight_ddls[queued.identity] = unit
        return unit

    def _flush(self, limit: int, floors: dict[TableName, int], barriers: list[_QueuedDDL]) -> list[Unit]:
        """Rows up to `limit`, less what held rows (`floors`) or DDLs not yet out (`barriers`, sorted)
        hold back."""
        firsts: list[tuple[SortKey, RowBatch | BlockBatch]] = []
        for name, table in list(self._tables.items()):
            cut = _cut(name, table, limit, floors.get(name), barriers)
            taken, blocks = table.take(cut)
            if not table:
                del self._tables[name]
            if taken:
                self.rows -= len(taken)
                self.bytes -= sum(map(_size, taken))
            for block, _ in blocks:
                self.rows -= len(block.offsets)
                self.bytes -= len(block.offsets) * block.row_bytes
            if blocks:
                firsts += _merged_batches(taken, blocks)
            elif taken:
                firsts += _batches(taken)
        firsts.sort(key=itemgetter(0))
        return [batch for _, batch in firsts]


def _cut(
    name: TableName, table: _TableRows, limit: int, floor: int | None, barriers: list[_QueuedDDL]
) -> int:
    """The highest commit_ts of `table` that may go out now."""
    if floor is not None:
        limit = min(limit, floor - 1)
    barrier = next((d for d in barriers if d.scope.covers(name, table.table_ids)), None)
    return limit if barrier is None else min(limit, barrier.ddl.commit_ts)


def _batches(entries: list[_Entry]) -> list[tuple[SortKey, RowBatch | BlockBatch]]:
    """Runs of one schema version; each with the sort key of its first row."""
    runs: list[tuple[SortKey, RowBatch | BlockBatch]] = []
    for _, group in groupby(entries, key=lambda e: id(e[6])):
        run = list(group)
        first = run[0]
        schema = first[6]
        rows = tuple(zip(map(itemgetter(4), run), map(itemgetter(5), run), strict=True))
        origins = RowOrigins(  # from the entries the take just sorted, while they are in the CPU's caches
            list(map(itemgetter(0), run)),
            [schema.version] * len(run),  # every row of a run has its schema's version
            list(map(itemgetter(1), run)),
            list(map(itemgetter(2), run)),
            list(map(itemgetter(3), run)),
        )
        runs.append(((first[0], first[1], first[2], first[3]), RowBatch(schema, rows, origins)))
    return runs


def _merged_batches(
    entries: list[_Entry], blocks: list[tuple[RowBlock, TableSchema]]
) -> list[tuple[SortKey, RowBatch | BlockBatch]]:
    """One table's rows taken at once, rows and blocks, as runs in emission order: a run is rows of one
    schema and one kind (a `BlockBatch` of the blocks' rows, or a `RowBatch`), each with the sort key of its
    first row. Usually one run: the blocks of one version, no rows."""
    schemas = {id(schema) for _, schema in blocks}
    if not entries and len(schemas) == 1:
        return [(min(_first(block) for block, _ in blocks), BlockBatch(blocks[0][1], _blocks(blocks)))]
    topics = sorted({block.topic for block, _ in blocks} | {entry[1] for entry in entries})
    rank = {topic: index for index, topic in enumerate(topics)}
    # every row's sort key (commit_ts, topic rank, partition, offset), by source: the blocks, then the rows
    sources = [_sort_keys(block, rank[block.topic]) for block, _ in blocks]
    sources.append(np.array([(e[0], rank[e[1]], e[2], e[3]) for e in entries], np.int64).reshape(-1, 4))
    keys = np.concatenate(sources)
    source = np.repeat(np.arange(len(sources)), [len(keys) for keys in sources])
    position = np.concatenate([np.arange(len(keys)) for keys in sources])
    order = np.lexsort(keys.T[::-1])
    group = np.array([id(schema) for _, schema in blocks] + [0])[source[order]]  # rows: `_batches` splits
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    runs: list[tuple[SortKey, RowBatch | BlockBatch]] = []
    for start, end in zip(starts, [*starts[1:], len(order)], strict=True):
        rows = order[start:end]
        kinds = source[rows]
        if kinds[0] == len(blocks):
            runs += _batches([entries[i] for i in position[rows]])
            continue
        commit_ts, topic, partition, offset = keys[rows[0]].tolist()
        picked = [_part(blocks[index], position[rows[kinds == index]]) for index in np.unique(kinds)]
        first = (commit_ts, topics[topic], partition, offset)
        runs.append((first, BlockBatch(picked[0][1], _blocks(picked))))
    return runs


def _part(block: tuple[RowBlock, TableSchema], positions: np.ndarray) -> tuple[RowBlock, TableSchema]:
    """The block's rows at `positions` (the whole block when they are all of it)."""
    whole, schema = block
    if len(positions) == len(whole.offsets):
        return block
    return whole.select(np.sort(positions)), schema


def _sort_keys(block: RowBlock, topic_rank: int) -> np.ndarray:
    """The block's rows' sort keys, a row each: commit_ts, topic rank, partition, offset."""
    count = len(block.offsets)
    return np.column_stack(
        (block.commit_ts, np.full(count, topic_rank), np.full(count, block.partition), block.offsets)
    ).astype(np.int64)


def _blocks(blocks: list[tuple[RowBlock, TableSchema]]) -> tuple[RowBlock, ...]:
    return tuple(block for block, _ in blocks)


def _first(block: RowBlock) -> SortKey:
    """The sort key of a block's first row in emission order."""
    lowest = block.commit_ts.min()
    offset = block.offsets[block.commit_ts == lowest].min()
    return (int(lowest), block.topic, block.partition, int(offset))
