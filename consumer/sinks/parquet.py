"""The changelog as plain Parquet files, committed by an atomic manifest per table.

The root is a directory or an object-store URI (files go through `pyarrow.fs`); tables are found through
the lakehouse catalog as the Delta sink finds them (`consumer.lakehouse`), the DDL log and the progress
records are the shared Delta tables at the root. A table's files live in `<root>/<location>/changelog/`:
`part-*.parquet` and `_manifest.json`, which lists the committed files and, per (topic, partition), the next
offset applied to the table, so replayed rows are skipped. A batch is committed in two steps: its files are
written, then the manifest is replaced atomically (a rename on a local disk, one PUT on an object store).
Only listed files are committed: a crash between the steps leaves orphan files that readers never see (they
read the listed files only) and that the next load deletes, and the replayed batch writes its rows again.

One writer per root: a manifest is read, extended and replaced without a conditional write.
"""

from __future__ import annotations

import math
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from consumer.batches.changes import SpooledChanges, TableChanges, ordered_changelog
from consumer.batches.spool import SpooledPiece, read_pieces
from consumer.errors import SinkError
from consumer.lakehouse.catalog import CatalogEntry
from consumer.lakehouse.manifest import MANIFEST, Manifest, read_manifest
from consumer.lakehouse.offsets import newest_commit_ts, next_offsets, unapplied
from consumer.lakehouse.resends import Frontier, Held, conflict_letters, fresh_changes
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import STORED_AS, STORED_DURATION, as_durations, stored_durations
from consumer.sinks.base import CommitContext, Written
from consumer.sinks.lakehouse import LakehouseSink
from consumer.sources.record import TopicPartition


