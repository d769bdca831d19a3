"""The changelog as plain Parquet files written by Spark, committed by an atomic manifest per table.

Layout under `root`, the Delta sink's (names escaped to path segments by its `table_dir`):
`<database>/<table>/changelog/part-*.parquet` plus `_progress.json`, the manifest, and `_ddl/` (the DDL
log, manifest-listed the same way). A batch is committed in two steps: Spark writes
its files to a staging directory and they are moved next to the manifest; then the manifest is replaced
atomically (temp file, fsync, `os.replace`). Only listed files are committed: a crash between the steps
leaves orphan files that readers never see (they read the listed files only) and that the next load
deletes, and the replayed batch writes its rows again.

The manifest also says, per (topic, partition), the next offset applied to the table, so replayed rows
are skipped (idempotent writes), and records the commit context (resume offsets, resolved ts, schema
snapshot) so a restarted consumer knows where to resume.
"""

from __future__ import annotations

import base64
import math
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql import SparkSession

from consumer.batches.changes import TSO_PHYSICAL_SHIFT, TableChanges
from consumer.errors import SinkError
from consumer.protocol.model import DDL, DDLType
from consumer.sinks.base import CommitContext, DDLEvent, TopicPartition
from consumer.sinks.layout import DDL_LOG, table_dir
from consumer.spark.frames import offset_ranges, to_dataframe

MANIFEST = "_progress.json"
_STAGING = "_staging"

Name = tuple[str, str]  # (database, table)


class Progress(msgspec.Struct, kw_only=True):
    """One manifest: the committed files and how far the stream is applied to them."""

    sequence: int = 0  # sink-wide commit counter: orders the manifests of different tables
    files: list[str] = []
    next_offsets: list[tuple[str, int, int]] = []  # (topic, partition, first offset not yet applied)
    group: str = ""
    resume_offsets: list[tuple[str, int, int]] = []
    resolved_ts: int = 0
    schema_snapshot: str = ""  # base64


class Rename(msgspec.Struct, frozen=True):
    commit_ts: int
    old: Name
    new: Name


class DDLProgress(Progress, kw_only=True):
    """The DDL log's manifest: DDLs arrive in commit_ts order, so the keys of the last commit_ts suffice to
    recognise a replayed one; renames redirect late rows of a table's old name."""

    last_commit_ts: int = 0
    last_keys: list[tuple[str, str]] = []  # (type, sql) of the DDLs applied at last_commit_ts
    renames: list[Rename] = []


P = TypeVar("P", bound=Progress)

