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
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from consumer.batches.changes import TableChanges
from consumer.errors import SinkError
from consumer.lakehouse.catalog import CatalogEntry
from consumer.lakehouse.manifest import MANIFEST, Manifest, read_manifest
from consumer.lakehouse.offsets import advanced, newest_commit_ts, unapplied
from consumer.lakehouse.resends import Held, conflict_letters, fresh_changes
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

    def write(self, changes: TableChanges, context: CommitContext) -> Written:
        """Rows go to the table holding their name at their commit ts (see the catalog); copies of changes
        the table holds (TiCDC re-sent them) are skipped."""
        if not changes.changelog.num_rows:
            return Written(0)
        parts = [self._write_to(entry, part) for entry, part in self._located(changes)]
        return Written.of(parts)

    def _write_to(self, entry: CatalogEntry, changes: TableChanges) -> Written:
        directory = f"{self._base}/{entry.location}/changelog"
        manifest = self._manifest(directory)
        fresh = fresh_changes(
            changes.changelog, manifest.frontiers(), changes.key_columns, self._held_in(directory, manifest)
        )
        rows = unapplied(fresh.rows, manifest.applied())
        letters = conflict_letters(fresh.conflicts, f"{changes.database}.{changes.table}")
        if not rows.num_rows:
            return Written(0, self._skipped(fresh.resent), letters)  # a replay, or copies
        files = self._write_files(rows, directory)
        applied = advanced(manifest.applied(), rows)
        held = {tp: frontier.newest_ts for tp, frontier in manifest.frontiers().items()}
        newest_ts = {tp: max(ts, held.get(tp, 0)) for tp, ts in newest_commit_ts(rows).items()}
        committed = Manifest(
            files=[*manifest.files, *(name for name, _ in files)],
            next_offsets=_listed(applied),
            newest_ts=_listed({**held, **newest_ts}),
            rows=[*_rows_of(manifest), *(count for _, count in files)],
        )
        self._replace(f"{directory}/{MANIFEST}", msgspec.json.encode(committed))
        self._manifests[directory] = committed
        self._added[directory] = self._added.get(directory, 0) + len(files)
        self._wrote(entry)
        return Written(rows.num_rows, self._skipped(fresh.resent), letters)

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

    def _held_in(self, directory: str, manifest: Manifest) -> Held:
        """The committed rows of a partition at a commit ts, for `fresh_changes`."""

        def held(tp: TopicPartition, commit_ts: Sequence[int], columns: Sequence[str]) -> pa.Table:
            import pyarrow.dataset as pads  # with the pandas it imports: only a batch with copies pays it

            files = [f"{directory}/{name}" for name in manifest.files]
            if not files:
                return pa.table({})
            dataset = pads.dataset(files, format="parquet", filesystem=self._filesystem)
            topic, partition = tp
            where = pc.field("_commit_ts").isin(list(commit_ts)) & (pc.field("_topic") == topic)
            where &= pc.field("_partition") == partition
            wanted = [name for name in columns if name in dataset.schema.names]
            rows = dataset.to_table(columns=wanted, filter=where)
            return as_durations(rows, stored_durations(rows.schema))

        return held

    def _write_files(self, changelog: pa.Table, directory: str) -> list[tuple[str, int]]:
        """The batch in files of at most `rows_per_file` rows, TIME as marked int64 microseconds (Parquet
        has no duration type either); each file's name and rows."""
        self._filesystem.create_dir(directory, recursive=True)
        table = _storable(changelog)
        names = []
        for index in range(math.ceil(table.num_rows / self.rows_per_file)):
            name = f"part-{uuid.uuid4().hex}.parquet"
            part = table.slice(index * self.rows_per_file, self.rows_per_file)
            pq.write_table(
                part, f"{directory}/{name}", filesystem=self._filesystem, compression=self.compression
            )
            self._sync(f"{directory}/{name}")
            names.append((name, part.num_rows))
        self._sync(directory)
        return names

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
        """On a local disk, flush a file or directory entry: the sink's writes must be durable when they
        return (an object store's PUT is once it is acknowledged)."""
        if not self.root.is_local:
            return
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


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
