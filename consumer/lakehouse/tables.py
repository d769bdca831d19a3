"""Finding and reading an upstream table's Delta tables through the catalog, as Arrow tables.

Each table of the catalog has, under `<root>/<location>/`:

    changelog   every change image (Delta change-data-feed convention), append only
    mirror      exactly the table's live rows as of its last commit, MERGEd on its key (tables with a key)
    history     every version of each row, valid from one change to the key's next (`--mode history`;
                `consumer.lakehouse.history`)
    deletes     recently deleted keys with their commit ts, so an older change a lagging group member still
                holds cannot bring a row back; purged below the consistent point (`maintain`)

TIME columns are stored as int64 microseconds (Delta has no duration type), marked in the field metadata;
the readers here give them back as durations.

As of a TSO: every mirror commit says, in its commit metadata, which changes the mirror holds after it
(`mirror_versions`). `read_mirror(..., as_of_tso=T)` takes the newest mirror version holding no change
after T and applies the changelog's changes it may lack, up to T, with the MERGE's own rules
(`latest_per_key`); TRUNCATEs and the column set at T come from the `_ddl` log. With no such version it
replays the whole changelog.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer.lakehouse.catalog import Catalog, CatalogEntry
from consumer.lakehouse.ddl import DDLLog, table_schema
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import LakeRoot

Kind = Literal["changelog", "mirror", "history", "deletes"]
KINDS: tuple[Kind, ...] = ("changelog", "mirror", "history", "deletes")
STORED_AS, STORED_DURATION = "ticdc.stored_as", "duration[us]"  # field metadata of a stored TIME column
FLOOR_PROPERTY = "ticdc.truncated_at"  # on a mirror: its latest TRUNCATE/DROP, older changes never apply
KEY_PROPERTY = "ticdc.key"  # on a mirror: its key columns, comma-separated (`maintain` clusters by them)
COMPLETE_TS = "ticdc.mirror.complete_ts"  # mirror commit metadata: the table then holds every change up to it
NEWEST_TS = "ticdc.mirror.newest_ts"  # mirror commit metadata: the newest change the commit applied
ROW_OPERATIONS = frozenset({"WRITE", "MERGE", "DELETE", "UPDATE"})  # commits that may change a mirror's rows
MIRROR_META = ("_commit_ts", "_schema_version")  # a mirror's columns beside the user's
BUCKET = "_bucket"  # a bucketed mirror's partition column: hash of its first key column mod its buckets
BUCKETS_PROPERTY = "ticdc.bucket_count"  # in the `_bucket` field's metadata: how many buckets
ORDER = (  # what orders a key's changes besides `_commit_ts`
    pa.field("_change_type", pa.string()),
    pa.field("_partition", pa.int32()),
    pa.field("_offset", pa.int64()),
)
LATEST = 2**63 - 1
RootLike = str | os.PathLike[str] | LakeRoot


def tables(root: RootLike, storage_options: Mapping[str, str] | None = None) -> list[CatalogEntry]:
    """Every upstream table the root holds or held (dropped ones included), with its location and history."""
    return Catalog(LakeRoot.of(root, storage_options)).entries()


def table_uri(
    root: RootLike,
    database: str,
    table: str,
    kind: Kind = "mirror",
    storage_options: Mapping[str, str] | None = None,
) -> str | None:
    """The URI of the live table `database.table`'s Delta table `kind` (hand it to any Delta reader), or
    None when no live table has that name."""
    lake = LakeRoot.of(root, storage_options)
    entry = Catalog(lake).current((database, table))
    return None if entry is None else entry_uri(lake, entry, kind)


def entry_uri(root: LakeRoot, entry: CatalogEntry, kind: Kind) -> str:
    return root.join(entry.location, kind)


class TsoOutOfRangeError(ValueError):
    """An as-of read for a TSO the lakehouse cannot answer exactly."""

    def __init__(self, tso: int, earliest: int | None, latest: int | None) -> None:
        self.tso, self.earliest, self.latest = tso, earliest, latest
        super().__init__(
            f"TSO {tso} is outside the range this lakehouse answers as of: from {earliest} (its earliest "
            f"retained change) to {latest} (its consistent point, consistent_ts)"
        )


@dataclass(frozen=True)
class MirrorVersion:
    """Which changes a mirror version holds: every one up to `complete_ts` and none after `newest_ts`
    (None: unknown, a commit without the metadata changed rows); it is exact at any TSO between them."""

    version: int
    complete_ts: int
    newest_ts: int | None


def read_mirror(
    root: RootLike,
    database: str,
    table: str,
    columns: Sequence[str] | None = None,
    storage_options: Mapping[str, str] | None = None,
    as_of_tso: int | None = None,
) -> pa.Table | None:
    """The rows and columns `database.table` had as of `as_of_tso`, after every change with commit ts <= it
    (TIME as durations), found under the name the table had then (renamed or dropped since: still found);
    by default as of `consistent_ts(root)` (before any progress is recorded: of everything written). A table
    with no rows written yet is empty. None when no table had the name then, or it has no mirror (no key).

    Raises TsoOutOfRangeError for a TSO outside `retained_range(root)`.
    """
    lake = LakeRoot.of(root, storage_options)
    tso = _target(lake, as_of_tso)
    entry = Catalog(lake).find((database, table), tso)
    rows = None if entry is None else _mirror_at(lake, entry, tso)
    return rows if rows is None or columns is None else rows.select(list(columns))


def retained_range(
    root: RootLike, storage_options: Mapping[str, str] | None = None
) -> tuple[int | None, int | None]:
    """The TSOs as-of reads answer: from the earliest change the lakehouse retains (a DDL or a row) to its
    consistent point; None where unknown (nothing written, no progress recorded)."""
    lake = LakeRoot.of(root, storage_options)
    return _earliest(lake), consistent_ts(lake)


def mirror_versions(table: DeltaTable) -> list[MirrorVersion]:
    """What each version of a mirror holds, from its commits' metadata (a commit's claims hold for every
    later version too). A log cleaned of its first commits says nothing of the newest change."""
    commits = sorted(table.history(), key=lambda commit: commit["version"])
    complete, newest = 0, 0 if commits and commits[0]["version"] == 0 else None
    versions = []
    for commit in commits:
        complete = max(complete, int(commit.get(COMPLETE_TS, 0)))
        newest = _newest(newest, commit)
        versions.append(MirrorVersion(commit["version"], complete, newest))
    return versions


def _newest(before: int | None, commit: Mapping[str, Any]) -> int | None:
    if NEWEST_TS in commit:
        return None if before is None else max(before, int(commit[NEWEST_TS]))
    return None if commit.get("operation") in ROW_OPERATIONS else before


def _target(lake: LakeRoot, as_of_tso: int | None) -> int:
    point = consistent_ts(lake)
    if as_of_tso is None:
        return LATEST if point is None else point
    earliest = _earliest(lake)
    if point is None or earliest is None or not earliest <= as_of_tso <= point:
        raise TsoOutOfRangeError(as_of_tso, earliest, point)
    return as_of_tso


def _earliest(lake: LakeRoot) -> int | None:
    starts = [row["commit_ts"] for row in DDLLog(lake).rows()[:1]]
    for entry in Catalog(lake).entries():
        changelog = lake.open(entry_uri(lake, entry, "changelog"))
        if changelog is not None and changelog.file_uris():
            starts.append(_smallest_ts(lake, changelog))
    return min(starts, default=None)


def _smallest_ts(lake: LakeRoot, table: DeltaTable) -> int:
    """From the files' statistics, or their `_commit_ts` column where a file has none."""
    actions = pa.table(table.get_add_actions(flatten=True))
    column = "min._commit_ts"
    if column in actions.column_names and not actions[column].null_count:
        return int(pc.min(actions[column]).as_py())
    return int(pc.min(lake.scan(table).to_table(columns=["_commit_ts"])["_commit_ts"]).as_py())


