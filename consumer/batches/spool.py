"""Typed changelog rows spooled to a file by the Spark task that decoded them, so that they never pass
through the driver: the driver orders them by their offsets and commit ts alone (`RowBlock`), and whoever
writes them (an executor task, or the driver for a sink that needs the rows in its process) reads the file.

A spool file is an Arrow IPC file of one segment's rows of one schema version, in offset order (an UPDATE's
two images together), as `table_changes` makes them; it lives beside the Spark checkpoint, on storage every
node reaches (`pyarrow.fs`: a local directory or an object store).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs


@dataclass(frozen=True, eq=False)
class SpooledRows:
    """A spool file's rows: `offsets` (ascending) are those of its DMLs a segment still holds (all of them
    until it is filtered), `images` how many changelog rows each made (an UPDATE two), `nbytes` the file's
    rows' size in memory."""

    path: str  # an absolute local path or a URI
    offsets: np.ndarray  # int64
    images: np.ndarray  # int64, per offset
    nbytes: int

    def image_count(self, offsets: np.ndarray | None = None) -> int:
        """The changelog rows of the DMLs at `offsets` (None: all of them)."""
        if offsets is None:
            return int(self.images.sum())
        return int(self.images[np.isin(self.offsets, offsets)].sum())

    def read(self, offsets: np.ndarray | None = None) -> pa.Table:
        """The file's rows, or only those of the DMLs at `offsets`."""
        rows = read_spool_file(self.path)
        if offsets is None:
            return rows
        return rows.filter(pc.is_in(rows["_offset"], value_set=pa.array(offsets, pa.int64())))


def read_spool_file(path: str) -> pa.Table:
    """The rows of the spool file at `path` (`write_spool_file`)."""
    filesystem, local = pafs.FileSystem.from_uri(path)
    with filesystem.open_input_file(local) as source:
        return pa.ipc.open_file(source).read_all()


def write_spool_file(path: str, rows: pa.Table) -> None:
    """Write `rows` to `path` whole; a task that dies mid-way leaves a file nothing names (the engine
    removes it with the batch's other unnamed files)."""
    filesystem, local = pafs.FileSystem.from_uri(path)
    filesystem.create_dir(local.rpartition("/")[0], recursive=True)
    with filesystem.open_output_stream(local) as out, pa.ipc.new_file(out, rows.schema) as writer:
        writer.write_table(rows)


def spool_uri(location: str) -> str:
    """`location` (a path, maybe relative, or a URI) as every process can name it."""
    return location.rstrip("/") if "://" in location else os.path.abspath(location)


SpooledPiece = tuple[SpooledRows, "np.ndarray | None"]  # a file and the DMLs of it to take (None: all)


def read_pieces(pieces: Sequence[SpooledPiece]) -> list[pa.Table]:
    return [rows.read(offsets) for rows, offsets in pieces]
