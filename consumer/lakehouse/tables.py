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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer.lakehouse.catalog import Catalog, CatalogEntry, MirrorVersion
from consumer.lakehouse.ddl import DDLLog, table_schema
from consumer.lakehouse.history import HISTORY_META
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import LakeRoot, by_version

Kind = Literal["changelog", "mirror", "history", "deletes"]
KINDS: tuple[Kind, ...] = ("changelog", "mirror", "history", "deletes")
STORED_AS, STORED_DURATION = "ticdc.stored_as", "duration[us]"  # field metadata of a stored TIME column
FLOOR_PROPERTY = "ticdc.truncated_at"  # on a mirror: its latest TRUNCATE/DROP, older changes never apply
KEY_PROPERTY = "ticdc.key"  # on a mirror: its key columns, comma-separated (`maintain` clusters by them)
COMPLETE_TS = "ticdc.mirror.complete_ts"  # mirror commit metadata: the table then holds every change up to it
NEWEST_TS = "ticdc.mirror.newest_ts"  # mirror commit metadata: the newest change the commit applied
RETAINED_AFTER = "ticdc.changelog.retained_after"  # on a changelog: it holds every change after this TSO
READABLE_FROM = "ticdc.asof.readable_from"  # on a changelog: the oldest TSO the table answers as of
KNOWN_PROPERTY = "ticdc.mirror.known"  # on a mirror: "version:complete_ts:newest_ts" maintain last computed
BASES_PROPERTY = "ticdc.mirror.bases"  # on a mirror: "version:complete_ts,..." maintain found from the log
ROW_OPERATIONS = frozenset({"WRITE", "MERGE", "DELETE", "UPDATE"})  # commits that may change a mirror's rows
MIRROR_META = ("_commit_ts", "_schema_version")  # a mirror's columns beside the user's
BUCKET = "_bucket"  # a bucketed mirror's partition column: hash of its first key column mod its buckets
BUCKETS_PROPERTY = "ticdc.bucket_count"  # in the `_bucket` field's metadata: how many buckets
SPLIT_PARTS = "_ticdc_parts"  # beside a mirror's files: the rows of a split MERGE's groups, until it commits
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


class AsOfRetentionError(TsoOutOfRangeError):
    """An as-of read older than what `maintain --as-of-retention` kept: the changes it would need are gone.
    `oldest` is the oldest TSO the lakehouse still answers as of."""

    def __init__(self, tso: int, oldest: int, latest: int | None) -> None:
        super().__init__(tso, oldest, latest)
        self.oldest = oldest
        self.args = (
            f"TSO {tso} is older than the as-of retention kept: the oldest TSO this lakehouse answers "
            f"as of is {oldest} (maintain --as-of-retention removed older changes); it answers up to "
            f"{latest} (its consistent point, consistent_ts)",
        )

    def __str__(self) -> str:
        return str(self.args[0])


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
    catalog, ddls = Catalog(lake), DDLLog(lake).rows()  # read once, for the range and the table
    if as_of_tso is None:
        return _read_at(lake, catalog, ddls, (database, table), _target(lake, None, catalog, ddls), columns)
    checked = _workers().submit(_checked, lake, as_of_tso, ddls)
    try:
        rows = _read_at(lake, catalog, ddls, (database, table), as_of_tso, columns)
    finally:
        checked.result()  # an out-of-range TSO raises its error, whatever the read did
    return rows


@cache
def _workers() -> ThreadPoolExecutor:
    """Threads as-of reads run work on beside their own (the range check, the tail, parts of the merge),
    kept for the process: a fresh thread allocates from a fresh heap, and the page faults on the merge's
    memory cost what merging on two cores gains. No task waits on another, so none can starve."""
    return ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="as-of")


# a forked child inherits the pool but not its threads: work it submitted would wait forever
os.register_at_fork(after_in_child=_workers.cache_clear)


def _checked(lake: LakeRoot, as_of_tso: int, ddls: list[dict[str, Any]]) -> int:
    """`_target` for `as_of_tso` on Delta handles of its own (a root of its own): on a thread beside the
    read, its look-ups wait on storage and Delta's threads while the read's do."""
    own = LakeRoot(lake.uri, lake.storage_options)
    return _target(own, as_of_tso, Catalog(own), ddls)