# -- a table as of a TSO -------------------------------------------------------------------------------
def _mirror_at(lake: LakeRoot, entry: CatalogEntry, tso: int) -> pa.Table | None:
    """The table's rows as of `tso`; None for a table without a key (a changelog, no mirror)."""
    ddls = [row for row in DDLLog(lake).rows() if row["commit_ts"] <= tso and _concerns(entry, row)]
    logged = next((table_schema(r["schema"]) for r in reversed(ddls) if r["schema"] is not None), None)
    mirror = lake.open(entry_uri(lake, entry, "mirror"))
    changelog = lake.open(entry_uri(lake, entry, "changelog"))
    stored = [pa.schema(t.schema().to_arrow()) for t in (mirror, changelog) if t is not None]
    key = _key(mirror, logged)
    if not key and mirror is not None:  # not a mirror this SDK keeps: as written
        return read_delta(lake, mirror)
    if not key and changelog is not None:
        return None
    base, since = _base(lake, mirror, tso, changelog is not None) if mirror is not None else (None, -1)
    window = _changes(lake, changelog, since, tso) if changelog is not None and key else None
    names = _user_columns(logged if logged is not None else mirror and pa.schema(mirror.schema().to_arrow()))
    schema = _output_schema(names, [*stored, *([logged] if logged is not None else [])])
    floor = max([r["commit_ts"] for r in ddls if r["type"] == "TRUNCATE"], default=0)
    if entry.truncated_ts is not None and entry.truncated_ts <= tso:
        floor = max(floor, entry.truncated_ts)
    rows = _applied(schema, base, window, key, floor)
    return as_durations(rows, stored_durations(stored[0])) if stored else rows


