"""The catalog: which directory holds which upstream table, and what happened to the table, kept in the lake.

`<root>/_catalog` is a small Delta table with one row per upstream table (an incarnation: a table dropped
and created again gets a new row):

    location       its directory under the root, e.g. `shop/orders`; it never changes, RENAME included
    database       current name
    table          current name
    created_ts     commit ts from which it holds its first name (0: before the consumer first saw it)
    dropped_ts     the DROP TABLE's commit ts; null while the table is live
    truncated_ts   the latest TRUNCATE's commit ts
    names          every name it had: list of {since_ts, database, table}, oldest first
    updated_at     when this row last changed
    ready          its Delta tables hold a first commit; false between the catalog commit and that commit (a
                   run stopped there leaves a location with no table yet: read it as empty); null: written
                   before the flag existed
    mirror_version   a version of its mirror, with what that version's commits claim it holds:
    mirror_ts        every change up to this TSO (so does every later version: a lower bound)
    mirror_newest_ts no change after this one (null: unknown); when <= mirror_ts, the mirror at
                     mirror_version is the table exactly as of mirror_ts (a lazy mirror's MERGE is)
The three are null until a member records them: once per progress record, for the mirrors it committed to
since (not once per MERGE), so they may lag the mirror's commits, never claim more than they do.

The Delta tables of a row live at `<root>/<location>/changelog` and `<root>/<location>/mirror`. Any Delta
reader finds a live table's location with `SELECT location, ready FROM <root>/_catalog WHERE database = 'shop'
AND "table" = 'orders' AND dropped_ts IS NULL` (`ready` false: no rows yet, its Delta tables may not exist).

Every change is an optimistic Delta commit that rewrites the (small) table and carries the app transaction
`ticdc-catalog` with the next version: two writers changing the catalog at once conflict, and the loser
re-reads the catalog and applies its change again (each change is idempotent), so members on different
machines agree without any lock. Rows of a table are found by their name *and* commit ts, so a member
behind a RENAME or a DROP still writes its older rows to the table they belong to. A row's mirror record
only moves to a later mirror version, so members recording what their mirrors hold never undo each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, TypeVar

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from consumer.errors import SinkError
from consumer.lakehouse.layout import segment
from consumer.lakehouse.storage import LakeRoot, by_version, retry_commits

CATALOG = "_catalog"
CATALOG_APP = "ticdc-catalog"  # app transaction every catalog commit sets: concurrent changes conflict
Name = tuple[str, str]  # (database, table)
Result = TypeVar("Result")

_NAME = pa.struct(
    [
        pa.field("since_ts", pa.int64(), nullable=False),
        pa.field("database", pa.string(), nullable=False),
        pa.field("table", pa.string(), nullable=False),
    ]
)
CATALOG_SCHEMA = pa.schema(
    [
        pa.field("location", pa.string(), nullable=False),
        pa.field("database", pa.string(), nullable=False),
        pa.field("table", pa.string(), nullable=False),
        pa.field("created_ts", pa.int64(), nullable=False),
        pa.field("dropped_ts", pa.int64()),
        pa.field("truncated_ts", pa.int64()),
        pa.field("names", pa.list_(pa.field("element", _NAME, nullable=False)), nullable=False),
        pa.field("updated_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("ready", pa.bool_()),
        pa.field("mirror_version", pa.int64()),  # added later: a catalog gains them on its next commit
        pa.field("mirror_ts", pa.int64()),
        pa.field("mirror_newest_ts", pa.int64()),
    ]
)


@dataclass(frozen=True)
class MirrorVersion:
    """Which changes a mirror version holds: every one up to `complete_ts` and none after `newest_ts`
    (None: unknown, a commit without the metadata changed rows); it is exact at any TSO between them."""

    version: int
    complete_ts: int
    newest_ts: int | None

    @property
    def exact(self) -> bool:
        """Whether the version is the table exactly as of `complete_ts`."""
        return self.newest_ts is not None and self.newest_ts <= self.complete_ts


@dataclass(frozen=True)
class NamePeriod:
    since_ts: int
    database: str
    table: str

    @property
    def name(self) -> Name:
        return self.database, self.table


@dataclass(frozen=True)
class CatalogEntry:
    """One upstream table incarnation: where it lives and its history."""

    location: str
    names: tuple[NamePeriod, ...]
    dropped_ts: int | None = None
    truncated_ts: int | None = None
    updated_at: datetime | None = None  # None: changed now, not committed yet
    ready: bool = True  # False until a sink's first commit to its Delta tables (see the module doc)
    mirror: MirrorVersion | None = None  # what a version of its mirror holds, as last recorded

    @property
    def name(self) -> Name:
        return self.names[-1].name

    @property
    def created_ts(self) -> int:
        return self.names[0].since_ts

    @property
    def live(self) -> bool:
        return self.dropped_ts is None

    @property
    def floor(self) -> int:
        """Changes older than this no longer belong in the mirror (a TRUNCATE or DROP came after them)."""
        return max(self.truncated_ts or 0, self.dropped_ts or 0)

    def name_at(self, commit_ts: int) -> Name | None:
        """The table's name for a change at `commit_ts`; None if the table did not exist then."""
        if commit_ts < self.created_ts or (self.dropped_ts is not None and commit_ts >= self.dropped_ts):
            return None
        return next(p.name for p in reversed(self.names) if p.since_ts <= commit_ts)

    def ends_of(self, name: Name) -> list[int]:
        """When each period of the table under `name` ended (a RENAME away, or the DROP)."""
        ends = [*(p.since_ts for p in self.names[1:]), self.dropped_ts]
        return [
            end
            for period, end in zip(self.names, ends, strict=True)
            if period.name == name and end is not None
        ]