def _read_at(
    lake: LakeRoot,
    catalog: Catalog,
    ddls: list[dict[str, Any]],
    name: tuple[str, str],
    tso: int,
    columns: Sequence[str] | None,
) -> pa.Table | None:
    entry = catalog.find(name, tso)
    rows = None if entry is None else _mirror_at(lake, entry, tso, ddls)
    return rows if rows is None or columns is None else rows.select(list(columns))


def retained_range(
    root: RootLike, storage_options: Mapping[str, str] | None = None
) -> tuple[int | None, int | None]:
    """The TSOs as-of reads answer: from the earliest change the lakehouse retains (a DDL or a row; after
    `maintain --as-of-retention` removed older changes, the oldest TSO every table still answers as of) to
    its consistent point; None where unknown (nothing written, no progress recorded)."""
    lake = LakeRoot.of(root, storage_options)
    earliest, floor = _earliest(lake, Catalog(lake), DDLLog(lake).rows())
    return _oldest(earliest, floor), consistent_ts(lake)


def mirror_versions(table: DeltaTable) -> list[MirrorVersion]:
    """What each version of a mirror holds, from its commits' metadata (a commit's claims hold for every
    later version too). A log cleaned of its first commits says nothing of the newest change, unless
    `maintain` recorded what it knew of a version still in the log, or just before it (`KNOWN_PROPERTY`)."""
    commits = sorted(table.history(), key=lambda commit: commit["version"])
    complete, newest = 0, 0 if commits and commits[0]["version"] == 0 else None
    known = _known(table)
    found = recorded_bases(table)
    if known is not None and commits and known.version == commits[0]["version"] - 1 and newest is None:
        complete, newest = known.complete_ts, known.newest_ts
    versions = []
    for commit in commits:
        complete = max(complete, int(commit.get(COMPLETE_TS, 0)), found.get(commit["version"], 0))
        newest = _newest(newest, commit)
        if known is not None and commit["version"] == known.version and known.newest_ts is not None:
            complete = max(complete, known.complete_ts)
            newest = known.newest_ts if newest is None else max(newest, known.newest_ts)
        versions.append(MirrorVersion(commit["version"], complete, newest))
    return versions


def latest_mirror_version(table: DeltaTable, known: MirrorVersion | None) -> MirrorVersion | None:
    """What the mirror's loaded version holds, by its commits: `known` (an earlier version's, e.g. the
    catalog's record) with the claims of the commits after it, read alone; the whole log without it (or
    when the commits after it are no longer in the log). None for a mirror with no commit in its log."""
    version = table.version()
    if known is None or known.version > version:
        versions = mirror_versions(table)
        return versions[-1] if versions else None
    if known.version == version:
        return known
    commits = sorted(table.history(version - known.version), key=lambda commit: commit["version"])
    if not commits or commits[0]["version"] != known.version + 1:
        return latest_mirror_version(table, None)
    found = recorded_bases(table)
    complete, newest = known.complete_ts, known.newest_ts
    for commit in commits:
        complete = max(complete, int(commit.get(COMPLETE_TS, 0)), found.get(commit["version"], 0))
        newest = _newest(newest, commit)
    return MirrorVersion(version, complete, newest)


def recorded_bases(table: DeltaTable) -> dict[int, int]:
    """Per mirror version, a TSO `maintain` found it holds every change up to, from the version's app
    transactions and the changelog (`BASES_PROPERTY`): what its commits could not claim when made (a
    short run's commits come before any progress record)."""
    recorded = table.metadata().configuration.get(BASES_PROPERTY)
    pairs = (item.split(":") for item in recorded.split(",")) if recorded else ()
    return {int(version): int(complete) for version, complete in pairs}


def _known(table: DeltaTable) -> MirrorVersion | None:
    recorded = table.metadata().configuration.get(KNOWN_PROPERTY)
    if not recorded:
        return None
    version, complete, newest = recorded.split(":")
    return MirrorVersion(int(version), int(complete), int(newest))


def _newest(before: int | None, commit: Mapping[str, Any]) -> int | None:
    if NEWEST_TS in commit:
        return None if before is None else max(before, int(commit[NEWEST_TS]))
    return None if commit.get("operation") in ROW_OPERATIONS else before


def _target(lake: LakeRoot, as_of_tso: int | None, catalog: Catalog, ddls: list[dict[str, Any]]) -> int:
    point = consistent_ts(lake)
    if as_of_tso is None:
        return LATEST if point is None else point
    earliest, floor = _earliest(lake, catalog, ddls)
    if floor is not None and as_of_tso < floor and point is not None and as_of_tso <= point:
        raise AsOfRetentionError(as_of_tso, floor, point)
    oldest = _oldest(earliest, floor)
    if point is None or oldest is None or not oldest <= as_of_tso <= point:
        raise TsoOutOfRangeError(as_of_tso, oldest, point)
    return as_of_tso