def _key(mirror: DeltaTable | None, logged: pa.Schema | None) -> list[str]:
    """The table's key columns: the mirror's, else its DDLs' (a run stopped before the mirror's first
    commit); [] when neither knows one (no key, or nothing written or announced yet)."""
    recorded = mirror.metadata().configuration.get(KEY_PROPERTY) if mirror is not None else None
    if not recorded and logged is not None and logged.metadata:
        recorded = logged.metadata.get(KEY_PROPERTY.encode(), b"").decode()
    return recorded.split(",") if recorded else []


def _user_columns(schema: pa.Schema | None) -> list[str]:
    """The columns the DDLs gave the table, else (none logged) every user column its mirror has."""
    return [] if schema is None else [n for n in schema.names if n not in MIRROR_META and n != BUCKET]


def _concerns(entry: CatalogEntry, ddl: Mapping[str, Any]) -> bool:
    """Whether a logged DDL acted on this table (by its name at the DDL's commit ts)."""
    return ddl["database"] is not None and entry.name_at(ddl["commit_ts"]) == (ddl["database"], ddl["table"])


def _base(lake: LakeRoot, mirror: DeltaTable, tso: int, logged: bool) -> tuple[pa.Table | None, int]:
    """The newest mirror version holding no change after `tso`, and a TSO it holds every change up to
    (-1: none; the changelog is replayed whole). A version vacuumed away counts as none. Without a
    changelog (`logged` false: a mirror-only sink) and no such version: the mirror as it is."""
    usable = [v for v in mirror_versions(mirror) if v.newest_ts is not None and v.newest_ts <= tso]
    if not usable:
        return (None, -1) if logged else (lake.scan(mirror).to_table(), LATEST)
    chosen = usable[-1]
    try:
        table = mirror
        if chosen.version != mirror.version():
            table = DeltaTable(mirror.table_uri, version=chosen.version, storage_options=lake.options())
        rows = lake.scan(table).to_table()
    except (OSError, DeltaError):
        return None, -1
    return rows, chosen.complete_ts or -1


def _changes(lake: LakeRoot, changelog: DeltaTable, since: int, tso: int) -> pa.Table:
    ts = pc.field("_commit_ts")
    return lake.scan(changelog).to_table(filter=(ts > since) & (ts <= tso))


def _schemas(table: DeltaTable | None) -> list[pa.Schema]:
    return [] if table is None else [pa.schema(table.schema().to_arrow())]


