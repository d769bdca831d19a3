"""Re-sent changes: which rows of a batch a table already holds, though they came at later offsets.

TiCDC delivers at least once: after a restart it sends again, at later offsets, changes it had already sent,
with their original commit ts (docs/resends.md). Offsets alone (`consumer.lakehouse.offsets`) cannot tell
such a copy from a new change, so every table also records, per (group, topic, partition), the newest
commit ts it holds of that partition (`Frontier.newest_ts`). Of a batch's rows at or after the partition's
next unapplied offset, those at or below that commit ts may be copies (TiCDC sends a table's changes on a
partition in commit-ts order, so a new change is newer, but for the rows of a partitioned table's
partitions, which interleave): such a row is a copy when the table holds the same change, that is the same
partition, commit ts, change type and key (a keyless table: the same image), read back from the table
(`Held`). A row equal to an earlier row of the same batch in those terms is a copy too (a transaction
re-sent right after itself), except in a keyless table, where equal images in one transaction are
legitimate.

A copy whose image differs from the change the table holds is a `conflicting-resend`: TiCDC never sends
one, so it is set aside for the error policy rather than applied or dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from consumer.errors import ConflictingResendError, DeadLetter, RecordLocation
from consumer.protocol.plain import value_object
from consumer.sources.record import TopicPartition

ORIGIN = ("_topic", "_partition", "_commit_ts", "_change_type")  # a change's place, beside its identity
Held = Callable[[TopicPartition, Sequence[int], Sequence[str]], pa.Table]
"""The rows a table holds of a partition at the given commit ts, with the given columns (those it has)."""


@dataclass(frozen=True, slots=True)
class Frontier:
    """How far a table holds one partition's changes."""

    next_offset: int = 0  # every change of the partition before this offset is in the table
    newest_ts: int = (
        0  # the newest commit ts among them (0: not known, e.g. a lake written before it was kept)
    )


@dataclass(frozen=True)
class Fresh:
    """A batch's rows split: those to apply, the re-sent copies skipped, and the conflicting copies."""

    rows: pa.Table
    # per partition, records (an UPDATE's two images are one) skipped as copies of changes the table holds
    resent: dict[TopicPartition, int]
    conflicts: pa.Table  # copies whose image differs from the change held: for the error policy

    @property
    def skipped(self) -> bool:
        return bool(self.resent) or self.conflicts.num_rows > 0


def identity_columns(rows: pa.Table, keys: Sequence[str]) -> list[str]:
    """What tells two changes of one table apart at one commit ts: the key, or for a keyless table every
    column that can be compared (nested values cannot)."""
    if keys:
        return list(keys)
    return [f.name for f in rows.schema if not f.name.startswith("_") and not pa.types.is_nested(f.type)]


def fresh_changes(
    rows: pa.Table, frontiers: Mapping[TopicPartition, Frontier], keys: Sequence[str], held: Held
) -> Fresh:
    """`rows` (a batch of changelog rows) without the copies of changes the table holds. Only rows at or
    after their partition's `next_offset` can be copies: rows before it are the table's own, read again
    (kept here: other tables of the same lake may lack them). `keys`: the table's key columns (none:
    keyless)."""
    if rows.num_rows == 0:
        return Fresh(rows, {}, rows.slice(0, 0))
    next_offset, newest = _frontier_per_row(rows, frontiers)
    ts = rows["_commit_ts"].to_numpy()
    candidate = (rows["_offset"].to_numpy() >= next_offset) & (ts != 0)  # commit ts 0: unknown, never a copy
    suspect = candidate & (ts <= newest)
    before = _before(held, frontiers)
    copies, conflicting = _copies(rows, identity_columns(rows, keys), candidate, suspect, bool(keys), before)
    skipped = copies | conflicting
    if not skipped.any():
        return Fresh(rows, {}, rows.slice(0, 0))
    resent = _records(rows.filter(pa.array(copies)))
    return Fresh(rows.filter(pa.array(~skipped)), resent, rows.filter(pa.array(conflicting)))


def _before(held: Held, frontiers: Mapping[TopicPartition, Frontier]) -> Held:
    """`held` without rows at or after the partition's next offset: rows of this very batch, which a table
    written before the check is made (e.g. a history after its changelog) may already hold."""

    def rows(tp: TopicPartition, commit_ts: Sequence[int], columns: Sequence[str]) -> pa.Table:
        have = held(tp, commit_ts, columns)
        frontier = frontiers.get(tp)
        if not have.num_rows or frontier is None or "_offset" not in have.column_names:
            return have
        return have.filter(pc.less(have["_offset"], frontier.next_offset))

    return rows