def _oldest(earliest: int | None, floor: int | None) -> int | None:
    return earliest if floor is None else max(floor, earliest or floor)


def _earliest(lake: LakeRoot, catalog: Catalog, ddls: list[dict[str, Any]]) -> tuple[int | None, int | None]:
    """The earliest change retained (a DDL of `ddls`, the logged ones, or a row), and the oldest TSO every
    table answers as of after `maintain` removed older changes (None: it removed none)."""
    starts = [row["commit_ts"] for row in ddls[:1]]
    floors = []
    for entry in catalog.entries():
        changelog = lake.open(entry_uri(lake, entry, "changelog"))
        if changelog is None:
            continue
        smallest, readable = by_version(changelog, "retained", lambda t: _retained_from(lake, t))
        starts.extend([] if smallest is None else [smallest])
        floors.extend([] if readable is None else [readable])
    return min(starts, default=None), max(floors, default=None)


def _retained_from(lake: LakeRoot, changelog: DeltaTable) -> tuple[int | None, int | None]:
    """The changelog's smallest commit ts (None: no rows), from the files' statistics or their `_commit_ts`
    column where a file has none; and the oldest TSO it answers as of, when `maintain` recorded one."""
    readable = changelog.metadata().configuration.get(READABLE_FROM)
    floor = int(readable) if readable else None
    if not changelog.file_uris():
        return None, floor
    actions = pa.table(changelog.get_add_actions(flatten=True))
    column = "min._commit_ts"
    if column in actions.column_names and not actions[column].null_count:
        return int(pc.min(actions[column]).as_py()), floor
    return int(pc.min(lake.scan(changelog).to_table(columns=["_commit_ts"])["_commit_ts"]).as_py()), floor


# -- a table as of a TSO -------------------------------------------------------------------------------
def _mirror_at(
    lake: LakeRoot, entry: CatalogEntry, tso: int, ddl_log: list[dict[str, Any]]
) -> pa.Table | None:
    """The table's rows as of `tso` (`ddl_log`: the DDL log's rows); None for a table without a key (a
    changelog, no mirror)."""
    ddls = [row for row in ddl_log if row["commit_ts"] <= tso and _concerns(entry, row)]
    logged = next((table_schema(r["schema"]) for r in reversed(ddls) if r["schema"] is not None), None)
    mirror = lake.open(entry_uri(lake, entry, "mirror"))
    changelog = lake.open(entry_uri(lake, entry, "changelog"))
    stored = [pa.schema(t.schema().to_arrow()) for t in (mirror, changelog) if t is not None]
    key = _key(mirror, logged)
    if not key and mirror is not None:  # not a mirror this SDK keeps: as written
        return read_delta(lake, mirror)
    if not key and changelog is not None:
        return None
    names = _user_columns(logged if logged is not None else mirror and pa.schema(mirror.schema().to_arrow()))
    schema = _output_schema(names, [*stored, *([logged] if logged is not None else [])])
    base, latest = _base_and_changes(lake, mirror, changelog, tso, schema, key)
    floor = max([r["commit_ts"] for r in ddls if r["type"] == "TRUNCATE"], default=0)
    if entry.truncated_ts is not None and entry.truncated_ts <= tso:
        floor = max(floor, entry.truncated_ts)
    rows = _applied(schema, base, latest, key, floor)
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


def _base_and_changes(
    lake: LakeRoot,
    mirror: DeltaTable | None,
    changelog: DeltaTable | None,
    tso: int,
    schema: pa.Schema,
    key: list[str],
) -> tuple[pa.Table | None, Latest]:
    """The base (`_base`) and the changelog's changes after it up to `tso` (`_changes`), each key's latest
    picked (`_latest`), at once: the changes on a thread of their own, after the first version `_base`
    tries (read again in the rare case it could not read that one)."""
    tries = [] if mirror is None else _tries(mirror, tso, changelog)
    if changelog is None:
        base = None if mirror is None else _base(lake, mirror, tso, tries, None)[0]
        return base, _latest(None, schema, key)
    expected = tries[0].complete_ts or -1 if tries else -1
    window = _workers().submit(lambda: _latest(_changes(lake, changelog, expected, tso, schema), schema, key))
    try:
        base, since = (None, -1) if mirror is None else _base(lake, mirror, tso, tries, changelog)
    finally:
        latest = window.result()
    if since != expected:
        latest = _latest(_changes(lake, changelog, since, tso, schema), schema, key)
    return base, latest