_DDL_SCHEMA = pa.schema(
    [
        pa.field("commit_ts", pa.int64(), nullable=False),
        pa.field("commit_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("database", pa.string()),
        pa.field("table", pa.string()),
        pa.field("schema_version", pa.int64()),
        pa.field("sql", pa.string(), nullable=False),
    ]
)


class ParquetSink:
    """Changelog only: Parquet has no MERGE, so there is no mirror table."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        spark: SparkSession,
        *,
        compression: str = "snappy",
        rows_per_file: int = 1_000_000,
    ) -> None:
        self.root = Path(root).absolute()
        self.spark = spark
        self.compression = compression
        self.rows_per_file = rows_per_file
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.root / _STAGING, ignore_errors=True)  # a crashed writer's leftovers
        self._tables: dict[Path, Progress] = {}
        self._ddl = _load(self.root / DDL_LOG, DDLProgress) or DDLProgress()
        _delete_orphans(self.root / DDL_LOG, self._ddl)
        self._sequence = max((progress.sequence for progress in self._manifests()), default=0)

    # -- rows ------------------------------------------------------------------------------------------
    def write(self, changes: TableChanges, context: CommitContext) -> None:
        if not changes.changelog.num_rows:
            return
        directory = self._changelog_dir(changes)
        progress = self._table_progress(directory)
        fresh = _unapplied(changes.changelog, progress.next_offsets)
        if not fresh.num_rows:
            return  # a replay of rows already committed
        batch = TableChanges(changes.schema, fresh)
        files = self._write_files(batch, directory)
        committed = msgspec.structs.replace(
            progress, files=[*progress.files, *files], next_offsets=_advanced(progress.next_offsets, batch)
        )
        self._tables[directory] = self._commit(directory, committed, context)

    def _changelog_dir(self, changes: TableChanges) -> Path:
        """Rows of a renamed table's old name that arrive late (a replay) belong to the new name."""
        name = (changes.database, changes.table)
        last_ts = pc.max(changes.changelog["_commit_ts"]).as_py()
        for rename in sorted(self._ddl.renames, key=lambda r: r.commit_ts):
            if rename.old == name and last_ts < rename.commit_ts:
                name = rename.new
        return table_dir(self.root, *name) / "changelog"

    def _write_files(self, changes: TableChanges, directory: Path) -> list[str]:
        """Spark writes the batch to a staging directory; its data files then move into `directory`."""
        staging = self.root / _STAGING / uuid.uuid4().hex
        frame = to_dataframe(self.spark, changes)
        files = math.ceil(changes.changelog.num_rows / self.rows_per_file)  # else a tiny file per core
        frame.coalesce(files).write.option("compression", self.compression).parquet(str(staging))
        _make_dirs(directory)
        names = []
        for path in sorted(staging.glob("part-*.parquet")):
            _fsync(path)
            os.replace(path, directory / path.name)
            names.append(path.name)
        _fsync(directory)
        shutil.rmtree(staging)
        return names

    def _table_progress(self, directory: Path) -> Progress:
        progress = self._tables.get(directory)
        if progress is None:
            progress = self._tables[directory] = _load(directory, Progress) or Progress()
            _delete_orphans(directory, progress)
        return progress

    # -- DDLs ------------------------------------------------------------------------------------------
    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        ddl = event.ddl
        key = (ddl.type.value, ddl.sql)
        if ddl.commit_ts < self._ddl.last_commit_ts or (
            ddl.commit_ts == self._ddl.last_commit_ts and key in self._ddl.last_keys
        ):
            return  # a replay of a DDL already applied
        renames = self._ddl.renames
        if ddl.type is DDLType.RENAME and event.database is not None and event.table is not None:
            old = _renamed_from(ddl, event.database)
            if old is not None and old != (event.database, event.table):
                self._move_table(old, (event.database, event.table))
                renames = [*renames, Rename(ddl.commit_ts, old, (event.database, event.table))]
        # TRUNCATE and ERASE (DROP TABLE) keep the changelog: it is history, not state.
        directory = self.root / DDL_LOG
        _make_dirs(directory)
        name = f"ddl-{ddl.commit_ts:020d}-{uuid.uuid4().hex}.parquet"
        pq.write_table(_ddl_row(event), directory / name)
        _fsync(directory / name)
        same_ts = self._ddl.last_keys if ddl.commit_ts == self._ddl.last_commit_ts else []
        logged = msgspec.structs.replace(
            self._ddl,
            files=[*self._ddl.files, name],
            last_commit_ts=ddl.commit_ts,
            last_keys=[*same_ts, key],
            renames=renames,
        )
        self._ddl = self._commit(directory, logged, context)

    def _move_table(self, old: Name, new: Name) -> None:
        """Move the whole table directory; nothing to do when a replay finds it already moved."""
        source, target = table_dir(self.root, *old), table_dir(self.root, *new)
        if not source.exists():
            return
        if target.exists():
            raise SinkError(f"cannot rename {old[0]}.{old[1]} to {new[0]}.{new[1]}: {target} already exists")
        _make_dirs(target.parent)
        os.replace(source, target)
        _fsync(source.parent)
        _fsync(target.parent)
        self._tables = {
            d: p
            for d, p in self._tables.items()
            if not (d.is_relative_to(source) or d.is_relative_to(target))
        }

    # -- recorded progress -----------------------------------------------------------------------------
    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        """Per (topic, partition), the newest resume offset any manifest recorded for the group."""
        offsets: dict[TopicPartition, int] = {}
        for progress in self._manifests():
            if progress.group == group:
                for topic, partition, offset in progress.resume_offsets:
                    offsets[(topic, partition)] = max(offset, offsets.get((topic, partition), offset))
        return offsets

    def recorded_schema_snapshot(self) -> bytes | None:
        recorded = [p for p in self._manifests() if p.schema_snapshot]
        if not recorded:
            return None
        return base64.b64decode(max(recorded, key=lambda p: p.sequence).schema_snapshot)

    def close(self) -> None:
        return None

    def _manifests(self) -> Iterator[Progress]:
        for path in self.root.glob(f"*/*/changelog/{MANIFEST}"):
            yield msgspec.json.decode(path.read_bytes(), type=Progress)
        yield self._ddl

    def _commit(self, directory: Path, progress: P, context: CommitContext) -> P:
        """Replace the manifest atomically; the files it lists are then committed."""
        self._sequence += 1
        committed = msgspec.structs.replace(
            progress,
            sequence=self._sequence,
            group=context.group,
            resume_offsets=[(t, p, o) for (t, p), o in sorted(context.resume_offsets.items())],
            resolved_ts=context.resolved_ts,
            schema_snapshot=base64.b64encode(context.schema_snapshot).decode("ascii"),
        )
        temp = directory / f".{MANIFEST}.{uuid.uuid4().hex}.tmp"
        with temp.open("wb") as file:
            file.write(msgspec.json.encode(committed))
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, directory / MANIFEST)
        _fsync(directory)
        return committed


