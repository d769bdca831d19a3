"""Delta Lake sink (delta-rs): per upstream table an append-only changelog and a mirror of its current rows.

Layout under `root`, a local directory (table discovery and RENAME move directories); database and table
names are escaped to one safe path segment each (`consumer.sinks.layout`):

    <root>/<database>/<table>/changelog   every change image (change-data-feed convention), append only
    <root>/<database>/<table>/mirror      the upstream table's current rows, MERGEd on its key
    <root>/_ddl                           every DDL, once

Exactly-once: each commit carries Delta app transactions with app id `ticdc:<group>:<topic>:<partition>`
and version = the next offset of that partition not yet in this table. A table's rows of one partition are
applied in offset order, so rows of a replayed batch below that version are already there and are dropped.
Each commit also records `ticdc.*` commit metadata (group, resume offsets, resolved ts, schema cache), so
the output itself says where a restarted consumer resumes and how far it is consistent.

Type mapping: MySQL TIME (an Arrow duration, which Delta lacks) is stored as int64 microseconds, marked in
the field's metadata so `live_mirror` and the Spark readers give it back as a duration. User columns are
nullable in Delta, so a dropped column can be null from then on.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import random
import re
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Field, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError

from consumer.batches.changes import META_COLUMNS, TableChanges, latest_per_key, stored_schema
from consumer.errors import SinkError
from consumer.protocol.model import DDL, DDLType
from consumer.protocol.rows import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent, TopicPartition
from consumer.sinks.layout import DDL_LOG, table_dir

log = logging.getLogger(__name__)

Mode = Literal["changelog", "mirror", "both"]

KINDS = ("changelog", "mirror")
MIRROR_META = ("_commit_ts", "_schema_version", "_deleted")
DELETED_FIELD = pa.field("_deleted", pa.bool_())  # null (mirrors from before tombstones) means live
DROPPED_PROPERTY = "ticdc.dropped_at"
TRUNCATED_PROPERTY = "ticdc.truncated_at"
STORED_AS, STORED_DURATION = "ticdc.stored_as", "duration[us]"  # field metadata of a stored TIME column
"""Table property set on both tables of a dropped upstream table: the DROP TABLE's commit ts."""

HISTORY_WINDOW = 32  # newest commits searched for this sink's commit metadata
DIRECTORIES_LOCK = ".ticdc-directories.lock"  # under the root: see `DeltaSink._directories_held`