def _tries(mirror: DeltaTable, tso: int, changelog: DeltaTable | None) -> list[MirrorVersion]:
    """The mirror versions an as-of read may start from, newest first: those holding no change after `tso`
    and every change the changelog no longer holds (`RETAINED_AFTER`). With the whole changelog only the
    newest: a full replay is as exact as an older version."""
    retained = _retained(changelog)
    usable = [
        v
        for v in by_version(mirror, "mirror versions", mirror_versions)  # history: a read per commit
        if v.newest_ts is not None and v.newest_ts <= tso and v.complete_ts >= retained
    ]
    return list(reversed(usable if retained >= 0 else usable[-1:]))


def _retained(changelog: DeltaTable | None) -> int:
    return -1 if changelog is None else int(changelog.metadata().configuration.get(RETAINED_AFTER, -1))


def _base(
    lake: LakeRoot, mirror: DeltaTable, tso: int, tries: list[MirrorVersion], changelog: DeltaTable | None
) -> tuple[pa.Table | None, int]:
    """The first of the mirror versions `tries` it can read, and a TSO it holds every change up to (-1:
    none; the changelog is replayed whole). A version vacuumed away is passed over for an older one once
    the changelog lost older changes (else the changelog is replayed whole). Without a changelog (a
    mirror-only sink) and no such version: the mirror as it is. Raises AsOfRetentionError when the
    changelog lost changes no readable version holds."""
    if not tries and changelog is None:
        return lake.scan(mirror).to_table(), LATEST
    for chosen in tries:
        try:
            table = mirror
            if chosen.version != mirror.version():
                table = DeltaTable(mirror.table_uri, version=chosen.version, storage_options=lake.options())
            return lake.scan(table).to_table(), chosen.complete_ts or -1
        except (OSError, DeltaError):
            continue
    retained = _retained(changelog)
    if retained >= 0:
        assert changelog is not None
        oldest = int(changelog.metadata().configuration.get(READABLE_FROM, retained))
        raise AsOfRetentionError(tso, oldest, consistent_ts(lake))
    return None, -1


def _changes(lake: LakeRoot, changelog: DeltaTable, since: int, tso: int, schema: pa.Schema) -> pa.Table:
    """The changelog's rows in (since, tso], only the columns the read gives and orders changes by. Decoded
    on the calling thread: beside the base's read on Arrow's threads, a thread more on the cores."""
    files, within = _window_files(changelog, since, tso)
    dataset = lake.scan(changelog, files)
    wanted = [*schema.names, *(f.name for f in ORDER)]
    ts = pc.field("_commit_ts")
    return dataset.to_table(
        columns=[name for name in wanted if name in dataset.schema.names],
        filter=None if within else (ts > since) & (ts <= tso),
        use_threads=False,
    )


def _window_files(changelog: DeltaTable, since: int, tso: int) -> tuple[list[str], bool]:
    """The changelog's files that may hold changes in (since, tso], by the commit ts bounds the Delta log
    records for each (no file footer read), and whether those bounds put all of them inside it: filtering
    rows copies every column, for nothing when the window holds whole files (a tail after the base)."""
    files = changelog.file_uris()
    actions = pa.table(changelog.get_add_actions(flatten=True))
    if not {"min._commit_ts", "max._commit_ts"} <= set(actions.column_names):
        return files, False
    low, high = actions["min._commit_ts"], actions["max._commit_ts"]
    outside = pc.fill_null(pc.or_(pc.less_equal(high, since), pc.greater(low, tso)), False)
    inside = pc.fill_null(pc.and_(pc.greater(low, since), pc.less_equal(high, tso)), False)
    kept = pc.invert(outside)
    within = bool(pc.all(inside.filter(kept)).as_py())
    names = {path.rsplit("/", 1)[-1] for path in actions["path"].filter(kept).to_pylist()}
    return [uri for uri in files if uri.rsplit("/", 1)[-1] in names], within  # names: unique, not encoded