class ParquetSink(LakehouseSink):
    """Changelog only: Parquet has no MERGE, so there is no mirror table."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        compression: str = "snappy",
        rows_per_file: int = 1_000_000,
        storage_options: Mapping[str, str] | None = None,
        allow_unsafe_commits: bool = False,
    ) -> None:
        super().__init__(root, storage_options, allow_unsafe_commits=allow_unsafe_commits)
        self.compression = compression
        self.rows_per_file = rows_per_file
        self._filesystem, base = self.root.filesystem()
        self._base = base.rstrip("/")
        self._manifests: dict[str, Manifest] = {}
        self._added: dict[str, int] = {}  # by directory: how many files this sink committed there
        self.append_runner: ParquetRunner | None = None  # None: spooled rows are written from here

    def write(self, changes: TableChanges, context: CommitContext) -> Written:
        """Rows go to the table holding their name at their commit ts (see the catalog); copies of changes
        the table holds (TiCDC re-sent them) are skipped."""
        if not changes.row_count:
            return Written(0)
        parts = [self._write_to(entry, part) for entry, part in self._located(changes)]
        return Written.of(parts)

    def append_with(self, runner: ParquetRunner) -> None:
        """Have `runner` write the files of batches whose rows are spooled (the Spark engine: a task per
        table, on the executors); this process commits them in the manifest."""
        self.append_runner = runner

    def _write_to(self, entry: CatalogEntry, changes: TableChanges) -> Written:
        directory = f"{self._base}/{entry.location}/changelog"
        manifest = self._manifest(directory)
        job = self._job(directory, manifest, changes)
        if isinstance(changes, SpooledChanges) and self.append_runner is not None:
            [done] = self.append_runner([job])
        else:
            done = fresh_files(job, changes.changelog)
        letters = conflict_letters(done.conflicts, f"{changes.database}.{changes.table}")
        if done.files:
            self._commit_files(directory, manifest, done)
            self._wrote(entry)
        return Written(sum(rows for _, rows in done.files), self._skipped(done.resent), letters)

    def _job(self, directory: str, manifest: Manifest, changes: TableChanges) -> ParquetJob:
        return ParquetJob(
            self.root.uri,
            dict(self.root.storage_options),
            directory,
            tuple(changes.pieces) if isinstance(changes, SpooledChanges) else (),
            changes.changelog_schema,
            changes.key_columns,
            manifest.frontiers(),
            tuple(manifest.files),
            self.rows_per_file,
            self.compression,
        )

    def _commit_files(self, directory: str, manifest: Manifest, done: ParquetFiles) -> None:
        """List the files in the manifest with how far they take each partition: the commit."""
        applied = manifest.applied()
        held = {tp: frontier.newest_ts for tp, frontier in manifest.frontiers().items()}
        committed = Manifest(
            files=[*manifest.files, *(name for name, _ in done.files)],
            next_offsets=_listed(_furthest(applied, done.next_offsets)),
            newest_ts=_listed(_furthest(held, done.newest_ts)),
            rows=[*_rows_of(manifest), *(rows for _, rows in done.files)],
        )
        self._replace(f"{directory}/{MANIFEST}", msgspec.json.encode(committed))
        self._manifests[directory] = committed
        self._added[directory] = self._added.get(directory, 0) + len(done.files)

    def committed_rows(self) -> int:
        """The rows this sink committed, read back from the manifests (the rows of the files it added);
        a count that disagrees with what it wrote is a `SinkError`."""
        total = 0
        for directory, added in sorted(self._added.items()):
            manifest = read_manifest(directory, self._filesystem) or Manifest()
            counts = _rows_of(manifest)[len(manifest.files) - added :]
            names = manifest.files[len(manifest.files) - added :]
            read = sum(
                pq.ParquetFile(f"{directory}/{name}", filesystem=self._filesystem).metadata.num_rows
                for name in names
            )
            if read != sum(counts):
                raise SinkError(f"{directory}: its files hold {read} rows, its manifest says {sum(counts)}")
            total += read
        return total

    def _manifest(self, directory: str) -> Manifest:
        manifest = self._manifests.get(directory)
        if manifest is None:
            manifest = self._manifests[directory] = read_manifest(directory, self._filesystem) or Manifest()
            self._delete_orphans(directory, manifest)
        return manifest

    def _delete_orphans(self, directory: str, manifest: Manifest) -> None:
        """Files of a batch whose manifest replacement never happened, and torn manifest temp files."""
        listed = set(manifest.files)
        selector = pafs.FileSelector(directory, allow_not_found=True)
        for info in self._filesystem.get_file_info(selector):
            name = info.base_name
            if (name.endswith(".parquet") and name not in listed) or name.startswith(f".{MANIFEST}."):
                self._filesystem.delete_file(info.path)

    def _replace(self, path: str, data: bytes) -> None:
        """Replace a file atomically: an object store's PUT is; on a disk, a synced temp file is renamed."""
        if not self.root.is_local:
            with self._filesystem.open_output_stream(path) as out:
                out.write(data)
            return
        temporary = Path(path).with_name(f".{MANIFEST}.{uuid.uuid4().hex}.tmp")
        with temporary.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        self._sync(str(Path(path).parent))

    def _sync(self, path: str) -> None:
        if self.root.is_local:
            _synced(path)


@dataclass(frozen=True)
class ParquetJob:
    """One table's batch of changelog rows to write as Parquet files, all a process needs to write them: the
    lake root and its storage options, the table's directory (in the root's filesystem), the spooled rows
    (when Spark tasks spooled them) and their schema, the table's key, how far the manifest holds each
    partition and its files (what re-sent copies are compared with), and how files are cut. A Spark task's
    input."""

    root: str
    storage_options: dict[str, str]
    directory: str
    pieces: tuple[SpooledPiece, ...]
    schema: pa.Schema
    keys: tuple[str, ...]
    frontiers: dict[TopicPartition, Frontier]
    files: tuple[str, ...]
    rows_per_file: int
    compression: str


@dataclass(frozen=True)
class ParquetFiles:
    """What a `ParquetJob` wrote, uncommitted: each file's name and rows, per partition the offset after
    its last row and its newest commit ts, the records it skipped as re-sent and the conflicting copies."""

    files: tuple[tuple[str, int], ...]
    next_offsets: dict[TopicPartition, int]
    newest_ts: dict[TopicPartition, int]
    resent: dict[TopicPartition, int]
    conflicts: pa.Table