def _frontier_per_row(
    rows: pa.Table, frontiers: Mapping[TopicPartition, Frontier]
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's partition's next offset and newest commit ts held."""
    next_offset = np.zeros(rows.num_rows, np.int64)
    newest = np.zeros(rows.num_rows, np.int64)
    for (topic, partition), frontier in frontiers.items():
        mine = pc.and_(pc.equal(rows["_topic"], topic), pc.equal(rows["_partition"], partition))
        mask = mine.to_numpy(zero_copy_only=False)
        next_offset[mask] = frontier.next_offset
        newest[mask] = frontier.newest_ts
    return next_offset, newest


def _copies(
    rows: pa.Table,
    identity: list[str],
    candidate: np.ndarray,
    suspect: np.ndarray,
    keyed: bool,
    held: Held,
) -> tuple[np.ndarray, np.ndarray]:
    """Candidates equal to a change the table holds (read back for the suspects, or a row of the batch it
    holds already), or, in a keyed table, to an earlier row of the batch; and those of them whose image
    differs (conflicting)."""
    columns = [*ORIGIN, *identity]
    image = [n for n in rows.column_names if not n.startswith("_") and n not in identity]
    image = [n for n in image if not pa.types.is_nested(rows.schema.field(n).type)]
    batch = rows.select([*columns, *image, "_offset"])
    lake = _held_for(rows, suspect, held, batch.schema)
    none = np.zeros(rows.num_rows, bool)
    if lake is None and not _repeats(rows, columns):
        return none, none
    combined = batch if lake is None else pa.concat_tables([lake, batch])
    cut = 0 if lake is None else lake.num_rows
    first, repeated = _groups(combined, columns)
    held_rows = np.r_[np.ones(cut, bool), ~candidate]  # the lake's, and the batch's read again
    # a keyless table's equal images in one batch are legitimate: only a held one makes a copy
    copy = repeated & np.r_[np.zeros(cut, bool), candidate] & (held_rows[first] if not keyed else True)
    differs = copy & _differs(combined, image, first)
    return (copy & ~differs)[cut:], differs[cut:]


def _repeats(rows: pa.Table, columns: list[str]) -> bool:
    """Whether two rows share an identity (a cheap hash count before any sort)."""
    return rows.select(columns).group_by(columns, use_threads=False).aggregate([]).num_rows < rows.num_rows


def _held_for(rows: pa.Table, suspect: np.ndarray, held: Held, schema: pa.Schema) -> pa.Table | None:
    """What the table holds of each partition at its suspects' commit ts, as `schema` types it (a column
    the table lacks yet is null)."""
    if not suspect.any():
        return None
    places = rows.select(["_topic", "_partition", "_commit_ts"]).filter(pa.array(suspect))
    wanted: dict[TopicPartition, set[int]] = {}
    for topic, partition, ts in zip(*(places[c].to_pylist() for c in places.column_names), strict=True):
        wanted.setdefault((topic, partition), set()).add(ts)
    found = [held(tp, sorted(stamps), schema.names) for tp, stamps in sorted(wanted.items())]
    found = [_conformed(have, schema) for have in found if have.num_rows]
    return pa.concat_tables(found) if found else None


def _conformed(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    columns = [
        rows[f.name].cast(f.type) if f.name in rows.column_names else pa.nulls(rows.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _groups(table: pa.Table, columns: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the index of its group's first row (equal `columns`, nulls equal; first by `_offset`), and
    whether it is not that first row."""
    order = pc.sort_indices(table, [(c, "ascending") for c in [*columns, "_offset"]]).to_numpy()
    ordered = table.select(columns).take(pa.array(order))
    same = np.ones(max(table.num_rows - 1, 0), bool)
    for name in columns:
        same &= _equal_to_previous(ordered[name])
    starts = np.r_[True, ~same]
    group_first = order[np.maximum.accumulate(np.where(starts, np.arange(len(order)), 0))]
    first = np.empty(len(order), np.int64)
    first[order] = group_first
    repeated = np.empty(len(order), bool)
    repeated[order] = ~starts
    return first, repeated


def _equal_to_previous(column: pa.ChunkedArray) -> np.ndarray:
    """Whether each value but the first equals the one before it, a null equal to a null."""
    values = column.combine_chunks()
    current, previous = values.slice(1), values.slice(0, len(values) - 1)
    equal = pc.fill_null(pc.equal(current, previous), False)
    both_null = pc.and_(pc.is_null(current), pc.is_null(previous))
    return pc.or_(equal, both_null).to_numpy(zero_copy_only=False)


def _differs(table: pa.Table, image: list[str], first: np.ndarray) -> np.ndarray:
    """Whether each row's image differs from its group's first row's."""
    differs = np.zeros(table.num_rows, bool)
    if not image:
        return differs
    originals = table.select(image).take(pa.array(first))
    for name in image:
        mine, theirs = table[name].combine_chunks(), originals[name].combine_chunks()
        equal = pc.fill_null(pc.equal(mine, theirs), False)
        both_null = pc.and_(pc.is_null(mine), pc.is_null(theirs))
        differs |= ~pc.or_(equal, both_null).to_numpy(zero_copy_only=False)
    return differs


def _records(rows: pa.Table) -> dict[TopicPartition, int]:
    """Per partition, its distinct offsets: an UPDATE's two images are one record."""
    if rows.num_rows == 0:
        return {}
    places = rows.select(["_topic", "_partition", "_offset"])
    records = places.group_by(places.column_names, use_threads=False).aggregate([])
    counts = records.group_by(["_topic", "_partition"], use_threads=False).aggregate([([], "count_all")])
    columns = (counts[name].to_pylist() for name in ("_topic", "_partition", "count_all"))
    return {(topic, partition): count for topic, partition, count in zip(*columns, strict=True)}


def conflict_letters(conflicts: pa.Table, table: str) -> tuple[DeadLetter, ...]:
    """The conflicting copies as dead letters: a record each (an UPDATE's images together), its value the
    images as JSON, since the record's own bytes are not kept past decoding."""
    letters: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for row in conflicts.to_pylist():
        place = (row["_topic"], row["_partition"], row["_offset"])
        letters.setdefault(place, []).append({name: value_object(value) for name, value in row.items()})
    return tuple(
        DeadLetter(
            RecordLocation(topic, partition, offset),
            f"{table}: a change sent again (commit ts {images[0]['_commit_ts']}) differs from the one the "
            "lake holds: the lake keeps the first, this one is set aside",
            msgspec.json.encode(images),
            ConflictingResendError.code,
        )
        for (topic, partition, offset), images in letters.items()
    )