def _output_schema(names: Sequence[str], sources: Sequence[pa.Schema]) -> pa.Schema:
    """The user columns `names` then the mirror's own, each typed as the first source having it types it
    (the mirror's bookkeeping columns as int64 where no table exists yet)."""
    meta = pa.schema([pa.field(name, pa.int64(), nullable=False) for name in MIRROR_META])
    fields = []
    for name in [*names, *MIRROR_META]:
        fields.append(next(s.field(name) for s in [*sources, meta] if name in s.names))
    return pa.schema(fields)


@dataclass(frozen=True)
class Winners:
    """Each key's latest change in a window with one integer key column, in key order (`_latest_rows`):
    their row numbers in the window, their rows in the output's columns, taken once (on the window's
    thread, beside the base's read), and their keys, commit ts and whether each upserts, as numpy, which
    place them in the base."""

    picked: np.ndarray
    rows: pa.Table
    keys: np.ndarray
    commit_ts: np.ndarray
    upsert: np.ndarray

    @classmethod
    def of(cls, changes: pa.Table, picked: np.ndarray, key: str, columns: list[str]) -> Winners:
        rows = changes.select(columns).take(pa.array(picked))
        upsert = pc.not_equal(changes["_change_type"], "delete").to_numpy(zero_copy_only=False)[picked]
        return cls(picked, rows, _numpy(rows[key]), _numpy(rows["_commit_ts"]), upsert)

    def slice(self, start: int, stop: int) -> Winners:
        return Winners(
            self.picked[start:stop],
            self.rows.slice(start, stop - start),
            self.keys[start:stop],
            self.commit_ts[start:stop],
            self.upsert[start:stop],
        )


Latest = tuple[pa.Table, Winners | None]  # a window's changes, and each key's latest when `Winners` fits


def _latest(window: pa.Table | None, schema: pa.Schema, key: list[str]) -> Latest:
    """The window's changes conformed to `schema` and, for one integer key column, each key's latest
    change (`Winners`): None for other keys, `latest_per_key` picks theirs."""
    changes = _conformed(window if window is not None else schema.empty_table(), schema)
    one = len(key) == 1 and pa.types.is_integer(changes.schema.field(key[0]).type)
    if not one or changes[key[0]].null_count:
        return changes, None
    return changes, Winners.of(changes, _latest_rows(changes, key[0]), key[0], schema.names)


def _applied(
    schema: pa.Schema, base: pa.Table | None, latest: Latest, key: list[str], floor: int
) -> pa.Table:
    """The base's rows with the window's changes (as `_latest` gives them) applied, in key order: each
    key's latest image wins (base rows first at an equal commit ts), deletes remove, and nothing older
    than the last TRUNCATE (`floor`) stays. Only the window's keys are ordered: the base holds one row per
    key, kept unless a change of its key is as new or newer."""
    rows = _shaped(base if base is not None else schema.empty_table(), schema)
    changes, winners = latest
    if not rows.num_rows and not changes.num_rows:
        return schema.empty_table()
    parts = None if winners is None else _parts_in_key_order(rows, key[0])
    if parts is not None and winners is not None:
        return _merged_in_order(parts, winners, floor)
    if winners is not None:
        return _sorted_merge(rows, changes.take(pa.array(winners.picked)), key, floor)
    return _sorted_merge(rows, latest_per_key(changes, key) if changes.num_rows else changes, key, floor)


Part = tuple[pa.Table, np.ndarray]  # a piece of the base (batches as read), and its keys
PART_ROWS = 2**16  # the fewest rows a part of the base has (but the last): fewer calls, still in cache


def _parts_in_key_order(rows: pa.Table, key: str) -> list[Part] | None:
    """The rows as read, in parts of consecutive batches (not copied), with their keys, when the key
    column is an integer one in strictly increasing order over all of them (a clustered mirror, or none);
    else None."""
    if not pa.types.is_integer(rows.schema.field(key).type) or rows[key].null_count:
        return None
    tables = [pa.Table.from_batches(batches) for batches in _grouped(rows.to_batches())] or [rows]
    parts = [(table, _numpy(table[key])) for table in tables]
    if not all(bool(np.all(keys[1:] > keys[:-1])) for _, keys in parts):
        return None
    return parts if all(before[-1] < after[0] for (_, before), (_, after) in pairwise(parts)) else None