DDL_LOG_SCHEMA = pa.schema(
    [
        pa.field("commit_ts", pa.int64(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("sql", pa.string(), nullable=False),
        pa.field("database", pa.string()),
        pa.field("table", pa.string()),
        pa.field("schema_version", pa.int64()),
        pa.field("applied_at", pa.timestamp("us", tz="UTC"), nullable=False),
    ]
)


class DeltaSink:
    """Writes each resolved batch to its table's changelog and/or mirror; safe for several writers.

    Writers of the same tables (consumer-group members in other processes) use optimistic concurrency: on
    a commit conflict the table is reloaded, rows another writer already committed are dropped again, and
    the commit is retried with jittered exponential backoff, up to `max_commit_retries` times.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        mode: Mode = "both",
        storage_options: dict[str, str] | None = None,
        max_commit_retries: int = 20,
        retry_backoff: float = 0.05,
    ) -> None:
        text = str(root)
        if "://" in text and not text.startswith("file://"):
            raise SinkError(f"DeltaSink needs a local root directory, not {text!r}")
        self.root = Path(text.removeprefix("file://"))
        self.mode = mode
        self.storage_options = storage_options
        self.max_commit_retries = max_commit_retries
        self.retry_backoff = retry_backoff
        self._warned_keyless: set[tuple[str, str]] = set()
        self._renames: list[tuple[tuple[str, str], tuple[str, str], int]] | None = None
        self._writing: tuple[str, str, int] | None = None  # the rows being written: name and newest commit ts

    # -- Sink ------------------------------------------------------------------------------------------
    def write(self, changes: TableChanges, context: CommitContext) -> None:
        """Rows go to their table's location at their commit ts: another group member may already have
        applied a later RENAME, in which case these (older) rows follow it to the new name."""
        if changes.changelog.num_rows == 0:
            return
        newest = pc.max(changes.changelog["_commit_ts"]).as_py()
        self._following_renames(
            (changes.database, changes.table, newest), lambda path: self._write_at(path, changes, context)
        )

    def _following_renames(self, writing: tuple[str, str, int], apply: Callable[[Path], None]) -> None:
        """Apply a change of a table (name and commit ts) where that table lives now; when another member
        moves it meanwhile (a RENAME), follow it and apply there."""
        self._writing = writing
        try:
            for _ in range(self.max_commit_retries):
                try:
                    with self._directories_held(exclusive=False):
                        apply(self._located(*writing))
                    return
                except _Moved:
                    self._renames = None  # re-read the rename log and follow the table
        finally:
            self._writing = None
        raise SinkError(f"{writing[0]}.{writing[1]}: its directory kept moving while changing it")

    def _write_at(self, table_dir: Path, changes: TableChanges, context: CommitContext) -> None:
        if self.mode in ("changelog", "both"):
            self._append_changelog(table_dir / "changelog", changes.changelog, context)
        if self.mode in ("mirror", "both"):
            if changes.key_columns:
                self._merge_mirror(table_dir / "mirror", changes, context)
            elif (changes.database, changes.table) not in self._warned_keyless:
                self._warned_keyless.add((changes.database, changes.table))
                log.warning(
                    "%s.%s has no primary key or NOT NULL unique index: no mirror, changelog only",
                    changes.database,
                    changes.table,
                )

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        """Apply the DDL's effect on the Delta tables, then append it to `<root>/_ddl` (once).

        - ALTER: columns new in the DDL's schema are added (earlier rows null); columns it no longer has stay
          in Delta (the changelog keeps their history) and are set null in the mirror; a changed type
          (MODIFY COLUMN) keeps the Delta type, since delta-rs cannot widen a column: later values are cast
          to it and a value that does not fit exactly raises SinkError. A type with no cast at all raises now.
        - TRUNCATE: the mirror loses every row older than the DDL.
        - ERASE (DROP TABLE): the mirror is emptied and both tables get the table property
          `ticdc.dropped_at` = the DDL's commit ts (see `dropped_at`). The changelog keeps the history.
        - RENAME: the old name's directory moves to the new name, so later changes continue the same tables.
        - CREATE: a dropped table of the same name moves aside to `<table>@dropped-<ts>`, so the new table
          starts fresh (its schema and key may differ). CINDEX, DINDEX, QUERY: only logged.
        Every step is idempotent, so a replayed DDL (after a crash, or from another member) is harmless.
        """
        ddl = event.ddl
        if event.database and event.table:
            table_dir = self._table_dir(event.database, event.table)
            if ddl.type in (DDLType.ALTER, DDLType.TRUNCATE, DDLType.ERASE):
                where = (event.database, event.table, ddl.commit_ts)  # a later RENAME may have moved it
                self._following_renames(where, lambda path: self._change_table(ddl, path, context))
            elif ddl.type is DDLType.RENAME:
                with self._directories_held(exclusive=True):
                    self._log_ddl(event, context)  # first: writers behind it follow the log to the new name
                    self._rename(event, table_dir)
                self._renames = None
            elif ddl.type is DDLType.CREATE:
                with self._directories_held(exclusive=True):
                    self._retire_dropped(table_dir)
        self._log_ddl(event, context)

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        """Per partition, the highest resume offset any table's latest commit of the group recorded: each
        was a valid resume point when written (everything before it was durable everywhere)."""
        offsets: dict[TopicPartition, int] = {}
        for path in table_paths(self.root):
            info = _latest_info(self._open(path), lambda i: i.get("ticdc.group") == group)
            if info is None:
                continue
            for key, offset in json.loads(info["ticdc.resume_offsets"]).items():
                topic, _, partition = key.rpartition(":")
                tp = (topic, int(partition))
                offsets[tp] = max(offset, offsets.get(tp, offset))
        return offsets

    def recorded_schema_snapshot(self) -> bytes | None:
        """The schema cache of the newest commit (by commit timestamp) across all tables."""
        newest: dict[str, Any] | None = None
        for path in table_paths(self.root):
            info = _latest_info(self._open(path), lambda i: "ticdc.schema_cache" in i)
            if info is not None and (newest is None or info["timestamp"] > newest["timestamp"]):
                newest = info
        return base64.b64decode(newest["ticdc.schema_cache"]) if newest else None

    def close(self) -> None:
        return None

    # -- rows ------------------------------------------------------------------------------------------
    def _append_changelog(self, path: Path, changelog: pa.Table, context: CommitContext) -> None:
        def attempt() -> None:
            table = self._open_or_claim(path)
            pending = _unapplied(changelog, table, context.group)
            if pending.num_rows == 0:
                return
            write_deltalake(
                table if table is not None else str(path),
                _conform(pending, _arrow_schema(table)),
                mode="append",
                schema_mode="merge",
                storage_options=self.storage_options,
                commit_properties=_properties(context, _offset_transactions(pending, context.group)),
            )

        self._commit(f"changelog {path}", attempt)

    def _merge_mirror(self, path: Path, changes: TableChanges, context: CommitContext) -> None:
        """Stale changes (older than the mirror's row) never win; an upsert of a key the mirror lacks inserts
        it (a consumer that joined mid-stream never saw its INSERT).

        A delete leaves a tombstone (`_deleted` true, with its `_commit_ts`) in the same MERGE: a key can move
        to another partition (a RENAME changes the dispatcher's hash), so another group member may still
        apply an older upsert of it later, and it must lose. Readers filter tombstones (`live_mirror`,
        `consumer.spark.readers.read_mirror`); a MERGE that changes nothing commits nothing (delta-rs).
        """
        keys = changes.key_columns
        columns = [*(n for n in changes.changelog.column_names if n not in META_COLUMNS), *MIRROR_META[:-1]]
        schema = pa.schema(
            [*(_storable(field) for field in changes.changelog.select(columns).schema), DELETED_FIELD]
        )

        def attempt() -> None:
            table = self._open_or_claim(path)
            if table is None:  # MERGE needs a table; "ignore": another member may create it first
                DeltaTable.create(str(path), schema, mode="ignore", storage_options=self.storage_options)
                table = DeltaTable(str(path), storage_options=self.storage_options)
            floor = truncated_at(table) or 0  # rows from before a TRUNCATE/DROP another member applied
            pending = _unapplied(changes.changelog, table, context.group)
            pending = pending.filter(pc.greater_equal(pending["_commit_ts"], floor)) if floor else pending
            if pending.num_rows == 0:
                return
            latest = latest_per_key(pending, keys)
            deleted = pc.equal(latest["_change_type"], "delete")
            source = _conform(
                latest.select(columns).append_column(DELETED_FIELD, deleted), _arrow_schema(table)
            )
            # commit ts 0 is "unknown" (an Avro tombstone first on its partition): it came after the row's
            # earlier changes on that partition, so it is never stale
            newer = "s._commit_ts >= t._commit_ts OR s._commit_ts = 0"
            # Explicit column maps: delta-rs's *_all forms do not quote names (a backtick in one breaks them).
            assignments = {_quote(name): f"s.{_quote(name)}" for name in source.column_names}
            (
                table.merge(
                    source,
                    " AND ".join(f"t.{_quote(k)} = s.{_quote(k)}" for k in keys),
                    source_alias="s",
                    target_alias="t",
                    merge_schema=True,
                    commit_properties=_properties(context, _offset_transactions(pending, context.group)),
                )
                .when_matched_update(assignments, newer)
                .when_not_matched_insert(assignments)
                .execute()
            )

        self._commit(f"mirror {path}", attempt)

    # -- DDL -------------------------------------------------------------------------------------------
    def _change_table(self, ddl: DDL, table_dir: Path, context: CommitContext) -> None:
        if ddl.type is DDLType.ALTER:
            if ddl.table_schema is not None:
                self._alter(table_dir, stored_schema(TableCodec(ddl.table_schema)), context)
            return
        self._empty_mirror(table_dir / "mirror", ddl.commit_ts, context)
        if ddl.type is DDLType.ERASE:
            self._mark_dropped(table_dir, ddl.commit_ts, context)

    def _alter(self, table_dir: Path, schema: pa.Schema, context: CommitContext) -> None:
        fields = [_storable(field) for field in schema]
        for kind in KINDS:
            path = table_dir / kind
            self._commit(f"ALTER {path}", lambda path=path: self._evolve(path, fields, context))

    def _evolve(self, path: Path, fields: list[pa.Field], context: CommitContext) -> None:
        table = self._open_or_claim(path)
        if table is None:
            return
        current = _arrow_schema(table)
        assert current is not None
        for field in fields:
            if field.name in current.names and not _castable(field.type, current.field(field.name).type):
                raise SinkError(
                    f"{path}: column {field.name!r} changed to {field.type}, which cannot be stored in its "
                    f"Delta type {current.field(field.name).type}"
                )
        wanted = {field.name for field in fields}
        dropped = [n for n in current.names if n not in wanted and n not in (*META_COLUMNS, *MIRROR_META)]
        if dropped and path.name == "mirror":
            table.update(
                updates={_quote(n): "NULL" for n in dropped},
                predicate=" OR ".join(f"{_quote(n)} IS NOT NULL" for n in dropped),
                commit_properties=_properties(context),
            )
        added = [Field.from_arrow(field) for field in fields if field.name not in current.names]
        if added:
            table.alter.add_columns(added, commit_properties=_properties(context))

    def _empty_mirror(self, path: Path, commit_ts: int, context: CommitContext) -> None:
        """Delete the rows older than the DDL and record it as the mirror's floor: a member still behind
        the DDL must not bring those rows back."""

        def attempt() -> None:
            table = self._open_or_claim(path)
            if table is None:
                return
            table.delete(f"_commit_ts < {commit_ts}", commit_properties=_properties(context))
            if (truncated_at(table) or 0) < commit_ts:
                table.alter.set_table_properties(
                    {TRUNCATED_PROPERTY: str(commit_ts)},
                    raise_if_not_exists=False,
                    commit_properties=_properties(context),
                )

        self._commit(f"emptying {path}", attempt)

    def _mark_dropped(self, table_dir: Path, commit_ts: int, context: CommitContext) -> None:
        for kind in KINDS:
            path = table_dir / kind

            def attempt(path: Path = path) -> None:
                table = self._open_or_claim(path)
                if table is not None and dropped_at(table) is None:
                    table.alter.set_table_properties(
                        {DROPPED_PROPERTY: str(commit_ts)},
                        raise_if_not_exists=False,
                        commit_properties=_properties(context),
                    )

            self._commit(f"marking {path} dropped", attempt)

    def _rename(self, event: DDLEvent, target: Path) -> None:
        """Delta tables hold only relative file paths, so a moved directory is still the same table."""
        source = self._table_dir(*_renamed_from(event))
        if source == target or not source.exists():
            return  # never written, or already moved (a replay)
        if not self._retire_dropped(target):
            if not source.exists():
                return  # another member applying the same RENAME moved it first
            raise SinkError(f"RENAME to {event.database}.{event.table}: {target} already holds a live table")
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            source.rename(target)
        except OSError:
            if source.exists() or not target.exists():  # else another member moved it first
                raise

    def _retire_dropped(self, table_dir: Path) -> bool:
        """Move a dropped table aside to `<table>@dropped-<ts>` so its name can be reused. False when a live
        table holds the name."""
        if not table_dir.exists():
            return True
        tables = (self._open(table_dir / kind) for kind in KINDS)
        marks = [dropped_at(table) for table in tables if table is not None]
        if not marks or None in marks:
            return False
        with contextlib.suppress(FileNotFoundError):  # another member moved it first
            table_dir.rename(table_dir.with_name(f"{table_dir.name}@dropped-{marks[0]}"))
        return True

    def _log_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        """One row per DDL: its identity is an app transaction, so concurrent members cannot both add it."""
        ddl = event.ddl
        identity = json.dumps([ddl.commit_ts, ddl.type.value, ddl.sql, event.database, event.table])
        app_id = "ticdc-ddl:" + hashlib.sha256(identity.encode()).hexdigest()
        path = self.root / DDL_LOG

        def attempt() -> None:
            table = self._open(path)
            if table is not None and table.transaction_version(app_id) is not None:
                return
            write_deltalake(
                table if table is not None else str(path),
                _ddl_row(event),
                mode="append",
                storage_options=self.storage_options,
                commit_properties=_properties(context, [Transaction(app_id, 1)]),
            )

        self._commit(f"DDL log {path}", attempt)

    # -- plumbing --------------------------------------------------------------------------------------
    def _commit(self, what: str, attempt: Callable[[], None]) -> None:
        """Run `attempt` (which reloads its table and re-checks what is applied) until it commits."""
        for retry in range(self.max_commit_retries + 1):
            try:
                attempt()
                return
            except CommitFailedError as exc:
                if retry == self.max_commit_retries:
                    raise SinkError(f"{what}: still conflicting after {retry + 1} attempts: {exc}") from exc
                delay = min(self.retry_backoff * 2**retry, 2.0)
                log.info("%s: concurrent commit, retrying (%d)", what, retry + 1)
                time.sleep(random.uniform(delay / 2, delay))
            except (DeltaError, OSError, pa.ArrowException) as exc:
                if _vanished(exc):
                    raise _Moved(f"{what}: the table moved: {exc}") from exc
                raise SinkError(f"{what}: {exc}") from exc

    @contextlib.contextmanager
    def _directories_held(self, *, exclusive: bool) -> Iterator[None]:
        """Changes to tables hold their directories shared, moving one (RENAME, retiring a dropped table)
        exclusively, across every member on this file system: a directory moved under a commit in flight
        would re-create the old name around the commit's new file."""
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / DIRECTORIES_LOCK).open("a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            yield

    def _table_dir(self, database: str, table: str) -> Path:
        return table_dir(self.root, database, table)

    def _located(self, database: str, table: str, commit_ts: int) -> Path:
        """Where rows of `database.table` committed at `commit_ts` live now.

        Follow every logged RENAME of that name after them (the name may be reused by a later CREATE, hence
        the ts). A RENAME is logged before its directory moves, so the newest name whose directory exists
        wins; if none exists yet the table is new and is created under the newest name.
        """
        chain = [(database, table)]
        for _ in range(64):  # bounded against a corrupt log
            later = [r for r in self._rename_log() if r[0] == chain[-1] and r[2] > commit_ts]
            if not later:
                break
            chain.append(min(later, key=lambda r: r[2])[1])
        existing = (self._table_dir(*name) for name in reversed(chain))
        return next((path for path in existing if path.is_dir()), self._table_dir(*chain[-1]))

    def _rename_log(self) -> list[tuple[tuple[str, str], tuple[str, str], int]]:
        if self._renames is None:
            log_table = self._open(self.root / DDL_LOG)
            rows = (
                []
                if log_table is None
                else log_table.to_pyarrow_table(
                    columns=["commit_ts", "type", "sql", "database", "table"],
                    filters=[("type", "=", "RENAME")],
                ).to_pylist()
            )
            self._renames = [
                (_renamed_from_sql(r["sql"], r["database"]), (r["database"], r["table"]), r["commit_ts"])
                for r in rows
            ]
        return self._renames

    def _open_or_claim(self, path: Path) -> DeltaTable | None:
        """The table at `path`; None only when it may be created there. If another member renamed it away
        meanwhile, the write restarts at the new location instead of re-creating the old name."""
        table = self._open(path)
        if table is None and self._writing is not None:
            self._renames = None
            if self._located(*self._writing) != path.parent:
                raise _Moved(f"{path}: renamed away by another writer")
        return table

    def _open(self, path: Path) -> DeltaTable | None:
        try:
            return DeltaTable(str(path), storage_options=self.storage_options)
        except TableNotFoundError:
            return None


# -- reading what the sink recorded --------------------------------------------------------------------
def table_paths(root: str | Path, *, include_ddl_log: bool = True) -> list[Path]:
    """Every Delta table this sink's layout has under `root` (including tables moved aside when dropped)."""
    base = Path(root)
    found = [*base.glob("*/*/changelog"), *base.glob("*/*/mirror")]
    if include_ddl_log:
        found.append(base / DDL_LOG)
    return sorted(path for path in found if (path / "_delta_log").is_dir())


class _Moved(SinkError):
    """The table's directory moved (another member applied a RENAME) while we were writing to it."""


def _vanished(exc: Exception) -> bool:
    """Errors delta-rs gives when a table's files move away mid-operation."""
    text = str(exc).lower()
    return isinstance(exc, FileNotFoundError) or "not found" in text or "invalid table version" in text


def live_mirror(path: str | Path, columns: list[str] | None = None) -> pa.Table:
    """A mirror's current rows, typed as decoded (TIME as a duration again), tombstones (`_deleted`) filtered
    out and the column dropped."""
    delta = DeltaTable(str(path))
    tombstones = DELETED_FIELD.name in {f.name for f in delta.schema().fields}
    if columns is not None and tombstones:
        columns = [*columns, DELETED_FIELD.name]
    table = delta.to_pyarrow_table(columns=columns)
    for name in stored_durations(delta):
        if name in table.column_names:
            index = table.column_names.index(name)
            table = table.set_column(index, name, table[name].cast(pa.duration("us")))
    if not tombstones:  # written before tombstones existed
        return table
    live = pc.invert(pc.fill_null(table[DELETED_FIELD.name], False))
    return table.filter(live).drop_columns([DELETED_FIELD.name])


def truncated_at(table: DeltaTable) -> int | None:
    """The commit ts of the latest TRUNCATE/DROP the mirror applied: older rows no longer belong in it."""
    value = table.metadata().configuration.get(TRUNCATED_PROPERTY)
    return int(value) if value else None


def dropped_at(table: DeltaTable) -> int | None:
    """The commit ts of the DROP TABLE that dropped this table, or None while it is live."""
    value = table.metadata().configuration.get(DROPPED_PROPERTY)
    return int(value) if value else None


def consistent_ts(root: str | Path, storage_options: dict[str, str] | None = None) -> int | None:
    """A commit ts the whole output is consistent at: every live table holds every change up to it.

    Each commit records the global resolved ts of the cycle that wrote it, and a cycle applies every change
    resolved by then. So a table whose latest commit recorded ts R holds all its changes up to R (and may be
    complete further: a table without changes in later cycles is not re-committed). The minimum over live
    tables is therefore safe but conservative: an idle table holds it back. Dropped tables do not count.
    With several consumer-group members the latest commit of a table may come from a member ahead of the
    others, so this holds only per writer; a per-member progress record would be needed for more.
    """
    recorded = []
    for path in table_paths(root, include_ddl_log=False):
        table = DeltaTable(str(path), storage_options=storage_options)
        info = _latest_info(table, lambda i: "ticdc.resolved_ts" in i)
        if info is not None and dropped_at(table) is None:
            recorded.append(int(info["ticdc.resolved_ts"]))
    return min(recorded, default=None)


def _latest_info(table: DeltaTable | None, wanted: Callable[[dict[str, Any]], bool]) -> dict[str, Any] | None:
    """The newest of the table's last commits that `wanted` accepts (commits by other tools are skipped)."""
    if table is None:
        return None
    return next((info for info in table.history(HISTORY_WINDOW) if wanted(info)), None)


# -- exactly-once bookkeeping --------------------------------------------------------------------------
def _app_id(group: str, topic: str, partition: int) -> str:
    return f"ticdc:{group}:{topic}:{partition}"


def _next_offsets(changelog: pa.Table) -> dict[TopicPartition, int]:
    """Per partition in the batch, the offset after its last row."""
    last = changelog.group_by(["_topic", "_partition"], use_threads=False).aggregate([("_offset", "max")])
    columns = (last[name].to_pylist() for name in ("_topic", "_partition", "_offset_max"))
    return {(topic, partition): offset + 1 for topic, partition, offset in zip(*columns, strict=True)}


def _offset_transactions(changelog: pa.Table, group: str) -> list[Transaction]:
    return [Transaction(_app_id(group, *tp), version) for tp, version in _next_offsets(changelog).items()]


def _unapplied(changelog: pa.Table, table: DeltaTable | None, group: str) -> pa.Table:
    """The rows not yet committed to `table`: those at or after each partition's recorded version."""
    if table is None:
        return changelog
    applied = None
    for topic, partition in _next_offsets(changelog):
        version = table.transaction_version(_app_id(group, topic, partition))
        if version is None:
            continue
        mine = pc.and_(pc.equal(changelog["_topic"], topic), pc.equal(changelog["_partition"], partition))
        old = pc.and_(mine, pc.less(changelog["_offset"], version))
        applied = old if applied is None else pc.or_(applied, old)
    return changelog if applied is None else changelog.filter(pc.invert(applied))


def _properties(context: CommitContext, transactions: list[Transaction] | None = None) -> CommitProperties:
    """The `ticdc.*` commit metadata every commit carries (the schema cache only when there is one)."""
    metadata = {
        "ticdc.group": context.group,
        "ticdc.resolved_ts": str(context.resolved_ts),
        "ticdc.resume_offsets": json.dumps(
            {f"{topic}:{partition}": offset for (topic, partition), offset in context.resume_offsets.items()},
            sort_keys=True,
        ),
    }
    if context.schema_snapshot:
        metadata["ticdc.schema_cache"] = base64.b64encode(context.schema_snapshot).decode("ascii")
    return CommitProperties(custom_metadata=metadata, app_transactions=transactions or None)


# -- Arrow <-> Delta -----------------------------------------------------------------------------------
def _arrow_schema(table: DeltaTable | None) -> pa.Schema | None:
    return None if table is None else pa.schema(table.schema().to_arrow())


def _storable(field: pa.Field) -> pa.Field:
    """How a new column is stored: nullable (unless bookkeeping), durations as int64 microseconds marked
    in the field's metadata, so readers can give TIME back as a duration."""
    nullable = field.nullable or field.name not in META_COLUMNS
    if pa.types.is_duration(field.type):
        return pa.field(field.name, pa.int64(), nullable, metadata={STORED_AS: STORED_DURATION})
    return pa.field(field.name, field.type, nullable)


def stored_durations(table: DeltaTable) -> list[str]:
    """The table's columns that hold MySQL TIME values as int64 microseconds."""
    return [f.name for f in table.schema().fields if f.metadata.get(STORED_AS) == STORED_DURATION]


def _conform(data: pa.Table, target: pa.Schema | None) -> pa.Table:
    """`data` in the table's columns and types: absent columns null, new columns appended (for schema
    evolution). Values must fit the table's types exactly (see `_fit`)."""
    arrays: list[pa.ChunkedArray | pa.Array] = []
    fields: list[pa.Field] = []
    for field in target or ():
        present = field.name in data.column_names
        arrays.append(_fit(data[field.name], field) if present else pa.nulls(data.num_rows, field.type))
        fields.append(field)
    for field in data.schema:
        if target is None or field.name not in target.names:
            stored = _storable(field)
            arrays.append(data[field.name].cast(stored.type))
            fields.append(stored)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _fit(values: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """Cast to the column's Delta type; it must round-trip (delta-rs cannot widen a column after MODIFY)."""
    if values.type == field.type:
        return values
    try:
        fitted = values.cast(field.type)
        fits = fitted.cast(values.type).equals(values)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        fits = False
    if not fits:
        raise SinkError(
            f"column {field.name!r}: {values.type} values do not fit its Delta type {field.type} "
            "(a widening MODIFY COLUMN is kept at the old type while values fit)"
        )
    return fitted


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    try:
        pa.array([], source).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _ddl_row(event: DDLEvent) -> pa.Table:
    ddl = event.ddl
    row = {
        "commit_ts": ddl.commit_ts,
        "type": ddl.type.value,
        "sql": ddl.sql,
        "database": event.database,
        "table": event.table,
        "schema_version": ddl.table_schema.version if ddl.table_schema else None,
        "applied_at": datetime.now(UTC),
    }
    return pa.Table.from_pylist([row], schema=DDL_LOG_SCHEMA)


_IDENT = r"`(?:[^`]|``)+`|[^\s`.]+"
_RENAME = re.compile(rf"\s*RENAME\s+TABLE\s+({_IDENT})(?:\s*\.\s*({_IDENT}))?\s+TO\s", re.IGNORECASE)


def _renamed_from(event: DDLEvent) -> tuple[str, str]:
    """The old name: from `pre_table_schema` where TiCDC sends it (tiflow), else from the SQL, which TiCDC
    always sends as one single-pair `RENAME TABLE old TO new` per table."""
    pre = event.ddl.pre_table_schema
    if pre is not None and (pre.database, pre.table) != (event.database, event.table):
        return pre.database, pre.table
    if event.database is None:
        raise SinkError(f"cannot tell the renamed table from {event.ddl.sql!r}")
    return _renamed_from_sql(event.ddl.sql, event.database)


def _renamed_from_sql(sql: str, database: str) -> tuple[str, str]:
    found = _RENAME.match(sql)
    if found is None:
        raise SinkError(f"cannot tell the renamed table from {sql!r}")
    first, second = found.groups()
    return (_unquote(first), _unquote(second)) if second else (database, _unquote(first))


def _unquote(identifier: str) -> str:
    if identifier.startswith("`"):
        return identifier[1:-1].replace("``", "`")
    return identifier