class Catalog:
    """The catalog of one root, cached: locations never change, so a stale cache only misses tables
    (then it reloads); every change re-reads the table inside its commit attempt."""

    def __init__(self, root: LakeRoot) -> None:
        self.root = root
        self.uri = root.join(CATALOG)
        self._entries: list[CatalogEntry] | None = None

    def entries(self) -> list[CatalogEntry]:
        return self.refresh() if self._entries is None else self._entries

    def refresh(self) -> list[CatalogEntry]:
        table = self.root.open(self.uri)
        read = () if table is None else by_version(table, "catalog", lambda t: tuple(_read(self.root, t)))
        self._entries = list(read)
        return self._entries

    def find(self, name: Name, commit_ts: int) -> CatalogEntry | None:
        """The table holding `name`'s changes at `commit_ts`, from the cache."""
        return _holding(self.entries(), name, commit_ts)

    def current(self, name: Name) -> CatalogEntry | None:
        """The live table called `name` now (what readers want)."""
        live = [e for e in self.entries() if e.live and e.name == name]
        return max(live, key=lambda e: e.created_ts) if live else None

    def locate(self, name: Name, commit_ts: int) -> CatalogEntry:
        """The table `name`'s changes at `commit_ts` go to, registering it on first sight."""
        found = self.find(name, commit_ts)
        if found is None:
            self.refresh()
            found = self.find(name, commit_ts) or self._register(name, commit_ts, since=None)
        return found

    # -- changes -----------------------------------------------------------------------------------
    def create(self, name: Name, commit_ts: int) -> CatalogEntry:
        """CREATE TABLE: a new table from `commit_ts`, unless one already holds the name then (created by
        another member, or registered from rows seen before the CREATE)."""
        return self._register(name, commit_ts, since=commit_ts)

    def rename(self, old: Name, new: Name, commit_ts: int) -> CatalogEntry:
        def change(entries: list[CatalogEntry]) -> tuple[list[CatalogEntry] | None, CatalogEntry]:
            done = _holding(entries, new, commit_ts)
            if done is not None and any(p.since_ts == commit_ts and p.name == new for p in done.names):
                return None, done  # applied already
            if done is not None:
                raise SinkError(
                    f"RENAME {old[0]}.{old[1]} to {new[0]}.{new[1]}: "
                    f"{done.location} already holds a live table of that name"
                )
            entry = _holding(entries, old, commit_ts - 1)
            if entry is None:  # never seen: rows of the old name may still come
                entry = _new_entry(entries, old, _start(entries, old, commit_ts))
                entries = [*entries, entry]
            renamed = replace(entry, names=(*entry.names, NamePeriod(commit_ts, *new)), updated_at=None)
            return _replaced(entries, entry, renamed), renamed

        return self._change(f"catalog: RENAME {old} to {new}", change)

    def mark_ready(self, entry: CatalogEntry) -> CatalogEntry:
        """Record that the table's first rows are committed, so readers stop treating it as half-made."""

        def change(entries: list[CatalogEntry]) -> tuple[list[CatalogEntry] | None, CatalogEntry]:
            current = next(e for e in entries if e.location == entry.location)
            if current.ready:
                return None, current
            ready = replace(current, ready=True, updated_at=None)
            return _replaced(entries, current, ready), ready

        return self._change(f"catalog: {entry.location} ready", change)

    def record_mirrors(self, versions: Mapping[str, MirrorVersion]) -> None:
        """Record what each mirror (by location) holds at a version, in one commit; a row already at that
        version or a later one (another member's record) keeps its own."""

        def change(entries: list[CatalogEntry]) -> tuple[list[CatalogEntry] | None, None]:
            newer = {
                e.location
                for e in entries
                if e.location in versions
                and (e.mirror is None or e.mirror.version < versions[e.location].version)
            }
            if not newer:
                return None, None
            return [
                replace(e, mirror=versions[e.location], updated_at=None) if e.location in newer else e
                for e in entries
            ], None

        self._change(f"catalog: what {len(versions)} mirrors hold", change)

    def truncate(self, name: Name, commit_ts: int) -> CatalogEntry:
        return self._mark(name, commit_ts, "truncated_ts")

    def drop(self, name: Name, commit_ts: int) -> CatalogEntry:
        return self._mark(name, commit_ts, "dropped_ts")

    def _mark(self, name: Name, commit_ts: int, mark: str) -> CatalogEntry:
        """Record a TRUNCATE or DROP of the table holding `name` just before `commit_ts`."""

        def change(entries: list[CatalogEntry]) -> tuple[list[CatalogEntry] | None, CatalogEntry]:
            entry = _holding(entries, name, commit_ts - 1)
            if entry is None:  # never seen: rows from before it may still come, and must not revive it
                entry = _new_entry(entries, name, _start(entries, name, commit_ts))
                entries = [*entries, entry]
            elif (getattr(entry, mark) or 0) >= commit_ts:
                return None, entry  # applied already
            marked = replace(entry, updated_at=None, **{mark: commit_ts})  # type: ignore[arg-type]  # a field name
            return _replaced(entries, entry, marked), marked

        return self._change(f"catalog: {mark.removesuffix('_ts')} {name} at {commit_ts}", change)

    def _register(self, name: Name, commit_ts: int, *, since: int | None) -> CatalogEntry:
        def change(entries: list[CatalogEntry]) -> tuple[list[CatalogEntry] | None, CatalogEntry]:
            found = _holding(entries, name, commit_ts)
            if found is not None:
                return None, found
            entry = _new_entry(entries, name, _start(entries, name, commit_ts) if since is None else since)
            return [*entries, entry], entry

        return self._change(f"catalog: register {name}", change)

    def _change(
        self,
        what: str,
        change: Callable[[list[CatalogEntry]], tuple[list[CatalogEntry] | None, Result]],
    ) -> Result:
        def attempt() -> Result:
            table = self.root.open(self.uri) or self.root.create(self.uri, CATALOG_SCHEMA)
            entries = _read(self.root, table)
            changed, result = change(entries)
            if changed is not None:
                version = (table.transaction_version(CATALOG_APP) or 0) + 1
                write_deltalake(
                    table,
                    _arrow(changed),
                    mode="overwrite",
                    schema_mode="merge",  # a catalog written before a column (`ready`, ...) gains it
                    commit_properties=CommitProperties(app_transactions=[Transaction(CATALOG_APP, version)]),
                )
            self._entries = changed if changed is not None else entries
            return result

        return retry_commits(what, attempt)


