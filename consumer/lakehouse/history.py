"""History tables (SCD type 2): one row per version of each upstream row, as pure Arrow computations.

A version is opened by one change image (an INSERT, an UPDATE's postimage or a DELETE) and is valid from
its commit ts (`_valid_from_ts`) until the key's next change (`_valid_to_ts`, null while it is the latest).
A DELETE opens a tombstone version (`_deleted` true, the deleted row's last values): the row does not exist
while it is valid. Tombstones are what keeps a late change in place: an INSERT at ts 5 applied after the
key's DELETE at ts 9 is closed at 9 by it, and the DELETE's `(topic, partition, offset)` is known.

A key's versions are ordered as the mirror orders its changes: commit ts, then partition and offset
(`consumer.lakehouse.tables.ORDER`); each version is identified by its key and the change that opened it
(`IDENTITY`), so a MERGE updates the `_valid_to_ts` of existing versions a late change splits and inserts
the new ones. A TRUNCATE or DROP ends every version valid at its commit ts there (`CLOSED_PROPERTY` lists
them): the row is gone from then on, until a later change (after a TRUNCATE) opens a new version.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HISTORY_FIELDS = (
    pa.field("_valid_from_ts", pa.int64(), nullable=False),
    pa.field("_valid_to_ts", pa.int64()),
    pa.field("_deleted", pa.bool_(), nullable=False),
    pa.field("_schema_version", pa.int64(), nullable=False),
    pa.field("_topic", pa.string(), nullable=False),
    pa.field("_partition", pa.int32(), nullable=False),
    pa.field("_offset", pa.int64(), nullable=False),
)
HISTORY_META = tuple(f.name for f in HISTORY_FIELDS)
SOURCE = ("_topic", "_partition", "_offset")  # the change that opened a version
CLOSED_PROPERTY = "ticdc.history.closed_at"  # on a history: its TRUNCATEs/DROP (commit ts, comma list)
OPEN = 2**63 - 1  # no end yet
NONE, NEW = -1, -2  # `_was_to` of a version whose end is null / of a version the table lacks


def identity(keys: Sequence[str]) -> list[str]:
    """The columns identifying a version: its key and the change that opened it."""
    return [*keys, *SOURCE]


def change_versions(changelog: pa.Table, columns: Sequence[str]) -> pa.Table:
    """A changelog batch's images as versions (not yet chained: `_valid_to_ts` null); preimages open
    none. `columns`: the user columns."""
    images = changelog.filter(pc.not_equal(changelog["_change_type"], "update_preimage"))
    deleted = pc.equal(images["_change_type"], "delete")
    meta = {
        "_valid_from_ts": images["_commit_ts"],
        "_valid_to_ts": pa.nulls(images.num_rows, pa.int64()),
        "_deleted": deleted,
        **{name: images[name] for name in ("_schema_version", *SOURCE)},
    }
    arrays = [*(images[name] for name in columns), *(meta[f.name] for f in HISTORY_FIELDS)]
    fields = [*(images.schema.field(name) for name in columns), *HISTORY_FIELDS]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def rechained(versions: pa.Table, keys: Sequence[str], cuts: Sequence[int]) -> pa.Table:
    """`versions` (every version of some keys) sorted per key, each valid until its key's next version or
    the first of `cuts` (TRUNCATEs, a DROP) after its start, whichever comes first; else open (null)."""
    order = [(k, "ascending") for k in keys] + [(n, "ascending") for n in ("_valid_from_ts", *SOURCE[1:])]
    rows = versions.take(pc.sort_indices(versions, order))
    count = rows.num_rows
    if count == 0:
        return rows
    same_key = pa.array([True] * (count - 1), pa.bool_())
    for key in keys:
        column = rows[key].combine_chunks()
        same_key = pc.and_(same_key, pc.equal(column.slice(0, count - 1), column.slice(1)))
    starts = rows["_valid_from_ts"].to_numpy()
    following = np.append(np.where(same_key.to_numpy(zero_copy_only=False), starts[1:], OPEN), OPEN)
    bounds = np.append(np.sort(np.asarray(cuts, np.int64)), OPEN)
    ends = np.minimum(following, bounds[np.searchsorted(bounds, starts, side="right")])
    index = rows.column_names.index("_valid_to_ts")
    return rows.set_column(index, rows.schema.field(index), pa.array(ends, pa.int64(), mask=ends == OPEN))


def matching(rows: pa.Table, other: pa.Table, columns: Sequence[str], *, found: bool) -> pa.Table:
    """`rows` whose `columns` values `other` has too (`found`), or has not. Only those columns and a row
    number are joined: Arrow joins carry no nested columns."""
    numbered = rows.select(list(columns)).append_column("_row", pa.array(range(rows.num_rows), pa.int64()))
    joined = numbered.join(
        other.select(list(columns)), list(columns), join_type="left semi" if found else "left anti"
    )
    return rows.take(pc.sort_indices(joined["_row"]))


def marked(versions: pa.Table, stored: bool) -> pa.Table:
    """`versions` with `_was_to`: for versions the table holds, their `_valid_to_ts` there (NONE for
    null); NEW for versions it lacks."""
    count = versions.num_rows
    was = pc.fill_null(versions["_valid_to_ts"], NONE) if stored else pa.array([NEW] * count, pa.int64())
    return versions.append_column("_was_to", was)


def to_write(chained: pa.Table) -> pa.Table:
    """The chained versions (`marked`) a MERGE must write: the new ones and those whose end moved."""
    was = chained["_was_to"]
    moved = pc.not_equal(pc.fill_null(chained["_valid_to_ts"], NONE), was)
    return chained.filter(pc.or_(pc.equal(was, NEW), moved)).drop_columns(["_was_to"])