def read_progress(directory: str | os.PathLike[str]) -> Progress | None:
    """The manifest of a changelog (or DDL log) directory; None if nothing was ever committed there."""
    return _load(Path(directory), Progress)


def _load(directory: Path, kind: type[P]) -> P | None:
    path = directory / MANIFEST
    return msgspec.json.decode(path.read_bytes(), type=kind) if path.exists() else None


def _delete_orphans(directory: Path, progress: Progress) -> None:
    """Files of a batch whose manifest replacement never happened, and torn manifest temp files."""
    listed = set(progress.files)
    for path in [*directory.glob("*.parquet"), *directory.glob(f".{MANIFEST}.*.tmp")]:
        if path.name not in listed:
            path.unlink()


def _unapplied(changelog: pa.Table, next_offsets: list[tuple[str, int, int]]) -> pa.Table:
    """The rows at or after each (topic, partition)'s next unapplied offset."""
    applied = pa.array([False] * changelog.num_rows)
    for topic, partition, offset in next_offsets:
        here = pc.and_(pc.equal(changelog["_topic"], topic), pc.equal(changelog["_partition"], partition))
        applied = pc.or_(applied, pc.and_(here, pc.less(changelog["_offset"], offset)))
    return changelog.filter(pc.invert(applied))


def _advanced(next_offsets: list[tuple[str, int, int]], changes: TableChanges) -> list[tuple[str, int, int]]:
    merged = {(t, p): o for t, p, o in next_offsets}
    for where, (_, last) in offset_ranges(changes).items():
        merged[where] = max(merged.get(where, 0), last + 1)
    return [(t, p, o) for (t, p), o in sorted(merged.items())]


_RENAME_SQL = re.compile(r"RENAME\s+TABLE\s+(?:`((?:[^`]|``)+)`\.)?`((?:[^`]|``)+)`", re.IGNORECASE)


def _renamed_from(ddl: DDL, database: str) -> Name | None:
    """The old name: from the pre-rename schema when TiCDC sends it, else from the statement."""
    if ddl.pre_table_schema is not None:
        return ddl.pre_table_schema.database, ddl.pre_table_schema.table
    match = _RENAME_SQL.search(ddl.sql)
    if match is None:
        return None
    old_database, old_table = match.groups()
    return (old_database or database).replace("``", "`"), old_table.replace("``", "`")


def _ddl_row(event: DDLEvent) -> pa.Table:
    ddl = event.ddl
    physical_ms = ddl.commit_ts >> TSO_PHYSICAL_SHIFT
    row = {
        "commit_ts": ddl.commit_ts,
        "commit_time": physical_ms * 1000,
        "type": ddl.type.value,
        "database": event.database,
        "table": event.table,
        "schema_version": ddl.table_schema.version if ddl.table_schema else None,
        "sql": ddl.sql,
    }
    return pa.Table.from_pylist([row], schema=_DDL_SCHEMA)


def _make_dirs(directory: Path) -> None:
    """Create `directory` and its missing parents, durably (each new entry is fsynced in its parent)."""
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    for created in reversed(missing):
        _fsync(created.parent)


def _fsync(path: Path) -> None:
    """Flush a file or a directory entry to disk: the sink's writes must be durable when they return."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
