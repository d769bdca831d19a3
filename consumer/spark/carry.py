"""The Spark engine's own record beside Spark's checkpoint: per micro-batch, what it carries to the next.

Spark's checkpoint says which offsets each micro-batch read, and a batch is never read again once Spark has
committed it. Records the state machine could not apply by the end of a batch (rows waiting for their
schema or for the watermark, DDL copies waiting for the others) must outlive the driver, so after every
batch the engine writes them here, with each partition's last WATERMARK, the schema cache and the
partitions it wants paused: one file `batch-<id>.arrow`, an Arrow IPC file of segment rows
(`consumer.spark.segments`) whose schema metadata holds the rest. The file exists only once every sink
applied the batch: a batch found here is complete, so a batch Spark runs again is skipped. Before a batch
is applied, its Kafka ranges go to `intent-<id>.json`: the engine applies a batch while Spark plans the
next, so Spark may have committed a batch a dead driver never finished applying; a restart reads it again.

Readers: the driver (the carry, after a restart), the source's tasks (the schemas) and its planner (the
paused partitions). Everything goes through `pyarrow.fs`, so the location may be a local directory or an
object store every node reaches.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs

from consumer.batches.spool import spool_uri
from consumer.sources.record import TopicPartition
from consumer.spark.segments import ARROW_SCHEMA, SPOOL_DIRECTORY, Segment

KEEP_BATCHES = 3  # the newest files kept: a task or the planner may still be reading the one before
_SCHEMAS = b"ticdc.schemas"  # a `SchemaCache.snapshot()`
_PAUSED = b"ticdc.paused"  # JSON [[topic, partition], ...]
_NAME = re.compile(r"batch-(\d{20})\.arrow")
_INTENT = re.compile(r"intent-(\d{20})\.json")
_ANNOUNCED = re.compile(r"announced-(\d{20})\.msgpack")
_SPOOLED = re.compile(r"(\d+)-(\d+)-[0-9a-f]+-\d+\.arrow")  # `Segment.spool`'s: start, end
Range = tuple[str, int, int, int]  # topic, partition, first offset, end offset (exclusive)


@dataclass(frozen=True)
class Carry:
    segments: list[Segment]
    schemas: bytes
    paused: set[TopicPartition]


class CarryStore:
    """The batch files under `location` (a path or URI, e.g. `s3://bucket/prefix`)."""

    def __init__(self, location: str) -> None:
        uri = location if "://" in location else os.path.abspath(location)
        self.location = location
        self._fs, self._root = pafs.FileSystem.from_uri(uri)
        self._spool_dir = f"{spool_uri(location)}/{SPOOL_DIRECTORY}"  # as `Segment.spool` names its files
        self._spool_fs, self._spool_root = pafs.FileSystem.from_uri(self._spool_dir)

    def write(self, batch_id: int, carry: Carry) -> None:
        """Write batch `batch_id`'s file whole, under its final name only once complete; drop older ones."""
        metadata = {
            _SCHEMAS: carry.schemas,
            _PAUSED: json.dumps(sorted(carry.paused)).encode(),
        }
        table = pa.Table.from_pylist([s.to_row() for s in carry.segments], schema=ARROW_SCHEMA)
        self._fs.create_dir(self._root, recursive=True)
        final = self._path(batch_id)
        temporary = f"{self._root}/.{uuid.uuid4().hex}.tmp"
        with (
            self._fs.open_output_stream(temporary) as out,
            pa.ipc.new_file(out, ARROW_SCHEMA.with_metadata(metadata)) as writer,
        ):
            writer.write_table(table)
        self._fs.move(temporary, final)
        for old in self.batches()[:-KEEP_BATCHES]:
            self._fs.delete_file(self._path(old))
        for old in self._ids(_INTENT)[:-KEEP_BATCHES]:
            self._fs.delete_file(self._intent_path(old))
        for old in self._ids(_ANNOUNCED):
            if old <= batch_id:  # its schemas are in the batch's record now
                self._fs.delete_file(self._announced_path(old))

    def remove_spooled(self, read: dict[TopicPartition, int], carried: set[str]) -> None:
        """Remove the spool files of records before `read` (per partition: the end of the records a batch
        read) but those `carried` names: their rows are applied, or were read again and spooled anew (a
        task retried, a batch applied again after a restart). Later batches' files end after `read`."""
        for (topic, partition), end in read.items():
            directory = f"{self._spool_root}/{topic}/{partition}"
            selector = pafs.FileSelector(directory, allow_not_found=True)
            for info in self._spool_fs.get_file_info(selector):
                match = _SPOOLED.fullmatch(info.base_name)
                if (
                    match
                    and int(match.group(2)) <= end
                    and f"{self._spool_dir}/{topic}/{partition}/{info.base_name}" not in carried
                ):
                    self._spool_fs.delete_file(info.path)

    def write_intent(self, batch_id: int, ranges: list[Range]) -> None:
        """Record the Kafka ranges batch `batch_id` read, before it is applied: if the driver dies while
        applying it after Spark recorded its commit, a restart reads them again from Kafka."""
        self._fs.create_dir(self._root, recursive=True)
        temporary = f"{self._root}/.{uuid.uuid4().hex}.tmp"
        with self._fs.open_output_stream(temporary) as out:
            out.write(json.dumps(sorted(ranges)).encode())
        self._fs.move(temporary, self._intent_path(batch_id))

    def write_announced(self, batch_id: int, schemas: bytes) -> None:
        """Record the schemas batch `batch_id`'s BOOTSTRAPs and DDLs name (a `SchemaCache` snapshot) as it is
        handed over to be applied: the next batch's tasks, which start before that, type rows with them."""
        self._fs.create_dir(self._root, recursive=True)
        temporary = f"{self._root}/.{uuid.uuid4().hex}.tmp"
        with self._fs.open_output_stream(temporary) as out:
            out.write(schemas)
        self._fs.move(temporary, self._announced_path(batch_id))

    def announced_after(self, batch_id: int | None) -> list[tuple[int, bytes]]:
        """The schemas recorded by `write_announced` for batches after `batch_id`, oldest first. A file
        deleted under the reader is skipped (its batch's record holds them)."""
        found = []
        for announced in self._ids(_ANNOUNCED):
            if batch_id is None or announced > batch_id:
                try:
                    with self._fs.open_input_stream(self._announced_path(announced)) as source:
                        found.append((announced, source.read()))
                except FileNotFoundError:
                    continue
        return found

    def intent(self, batch_id: int) -> list[Range] | None:
        try:
            with self._fs.open_input_stream(self._intent_path(batch_id)) as source:
                return [(str(t), int(p), int(a), int(b)) for t, p, a, b in json.loads(source.read())]
        except FileNotFoundError:
            return None

    def batches(self) -> list[int]:
        """The batch ids recorded, oldest first."""
        return self._ids(_NAME)

    def _ids(self, pattern: re.Pattern[str]) -> list[int]:
        selector = pafs.FileSelector(self._root, allow_not_found=True)
        found = (pattern.fullmatch(info.base_name) for info in self._fs.get_file_info(selector))
        return sorted(int(match.group(1)) for match in found if match)

    def latest(self) -> int | None:
        batches = self.batches()
        return batches[-1] if batches else None

    def read(self, batch_id: int) -> Carry:
        with self._fs.open_input_file(self._path(batch_id)) as source:
            reader = pa.ipc.open_file(source)
            table = reader.read_all()
            metadata = reader.schema.metadata or {}
        return Carry(
            [Segment.from_row(row) for row in table.to_pylist()],
            metadata.get(_SCHEMAS, b""),
            _paused(metadata),
        )

    def latest_metadata(self) -> tuple[int, bytes, set[TopicPartition]] | None:
        """The newest batch's id, schema snapshot and paused partitions, without reading its segments; None
        before the first batch. A file deleted under the reader counts as none (the next one is newer)."""
        batch_id = self.latest()
        if batch_id is None:
            return None
        try:
            with self._fs.open_input_file(self._path(batch_id)) as source:
                metadata = pa.ipc.open_file(source).schema.metadata or {}
        except FileNotFoundError:
            return None
        return batch_id, metadata.get(_SCHEMAS, b""), _paused(metadata)

    def _path(self, batch_id: int) -> str:
        return f"{self._root}/batch-{batch_id:020d}.arrow"

    def _announced_path(self, batch_id: int) -> str:
        return f"{self._root}/announced-{batch_id:020d}.msgpack"

    def _intent_path(self, batch_id: int) -> str:
        return f"{self._root}/intent-{batch_id:020d}.json"


def _paused(metadata: dict[bytes, bytes]) -> set[TopicPartition]:
    return {(topic, partition) for topic, partition in json.loads(metadata.get(_PAUSED, b"[]"))}