ParquetRunner = Callable[[Sequence[ParquetJob]], Sequence[ParquetFiles]]
"""Writes Parquet files (`ParquetSink.append_with`): each job as `write_parquet_files` does, in order."""


def write_parquet_files(job: ParquetJob) -> ParquetFiles:
    """Run `job` in this process (a Spark executor's Python worker) on its spooled rows."""
    return fresh_files(job, ordered_changelog(read_pieces(job.pieces), job.schema))


def fresh_files(job: ParquetJob, changelog: pa.Table) -> ParquetFiles:
    """The rows of `changelog` the table lacks (neither before its next offsets nor copies of changes it
    holds) in files of at most `rows_per_file` rows, TIME as marked int64 microseconds (Parquet has no
    duration type either); nothing is committed."""
    root = LakeRoot.of(job.root, job.storage_options)
    filesystem, _ = root.filesystem()
    fresh = fresh_changes(changelog, job.frontiers, job.keys, _held(filesystem, job.directory, job.files))
    rows = unapplied(fresh.rows, {tp: frontier.next_offset for tp, frontier in job.frontiers.items()})
    if not rows.num_rows:
        return ParquetFiles((), {}, {}, fresh.resent, fresh.conflicts)
    filesystem.create_dir(job.directory, recursive=True)
    table = _storable(rows)
    files = []
    for index in range(math.ceil(table.num_rows / job.rows_per_file)):
        name = f"part-{uuid.uuid4().hex}.parquet"
        part = table.slice(index * job.rows_per_file, job.rows_per_file)
        pq.write_table(part, f"{job.directory}/{name}", filesystem=filesystem, compression=job.compression)
        if root.is_local:
            _synced(f"{job.directory}/{name}")
        files.append((name, part.num_rows))
    if root.is_local:
        _synced(job.directory)
    return ParquetFiles(
        tuple(files), next_offsets(rows), newest_commit_ts(rows), fresh.resent, fresh.conflicts
    )


def _held(filesystem: pafs.FileSystem, directory: str, names: Sequence[str]) -> Held:
    """A Parquet changelog's committed rows of a partition at some commit ts, for `fresh_changes`."""

    def held(tp: TopicPartition, commit_ts: Sequence[int], columns: Sequence[str]) -> pa.Table:
        import pyarrow.dataset as pads  # with the pandas it imports: only a batch with copies pays it

        if not names:
            return pa.table({})
        dataset = pads.dataset([f"{directory}/{n}" for n in names], format="parquet", filesystem=filesystem)
        topic, partition = tp
        where = pc.field("_commit_ts").isin(list(commit_ts)) & (pc.field("_topic") == topic)
        where &= pc.field("_partition") == partition
        wanted = [name for name in columns if name in dataset.schema.names]
        rows = dataset.to_table(columns=wanted, filter=where)
        return as_durations(rows, stored_durations(rows.schema))

    return held


def _synced(path: str) -> None:
    """Flush a local file or directory entry: the sink's writes must be durable when it commits them (an
    object store's PUT is once it is acknowledged)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _furthest(
    held: Mapping[TopicPartition, int], more: Mapping[TopicPartition, int]
) -> dict[TopicPartition, int]:
    return {tp: max(held.get(tp, 0), more.get(tp, 0)) for tp in held.keys() | more.keys()}


def _listed(by_partition: Mapping[TopicPartition, int]) -> list[tuple[str, int, int]]:
    return [(topic, partition, value) for (topic, partition), value in sorted(by_partition.items())]


def _rows_of(manifest: Manifest) -> list[int]:
    """Each listed file's rows (0 where an older manifest did not say)."""
    return [*manifest.rows, *[0] * (len(manifest.files) - len(manifest.rows))]


def _storable(changelog: pa.Table) -> pa.Table:
    fields, arrays = [], []
    for field, column in zip(changelog.schema, changelog.columns, strict=True):
        if pa.types.is_duration(field.type):
            field = pa.field(field.name, pa.int64(), field.nullable, metadata={STORED_AS: STORED_DURATION})
            column = column.cast(pa.int64())
        fields.append(field)
        arrays.append(column)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