def _output_schema(names: Sequence[str], sources: Sequence[pa.Schema]) -> pa.Schema:
    """The user columns `names` then the mirror's own, each typed as the first source having it types it
    (the mirror's bookkeeping columns as int64 where no table exists yet)."""
    meta = pa.schema([pa.field(name, pa.int64(), nullable=False) for name in MIRROR_META])
    fields = []
    for name in [*names, *MIRROR_META]:
        fields.append(next(s.field(name) for s in [*sources, meta] if name in s.names))
    return pa.schema(fields)


def _applied(
    schema: pa.Schema, base: pa.Table | None, window: pa.Table | None, key: list[str], floor: int
) -> pa.Table:
    """The base's rows with the window's changes applied: each key's latest image wins (base rows first
    at an equal commit ts), deletes remove, and nothing older than the last TRUNCATE (`floor`) stays.
    Only the keys the window changes are resolved; the base's other rows are taken as they are."""
    untouched = None
    if base is not None and base.num_rows and (window is None or not window.num_rows):
        untouched, base = base, None  # nothing to apply: the mirror's rows as they are
    elif base is not None and base.num_rows and window is not None:
        rows = pa.array(np.arange(base.num_rows, dtype=np.int64))
        probe = base.select(key).append_column("_row", rows)
        changed = probe.join(window.select(key), key, join_type="left semi")["_row"]
        touched = np.zeros(base.num_rows, dtype=bool)
        touched[changed.to_numpy()] = True
        untouched, base = base.filter(pa.array(~touched)), base.filter(pa.array(touched))
    parts = [
        _conformed(part, schema) for part in (_as_changes(base), window) if part is not None and part.num_rows
    ]
    if untouched is not None and untouched.num_rows:
        parts.append(_conformed(_as_changes(untouched.slice(0, 0)), schema))  # the types, no rows
    if untouched is not None and not untouched.num_rows:
        untouched = None
    if not parts:
        return schema.empty_table()
    latest = latest_per_key(pa.concat_tables(parts), key)
    kept = pc.and_(
        pc.not_equal(latest["_change_type"], "delete"), pc.greater_equal(latest["_commit_ts"], floor)
    )
    rows = latest.filter(kept).select(schema.names)
    if untouched is not None and untouched.num_rows:
        others = _selected(untouched, rows.schema)
        others = others.filter(pc.greater_equal(others["_commit_ts"], floor)) if floor else others
        rows = pa.concat_tables([others, rows])
    return rows.take(pc.sort_indices(rows, [(name, "ascending") for name in key]))