def _holding(entries: Iterable[CatalogEntry], name: Name, commit_ts: int) -> CatalogEntry | None:
    found = [e for e in entries if e.name_at(commit_ts) == name]
    return max(found, key=lambda e: e.created_ts) if found else None


def _start(entries: Iterable[CatalogEntry], name: Name, commit_ts: int) -> int:
    """Where a table first seen at `commit_ts` starts: after the last table that held its name before
    (renamed away or dropped), else at 0 (it existed before the consumer saw it)."""
    ends = [end for e in entries for end in e.ends_of(name) if end <= commit_ts]
    return max(ends, default=0)


def _new_entry(entries: Iterable[CatalogEntry], name: Name, since: int) -> CatalogEntry:
    """A table at `<database>/<table>`, or `<database>/<table>@N` when an earlier table took that."""
    taken = {e.location for e in entries}
    base = f"{segment(name[0])}/{segment(name[1])}"
    location = base
    suffix = 2
    while location in taken:
        location = f"{base}@{suffix}"
        suffix += 1
    return CatalogEntry(location, (NamePeriod(since, *name),), ready=False)


def _replaced(entries: list[CatalogEntry], old: CatalogEntry, new: CatalogEntry) -> list[CatalogEntry]:
    return [new if e.location == old.location else e for e in entries]


def _read(root: LakeRoot, table: DeltaTable) -> list[CatalogEntry]:
    rows = root.scan(table).to_table().to_pylist()
    return [
        CatalogEntry(
            row["location"],
            tuple(NamePeriod(n["since_ts"], n["database"], n["table"]) for n in row["names"]),
            row["dropped_ts"],
            row["truncated_ts"],
            row["updated_at"],
            row.get("ready") is not False,
            _mirror(row),
        )
        for row in sorted(rows, key=lambda r: r["location"])
    ]


def _mirror(row: Mapping[str, Any]) -> MirrorVersion | None:
    """The row's mirror record (None in a catalog written before it, or before any was recorded)."""
    if row.get("mirror_version") is None:
        return None
    return MirrorVersion(row["mirror_version"], row["mirror_ts"], row["mirror_newest_ts"])


def _arrow(entries: list[CatalogEntry]) -> pa.Table:
    now = datetime.now(UTC)
    rows: list[dict[str, Any]] = [
        {
            "location": e.location,
            "database": e.name[0],
            "table": e.name[1],
            "created_ts": e.created_ts,
            "dropped_ts": e.dropped_ts,
            "truncated_ts": e.truncated_ts,
            "names": [{"since_ts": p.since_ts, "database": p.database, "table": p.table} for p in e.names],
            "updated_at": e.updated_at or now,
            "ready": e.ready,
            "mirror_version": None if e.mirror is None else e.mirror.version,
            "mirror_ts": None if e.mirror is None else e.mirror.complete_ts,
            "mirror_newest_ts": None if e.mirror is None else e.mirror.newest_ts,
        }
        for e in entries
    ]
    return pa.Table.from_pylist(rows, schema=CATALOG_SCHEMA)
