"""The Parquet changelog's table format: `<root>/<location>/changelog/_manifest.json` lists a table's
committed files and, per (topic, partition), the next offset applied to them. Written by `ParquetSink`,
read by it and by every reader of the lake: only listed files are committed.
"""

from __future__ import annotations

import msgspec
import pyarrow.fs as pafs

from consumer.lakehouse.resends import Frontier
from consumer.lakehouse.storage import LakeRoot
from consumer.sources.record import TopicPartition

MANIFEST = "_manifest.json"


class Manifest(msgspec.Struct, kw_only=True):
    """A table's committed files and how far each partition's rows are applied to them, with the newest
    commit ts of each partition's rows (re-sent changes: `consumer.lakehouse.resends`); per file, its rows
    (0: a manifest written before they were kept)."""

    files: list[str] = []
    next_offsets: list[tuple[str, int, int]] = []  # (topic, partition, first offset not yet applied)
    newest_ts: list[tuple[str, int, int]] = []  # (topic, partition, newest commit ts applied)
    rows: list[int] = []  # per file of `files`

    def applied(self) -> dict[TopicPartition, int]:
        return {(topic, partition): offset for topic, partition, offset in self.next_offsets}

    def frontiers(self) -> dict[TopicPartition, Frontier]:
        newest = {(topic, partition): ts for topic, partition, ts in self.newest_ts}
        return {tp: Frontier(offset, newest.get(tp, 0)) for tp, offset in self.applied().items()}


def read_manifest(directory: str, filesystem: pafs.FileSystem) -> Manifest | None:
    """The manifest of a changelog directory; None if nothing was ever committed there."""
    path = f"{directory}/{MANIFEST}"
    if filesystem.get_file_info(path).type == pafs.FileType.NotFound:
        return None
    with filesystem.open_input_stream(path) as stream:
        return msgspec.json.decode(stream.read(), type=Manifest)


def manifest_files(root: LakeRoot, location: str) -> list[str] | None:
    """The committed files of the table at `location` (paths in the root's filesystem), or None."""
    filesystem, base = root.filesystem()
    directory = f"{base.rstrip('/')}/{location}/changelog"
    manifest = read_manifest(directory, filesystem)
    return None if manifest is None else [f"{directory}/{name}" for name in manifest.files]