def _selected(part: pa.Table, schema: pa.Schema) -> pa.Table:
    """`part` with `schema`'s columns, typed as it types them (null where `part` lacks one)."""
    columns = [
        part[f.name].cast(f.type) if f.name in part.column_names else pa.nulls(part.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _as_changes(rows: pa.Table | None) -> pa.Table | None:
    """Mirror rows as changes ordered before any change of the same commit ts."""
    if rows is None:
        return None
    count = rows.num_rows
    rows = rows.append_column("_change_type", pa.repeat(pa.scalar("insert", pa.string()), count))
    rows = rows.append_column("_partition", pa.repeat(pa.scalar(-1, pa.int32()), count))
    return rows.append_column("_offset", pa.repeat(pa.scalar(-1, pa.int64()), count))


def _conformed(part: pa.Table, schema: pa.Schema) -> pa.Table:
    """`part` with `schema`'s columns (null where it lacks one) and its ordering columns."""
    columns = [
        part[f.name].cast(f.type) if f.name in part.column_names else pa.nulls(part.num_rows, f.type)
        for f in schema
    ]
    ordering = [part[f.name].cast(f.type) for f in ORDER]
    fields = [*(f.with_nullable(True) for f in schema), *ORDER]
    return pa.Table.from_arrays([*columns, *ordering], schema=pa.schema(fields))


def latest_per_key(changelog: pa.Table, key_columns: Sequence[str]) -> pa.Table:
    """Each key's last change in the batch by (commit_ts, partition, offset); preimages never win.

    The result is what a mirror MERGE needs: one source row per key (delta-rs rejects duplicates), with
    `_change_type` telling upsert from delete.
    """
    images = changelog.filter(pc.not_equal(changelog["_change_type"], "update_preimage"))
    order = pc.sort_indices(
        images,
        [
            ("_commit_ts", "ascending"),
            ("_partition", "ascending"),
            ("_offset", "ascending"),
            ("_change_type", "descending"),
        ],
    )
    ordered = images.take(order).append_column("_position", pa.array(range(images.num_rows), pa.int64()))
    last = ordered.group_by(list(key_columns), use_threads=False).aggregate([("_position", "max")])
    return ordered.take(last["_position_max"]).drop_columns(["_position"])


def bucket_of(values: pa.ChunkedArray | pa.Array, buckets: int) -> pa.Array:
    """Each key's bucket (int64, 0 .. buckets-1): a mix of a 64-bit integer key (splitmix64's finaliser),
    CRC-32 of any other key's text form; the same for a key whatever process computes it."""
    if pa.types.is_integer(values.type):
        mixed = np.asarray(pc.fill_null(values, 0).cast(pa.int64()).to_numpy(), dtype=np.int64).view(
            np.uint64
        )
        with np.errstate(over="ignore"):
            mixed = (mixed ^ (mixed >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            mixed = (mixed ^ (mixed >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            mixed = mixed ^ (mixed >> np.uint64(31))
        return pa.array((mixed % np.uint64(buckets)).astype(np.int64), pa.int64())
    texts = values.to_pylist()
    return pa.array(
        [zlib.crc32(_text(value).encode()) % buckets for value in texts],
        pa.int64(),
    )


def _text(value: Any) -> str:
    return value.hex() if isinstance(value, bytes) else str(value)


def read_changelog(
    root: RootLike,
    database: str,
    table: str,
    columns: Sequence[str] | None = None,
    storage_options: Mapping[str, str] | None = None,
) -> pa.Table | None:
    """Every change image of `database.table`; None when it has no changelog."""
    return _read(LakeRoot.of(root, storage_options), database, table, "changelog", columns)


def read_history(
    root: RootLike,
    database: str,
    table: str,
    key: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, str] | None = None,
) -> pa.Table | None:
    """Every version of the live table `database.table`'s rows (of the row with `key`, column -> value,
    when given), ordered by key then by when each became valid; None when the table has no history."""
    lake = LakeRoot.of(root, storage_options)
    uri = table_uri(lake, database, table, "history")
    history = None if uri is None else lake.open(uri)
    if history is None:
        return None
    versions = read_delta(lake, history)
    for column, value in (key or {}).items():
        versions = versions.filter(
            pc.equal(versions[column], pa.scalar(value, versions.schema.field(column).type))
        )
    keys = history.metadata().configuration.get(KEY_PROPERTY, "").split(",")
    order = [*(k for k in keys if k), "_valid_from_ts", "_partition", "_offset"]
    return versions.take(pc.sort_indices(versions, [(name, "ascending") for name in order]))


def _read(
    root: LakeRoot, database: str, table: str, kind: Kind, columns: Sequence[str] | None
) -> pa.Table | None:
    uri = table_uri(root, database, table, kind)
    delta = None if uri is None else root.open(uri)
    return None if delta is None else read_delta(root, delta, columns)


def read_delta(root: LakeRoot, table: DeltaTable, columns: Sequence[str] | None = None) -> pa.Table:
    """A Delta table's current rows, TIME columns as durations again."""
    rows = root.scan(table).to_table(columns=list(columns) if columns is not None else None)
    return as_durations(rows, stored_durations(pa.schema(table.schema().to_arrow())))


def stored_durations(schema: pa.Schema) -> list[str]:
    """The columns that hold MySQL TIME values as int64 microseconds (marked in their field metadata)."""
    marked = {STORED_AS.encode(): STORED_DURATION.encode()}
    return [f.name for f in schema if f.metadata and marked.items() <= f.metadata.items()]


def as_durations(rows: pa.Table, names: Sequence[str]) -> pa.Table:
    for name in names:
        if name in rows.column_names:
            index = rows.column_names.index(name)
            rows = rows.set_column(index, name, rows[name].cast(pa.duration("us")))
    return rows