def _grouped(batches: list[pa.RecordBatch]) -> list[list[pa.RecordBatch]]:
    """The non-empty batches, consecutive ones together until they hold PART_ROWS rows."""
    groups: list[list[pa.RecordBatch]] = [[]]
    rows = 0  # in the last group
    for batch in (batch for batch in batches if batch.num_rows):
        if rows >= PART_ROWS:
            groups.append([])
            rows = 0
        groups[-1].append(batch)
        rows += batch.num_rows
    return groups if groups[0] else []


def _numpy(column: pa.ChunkedArray) -> np.ndarray:
    """A column as numpy: its one chunk's buffer, not copied (no nulls), else its chunks joined."""
    return column.chunk(0).to_numpy(zero_copy_only=False) if column.num_chunks == 1 else column.to_numpy()


def _merged_in_order(parts: list[Part], winners: Winners, floor: int) -> pa.Table:
    """`_applied` for a base in key order, in its parts as read: each key's latest change finds its place
    by binary search in the part whose key range holds it (the base is neither joined nor sorted); a part
    no change touches is kept as it is, any other rebuilt by one take of its rows and its changes (a few
    MiB, in cache: a take of the whole base would first copy all of it to fresh memory). Runs of parts are
    merged on threads, one a core (numpy and Arrow release the GIL)."""
    firsts = [int(keys[0]) for _, keys in parts[1:]]
    cuts = [0, *np.searchsorted(winners.keys, firsts).tolist(), winners.keys.size]

    def merged(run: range) -> list[pa.Table]:
        return [_placed(*parts[i], winners.slice(cuts[i], cuts[i + 1]), floor) for i in run]

    first, *others = _runs([table.num_rows for table, _ in parts])
    rest = [_workers().submit(merged, run) for run in others]
    return pa.concat_tables([*merged(first), *(table for run in rest for table in run.result())])


