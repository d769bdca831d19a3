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
from collections.abc import Mapping
from pathlib import Path

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from consumer.batches.changes import TableChanges
from consumer.lakehouse.manifest import MANIFEST, Manifest, read_manifest
from consumer.lakehouse.offsets import advanced, unapplied
from consumer.lakehouse.tables import STORED_AS, STORED_DURATION
from consumer.sinks.base import CommitContext
from consumer.sinks.lakehouse import LakehouseSink


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

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        """Rows go to the table holding their name at their commit ts (see the catalog)."""
        if not changes.changelog.num_rows:
            return
        newest = max(changes.changelog["_commit_ts"].to_pylist())
        entry = self.catalog.locate((changes.database, changes.table), newest)
        directory = f"{self._base}/{entry.location}/changelog"
        manifest = self._manifest(directory)
        fresh = unapplied(changes.changelog, manifest.applied())
        if not fresh.num_rows:
            return  # a replay of rows already committed
        files = self._write_files(fresh, directory)
        applied = advanced(manifest.applied(), fresh)
        committed = Manifest(
            files=[*manifest.files, *files],
            next_offsets=[
                (topic, partition, offset) for (topic, partition), offset in sorted(applied.items())
            ],
        )
        self._replace(f"{directory}/{MANIFEST}", msgspec.json.encode(committed))
        self._manifests[directory] = committed
        self._wrote(entry)

    def _write_files(self, changelog: pa.Table, directory: str) -> list[str]:
        """The batch in files of at most `rows_per_file` rows, TIME as marked int64 microseconds (Parquet
        has no duration type either)."""
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
            names.append(name)
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


def _storable(changelog: pa.Table) -> pa.Table:
    fields, arrays = [], []
    for field, column in zip(changelog.schema, changelog.columns, strict=True):
        if pa.types.is_duration(field.type):
            field = pa.field(field.name, pa.int64(), field.nullable, metadata={STORED_AS: STORED_DURATION})
            column = column.cast(pa.int64())
        fields.append(field)
        arrays.append(column)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))