def _runs(sizes: list[int]) -> list[range]:
    """Consecutive runs of the parts (of `sizes` rows), about as many rows each, one a core (one run for
    a small base)."""
    ends = np.cumsum(sizes)
    count = max(1, min(os.cpu_count() or 1, int(ends[-1]) // PART_ROWS))
    targets = [int(ends[-1]) * run // count for run in range(1, count)]
    bounds = [0, *np.searchsorted(ends, targets, side="right").tolist(), len(sizes)]
    return [range(start, stop) for start, stop in pairwise(bounds)]


def _placed(rows: pa.Table, stored: np.ndarray, winners: Winners, floor: int) -> pa.Table:
    """`rows` (keys `stored`) with the `winners` of their key range applied: as they are when none touches
    them (nor is any row older than `floor`), else the rows kept and the changes added, in key order."""
    stored_ts = _numpy(rows["_commit_ts"])
    at = np.searchsorted(stored, winners.keys)
    found, base_loses = _met(stored, stored_ts, at, winners.keys, winners.commit_ts)
    older, replaced = np.flatnonzero(stored_ts < floor), at[base_loses]  # both sorted
    gone = np.union1d(older, replaced) if older.size else replaced
    added = np.flatnonzero((~found | base_loses) & winners.upsert & (winners.commit_ts >= floor))
    if not gone.size and not added.size:
        return rows
    order = _order(gone, at[added] - np.searchsorted(gone, at[added]), stored.size + added, stored.size)
    taken = pa.concat_tables([rows, winners.rows])
    if order.size and not 0 <= order.min() <= order.max() < taken.num_rows:
        raise AssertionError(f"take order out of bounds: {order.min()}..{order.max()}")
    return pc.take(taken, pa.array(order), boundscheck=False)  # checked once here, not for every column


def _met(
    stored: np.ndarray, stored_ts: np.ndarray, at: np.ndarray, keys: np.ndarray, change_ts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Which changes (`keys`, placed at `at` in `stored`) find a base row of their key, and which are at
    least as new as it (the base row loses)."""
    if not stored.size:
        return np.zeros(keys.size, dtype=bool), np.zeros(keys.size, dtype=bool)
    near = np.minimum(at, stored.size - 1)
    found = stored[near] == keys
    return found, found & (change_ts >= stored_ts[near])


def _order(gone: np.ndarray, before: np.ndarray, appended: np.ndarray, size: int) -> np.ndarray:
    """The rows of a part of `size` rows to take, counted from its first: all but those `gone`, in order,
    with the changes added (`appended`: their rows in the table taken, after the part's, in key order)
    each where `before` (the part's rows kept ahead of it) and the changes before it put it. In Arrow's
    memory pool, which keeps its pages for the next read: fresh pages from the system cost more than
    filling them."""
    keep = np.ones(size, dtype=bool)
    keep[gone] = False
    kept = np.flatnonzero(keep)
    places = before + np.arange(before.size)  # the changes' places among the rows taken
    order = np.frombuffer(pa.allocate_buffer((kept.size + places.size) * 8), dtype=np.int64)
    slots = np.ones(order.size, dtype=bool)
    slots[places] = False
    order[slots] = kept
    order[places] = appended
    return order


def _sorted_merge(rows: pa.Table, latest: pa.Table, key: list[str], floor: int) -> pa.Table:
    """`_applied` for any base: a hash join on the changed keys picks base row or change, then one sort."""
    if rows.num_rows and latest.num_rows:
        rows, latest = _newest_of(rows, latest, key)
    upserts = latest.filter(pc.not_equal(latest["_change_type"], "delete")).select(rows.column_names)
    merged = pa.concat_tables([rows, upserts])
    merged = merged.filter(pc.greater_equal(merged["_commit_ts"], floor))
    return merged.take(pc.sort_indices(merged, [(name, "ascending") for name in key]))


def _newest_of(base: pa.Table, latest: pa.Table, key: list[str]) -> tuple[pa.Table, pa.Table]:
    """The base rows no change of their key is as new as, and the changes (one per key) at least as new as
    the base row of their key (or of a key it lacks). One inner hash join, built on the changes (the
    smaller side); Arrow joins carry no nested columns, so only keys, commit ts and row numbers are
    joined."""
    stored = base.select([*key, "_commit_ts"]).rename_columns([*key, "_base_ts"])
    stored = stored.append_column("_base_row", pa.array(np.arange(base.num_rows), pa.int64()))
    changed = latest.select([*key, "_commit_ts"]).rename_columns([*key, "_change_ts"])
    changed = changed.append_column("_change_row", pa.array(np.arange(latest.num_rows), pa.int64()))
    both = stored.join(changed, key, join_type="inner")
    base_loses = pc.greater_equal(both["_change_ts"], both["_base_ts"])
    kept = np.ones(base.num_rows, dtype=bool)
    kept[both.filter(base_loses)["_base_row"].to_numpy()] = False
    newer = np.ones(latest.num_rows, dtype=bool)
    newer[both.filter(pc.invert(base_loses))["_change_row"].to_numpy()] = False
    return base.filter(pa.array(kept)), latest.filter(pa.array(newer))


def _shaped(part: pa.Table, schema: pa.Schema) -> pa.Table:
    """`part` with exactly `schema`'s columns, all nullable (null where it lacks one)."""
    columns = [
        part[f.name].cast(f.type) if f.name in part.column_names else pa.nulls(part.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(columns, schema=pa.schema([f.with_nullable(True) for f in schema]))


def _conformed(part: pa.Table, schema: pa.Schema) -> pa.Table:
    """`part` with `schema`'s columns (null where it lacks one) and its ordering columns."""
    return _shaped(part, pa.schema([*schema, *ORDER]))


def latest_per_key(changelog: pa.Table, key_columns: Sequence[str]) -> pa.Table:
    """Each key's last change in the batch by (commit_ts, partition, offset); preimages never win.

    The result is what a mirror MERGE needs: one source row per key (delta-rs rejects duplicates), with
    `_change_type` telling upsert from delete. Only the key and ordering columns are sorted (unless already
    in order) and grouped; the whole rows are taken once, the winners.
    """
    keys = list(key_columns)
    ranked = _images_in_change_order(changelog, keys).select([*keys, "_row"])
    ranked = ranked.append_column("_position", pa.array(np.arange(ranked.num_rows), pa.int64()))
    last = ranked.group_by(keys, use_threads=False).aggregate([("_position", "max")])
    return changelog.take(ranked["_row"].take(last["_position_max"]))


def _latest_rows(changes: pa.Table, key: str) -> np.ndarray:
    """The row numbers of each key's last change, in key order, as `latest_per_key` picks them: for one
    integer key column a numpy argsort of the keys and a maximum per run of equal keys replace the hash
    grouping and the take (`Winners.of` takes the rows once)."""
    images = _images_in_change_order(changes, [key])
    if not images.num_rows:
        return np.empty(0, dtype=np.int64)
    keys = images[key].to_numpy()
    by_key = np.argsort(keys)
    in_order = keys[by_key]
    starts = np.flatnonzero(np.concatenate([[True], in_order[1:] != in_order[:-1]]))
    return images["_row"].to_numpy()[np.maximum.reduceat(by_key, starts)]


def _images_in_change_order(changelog: pa.Table, keys: list[str]) -> pa.Table:
    """The changelog's images (preimages never win) as their `keys` and row numbers (`_row`), in change
    order: by (commit ts, partition, offset), then change type descending. Not sorted when the changelog
    reads back in change order already."""
    narrow = changelog.select([*keys, *(f.name for f in ORDER), "_commit_ts"])
    narrow = narrow.append_column("_row", pa.array(np.arange(changelog.num_rows), pa.int64()))
    images = narrow.filter(pc.not_equal(narrow["_change_type"], "update_preimage"))
    if _in_change_order(images):
        return images
    order = [("_commit_ts", "ascending"), ("_partition", "ascending"), ("_offset", "ascending")]
    return images.take(pc.sort_indices(images, [*order, ("_change_type", "descending")]))


def _in_change_order(images: pa.Table) -> bool:
    """Whether the images are in strictly increasing (commit ts, partition, offset) order, as a changelog
    written in order reads back: no two tie, so sorting them would change nothing."""
    columns = [images[name] for name in ("_commit_ts", "_partition", "_offset")]
    if any(column.null_count for column in columns):
        return False
    ts, partition, offset = (np.diff(column.to_numpy().astype(np.int64)) for column in columns)
    return bool(np.all((ts > 0) | ((ts == 0) & ((partition > 0) | ((partition == 0) & (offset > 0))))))


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
    as_of_tso: int | None = None,
) -> pa.Table | None:
    """Every version of the live table `database.table`'s rows (of the row with `key`, column -> value,
    when given), ordered by key then by when each became valid; None when the table has no history.

    With `as_of_tso=T`: the history as it stood once every change with commit ts <= T was applied, of the
    table that had the name at T (renamed or dropped since: still found): the versions valid from T or
    earlier, a version still valid at T open (`_valid_to_ts` null, whatever ended it later), and the
    columns the table had at some TSO <= T (a column added later left out; one dropped by then kept, as
    the history keeps it). Raises TsoOutOfRangeError for a T outside `retained_range(root)`.
    """
    lake = LakeRoot.of(root, storage_options)
    catalog = Catalog(lake)
    if as_of_tso is None:
        tso, entry = LATEST, catalog.current((database, table))
    else:
        tso = _target(lake, as_of_tso, catalog, DDLLog(lake).rows())
        entry = catalog.find((database, table), tso)
    history = None if entry is None else lake.open(entry_uri(lake, entry, "history"))
    if history is None or entry is None:
        return None
    started = None if as_of_tso is None else pc.field("_valid_from_ts") <= tso
    schema = pa.schema(history.schema().to_arrow())
    versions = as_durations(lake.scan(history).to_table(filter=started), stored_durations(schema))
    if as_of_tso is not None:
        versions = _history_at(lake, entry, versions, tso)
    for column, value in (key or {}).items():
        versions = versions.filter(
            pc.equal(versions[column], pa.scalar(value, versions.schema.field(column).type))
        )
    keys = history.metadata().configuration.get(KEY_PROPERTY, "").split(",")
    order = [*(k for k in keys if k), "_valid_from_ts", "_partition", "_offset"]
    return versions.take(pc.sort_indices(versions, [(name, "ascending") for name in order]))


def _history_at(lake: LakeRoot, entry: CatalogEntry, versions: pa.Table, tso: int) -> pa.Table:
    """Versions valid from `tso` or earlier (`versions` holds no other) as known at `tso`: an end after it
    was not known yet (null), and only the columns the table had by then."""
    ends = versions["_valid_to_ts"]
    index = versions.column_names.index("_valid_to_ts")
    later = pc.fill_null(pc.greater(ends, tso), False)
    known = pc.if_else(later, pa.scalar(None, pa.int64()), ends)
    versions = versions.set_column(index, versions.schema.field(index), known)
    logged = [
        schema
        for row in DDLLog(lake).rows()
        if row["commit_ts"] <= tso and _concerns(entry, row) and (schema := table_schema(row["schema"]))
    ]
    if not logged:  # no DDL says which columns it had: every column the history has
        return versions
    had = {name for schema in logged for name in schema.names}
    later_columns = [name for name in versions.column_names if name not in had and name not in HISTORY_META]
    return versions.drop_columns(later_columns)


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
