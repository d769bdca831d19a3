"""What the `ticdc` source's tasks hand the driver: a segment per Kafka partition range, decoded as far as a
task can decode it alone.

A stream has one schema, while every table version has its own typed columns, so a segment row carries
Arrow IPC streams as binary: `records`, one row per Kafka record in offset order, and `changes`, one typed
changelog table (`consumer.batches.changes`) per schema version whose rows the task could decode. A task
knows the schemas the engine recorded before the batch (`consumer.spark.carry`) and those announced in its
own range; a DML of any other version or of a schema `TableCodec` refuses, a record that does not decode or
verify, and every WATERMARK, BOOTSTRAP and DDL keep their Kafka value for the driver, whose state machine
orders them all (`consumer.spark.engine`): those one by one (`Segment.decoded`), the typed rows a block per
schema version (`Segment.blocks`).
Decoding a row twice is deterministic, so which side decodes it never changes the result.

A stream's tasks spool their typed rows (`Segment.spool`): each schema version's changelog table goes to a
file beside the checkpoint (`<checkpoint>/ticdc/spool/<topic>/<partition>/<start>-<end>-<id>.arrow`), and
the segment carries instead its index (`INDEX_SCHEMA`: per DML its offset, commit ts, table id and how many
changelog rows it made), so no row reaches the driver: the state machine orders the DMLs by the index and
executor tasks write the rows (`consumer.spark.merges`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from cachetools import LRUCache, cached

from consumer.batches.changes import table_changes
from consumer.batches.spool import SpooledRows, spool_uri, write_spool_file
from consumer.errors import ConsumerError, RecordLocation, RejectedRowsError, ValueDecodeError
from consumer.protocol.base import RecordDecoder
from consumer.protocol.model import DDL, Bootstrap, DecodedMessage, RawDML, TableSchema
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.state.schema_cache import SchemaCache
from consumer.state.units import RowBlock, SchemaKey

if TYPE_CHECKING:  # tasks import this module: not the pipeline and its sinks
    from consumer.pipeline import DecodedRecord

SPARK_SCHEMA = (
    "topic string, partition int, start_offset bigint, end_offset bigint, "
    "records binary, changes array<binary>"
)
"""The rows of a `ticdc` DataFrame (batch or stream); `start_offset`/`end_offset`: the range read (end
exclusive)."""
ARROW_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string()),
        pa.field("partition", pa.int32()),
        pa.field("start_offset", pa.int64()),
        pa.field("end_offset", pa.int64()),
        pa.field("records", pa.binary()),
        pa.field("changes", pa.list_(pa.binary())),
    ]
)
RECORDS_SCHEMA = pa.schema(
    [
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("key", pa.binary()),  # the Kafka key of a record kept for the driver (TiCDC Avro, Debezium)
        pa.field("value", pa.binary()),  # null: a DML the task decoded (its images are in `changes`)
        pa.field("type", pa.string()),  # the DML header of a decoded DML, null otherwise
        pa.field("database", pa.string()),
        pa.field("table", pa.string()),
        pa.field("table_id", pa.int64()),
        pa.field("commit_ts", pa.int64()),
        pa.field("build_ts", pa.int64()),
        pa.field("schema_version", pa.int64()),
        pa.field("encoding", pa.string()),
    ]
)
INDEX_SCHEMA = pa.schema(
    [
        pa.field("_offset", pa.int64(), nullable=False),
        pa.field("_commit_ts", pa.int64(), nullable=False),
        pa.field("_table_id", pa.int64(), nullable=False),
        pa.field("_images", pa.int64(), nullable=False),  # the changelog rows the DML made
    ]
)
"""A spooled schema version's rows as a segment carries them: one row per DML, in offset order."""
SPOOL_DIRECTORY = "spool"  # in the engine's state location
_SPOOL = b"ticdc.spool"  # IPC schema metadata of an index table: its `SpoolFile`
_SCHEMA_KEY = b"ticdc.schema_key"  # IPC schema metadata of a changes table: its (database, table, version)
_TABLE_SCHEMA = b"ticdc.table_schema"  # IPC schema metadata of a changes table: the schema that typed it
_CPU_NS = b"ticdc.cpu_ns"  # IPC schema metadata of `records`: the task's CPU time on this segment
_ANNOUNCED = b"ticdc.announced"  # IPC schema metadata of `records`: the schemas its BOOTSTRAPs and DDLs name
_KEY = msgspec.msgpack.Decoder(tuple[str, str, int])
_ANNOUNCED_SCHEMAS = msgspec.msgpack.Decoder(list[TableSchema])
_SCHEMA = msgspec.msgpack.Decoder(TableSchema)


class SpoolFile(msgspec.Struct, array_like=True, frozen=True):
    """A spooled version's file: its path, its rows' size in memory and its DMLs (an index filtered down to
    fewer no longer takes the whole file)."""

    path: str
    nbytes: int
    dmls: int


_SPOOL_FILE = msgspec.msgpack.Decoder(SpoolFile)


@dataclass
class Segment:
    """One partition's records of a range, and the changelog tables of the rows already typed (of a
    spooled version: its index, the rows being in the file `spooled` names, with their size in memory)."""

    topic: str
    partition: int
    start_offset: int
    end_offset: int
    records: pa.Table
    changes: dict[SchemaKey, pa.Table] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    schemas: dict[SchemaKey, TableSchema] = field(default_factory=dict)  # the ones that typed `changes`
    spooled: dict[SchemaKey, SpoolFile] = field(default_factory=dict)
    announced: list[TableSchema] = field(default_factory=list)  # by its BOOTSTRAPs and DDLs

    @property
    def tp(self) -> TopicPartition:
        return (self.topic, self.partition)

    @classmethod
    def from_row(cls, row: dict[str, object]) -> Segment:
        records = _read_ipc(row["records"])  # type: ignore[arg-type]
        changes, schemas, spooled = {}, {}, {}
        for data in row["changes"] or ():  # type: ignore[attr-defined]
            table = _read_ipc(data)
            described = table.schema.metadata
            key = _KEY.decode(described[_SCHEMA_KEY])
            changes[key] = table.replace_schema_metadata()
            schemas[key] = _SCHEMA.decode(described[_TABLE_SCHEMA])
            if _SPOOL in described:
                spooled[key] = _SPOOL_FILE.decode(described[_SPOOL])
        metadata = records.schema.metadata or {}
        return cls(
            str(row["topic"]),
            int(row["partition"]),  # type: ignore[call-overload]
            int(row["start_offset"]),  # type: ignore[call-overload]
            int(row["end_offset"]),  # type: ignore[call-overload]
            records.replace_schema_metadata(),
            changes,
            int(metadata.get(_CPU_NS, 0)) / 1e9,
            schemas,
            spooled,
            _ANNOUNCED_SCHEMAS.decode(metadata[_ANNOUNCED]) if _ANNOUNCED in metadata else [],
        )

    def to_row(self) -> dict[str, object]:
        changes = []
        for key, table in self.changes.items():
            described = {
                _SCHEMA_KEY: msgspec.msgpack.encode(key),
                _TABLE_SCHEMA: msgspec.msgpack.encode(self.schemas[key]),
            }
            if key in self.spooled:
                described[_SPOOL] = msgspec.msgpack.encode(self.spooled[key])
            changes.append(_ipc(table.replace_schema_metadata(described)))
        cpu = {_CPU_NS: str(round(self.cpu_seconds * 1e9)).encode()}
        if self.announced:
            cpu[_ANNOUNCED] = msgspec.msgpack.encode(self.announced)
        return {
            "topic": self.topic,
            "partition": self.partition,
            "start_offset": self.start_offset,
            "end_offset": self.end_offset,
            "records": _ipc(self.records.replace_schema_metadata(cpu)),
            "changes": changes,
        }

    def from_offset(self, start: int) -> Segment:
        """The records at `start` and after (the sinks already hold the others)."""
        if start <= self.start_offset:
            return self
        return self._where(lambda offsets: pc.greater_equal(offsets, start), max(start, self.start_offset))

    def kept(self, offsets: Iterable[int]) -> Segment:
        """Only the records at `offsets` (what the engine carries to the next batch), from the first."""
        wanted = pa.array(sorted(set(offsets)), pa.int64())
        kept = self._where(lambda column: pc.is_in(column, value_set=wanted), self.start_offset)
        held = kept.offsets()
        if len(held):
            kept.start_offset = int(held.min())
        return kept

    def offsets(self) -> np.ndarray:
        """The offsets of the records it holds, typed or not (unordered)."""
        columns = [self.records["offset"].to_numpy()]
        columns += [table["_offset"].to_numpy() for table in self.changes.values()]
        return np.concatenate(columns)

    def _where(self, keep: Callable[[pa.ChunkedArray], pa.ChunkedArray], start: int) -> Segment:
        records = self.records.filter(keep(self.records["offset"]))
        changes = {}
        for key, table in self.changes.items():
            kept = table.filter(keep(table["_offset"]))
            if kept.num_rows:
                changes[key] = kept
        schemas = {key: self.schemas[key] for key in changes}
        spooled = {key: self.spooled[key] for key in changes if key in self.spooled}
        return Segment(
            self.topic,
            self.partition,
            start,
            self.end_offset,
            records,
            changes,
            self.cpu_seconds,
            schemas,
            spooled,
        )

    def spool(self, location: str) -> Segment:
        """The segment with its typed rows written to spool files under `location` (the engine's state
        location), carrying their index instead; the records it keeps are those not typed."""
        typed = self.records.filter(pc.is_valid(self.records["type"]))
        directory = f"{spool_uri(location)}/{SPOOL_DIRECTORY}/{self.topic}/{self.partition}"
        name = f"{self.start_offset}-{self.end_offset}-{uuid.uuid4().hex}"
        index, spooled = {}, {}
        for number, (key, rows) in enumerate(self.changes.items()):
            path = f"{directory}/{name}-{number}.arrow"
            write_spool_file(path, rows)
            index[key] = _index(typed, key, rows)
            spooled[key] = SpoolFile(path, rows.nbytes, index[key].num_rows)
        untyped = self.records.filter(pc.is_null(self.records["type"]))
        return replace(self, records=untyped, changes=index, spooled=spooled)

    def decoded(self, decoder: RecordDecoder) -> Iterator[DecodedRecord]:
        """The records the task did not type, for the state machine, in offset order, decoded here (a
        poll's worth at once): WATERMARKs, BOOTSTRAPs, DDLs, rows of versions it did not know, records that
        did not decode. The typed rows are `blocks()`."""
        kept = self.records.filter(pc.is_null(self.records["type"]))
        originals = [
            SourceRecord(self.topic, self.partition, offset, None, key, value)
            for offset, key, value in zip(
                kept["offset"].to_pylist(), kept["key"].to_pylist(), kept["value"].to_pylist(), strict=True
            )
        ]
        for original, message in zip(originals, decoder.decode_records(originals), strict=True):
            # a dead letter keeps the record's value and key
            yield original.location, message, original.value, original.key

    def blocks(self) -> list[RowBlock]:
        """The typed rows, for the state machine: a block per schema version (and table id), read from the
        records' headers (or a spooled version's index); the rows themselves stay in their changelog table
        (or spool file)."""
        typed = self.records.filter(pc.is_valid(self.records["type"]))
        blocks = []
        for key, changes in self.changes.items():
            if key in self.spooled:
                blocks += self._spooled_blocks(key, changes)
                continue
            rows = _headers_of(typed, key)
            if not rows.num_rows:
                continue
            ids = pc.unique(rows["table_id"]).to_pylist()
            whole = len(ids) == 1
            row_bytes = max(1, changes.nbytes // rows.num_rows)
            for table_id in ids:
                these = rows if whole else rows.filter(pc.equal(rows["table_id"], table_id))
                offsets, commit_ts = these["offset"].to_numpy(), these["commit_ts"].to_numpy()
                typed_by = self.schemas.get(key)
                block = RowBlock(
                    key, table_id, *self.tp, offsets, commit_ts, row_bytes, changes, whole, typed_by
                )
                blocks.append(block)
        return blocks

    def _spooled_blocks(self, key: SchemaKey, index: pa.Table) -> list[RowBlock]:
        spool = self.spooled[key]
        offsets, images = index["_offset"].to_numpy(), index["_images"].to_numpy()
        rows = SpooledRows(spool.path, offsets, images, spool.nbytes)
        row_bytes = max(1, spool.nbytes // spool.dmls)
        ids = index["_table_id"].to_numpy()
        commit_ts = index["_commit_ts"].to_numpy()
        distinct = np.unique(ids)
        whole = len(distinct) == 1 and len(offsets) == spool.dmls
        blocks = []
        for table_id in distinct.tolist():
            mask = slice(None) if whole else ids == table_id
            blocks.append(
                RowBlock(
                    key,
                    table_id,
                    *self.tp,
                    offsets[mask],
                    commit_ts[mask],
                    row_bytes,
                    rows,
                    whole,
                    self.schemas.get(key),
                )
            )
        return blocks


def _headers_of(typed: pa.Table, key: SchemaKey) -> pa.Table:
    """The typed records' headers of one schema version (`key`: database, table, version)."""
    database, table, version = key
    same = pc.and_(
        pc.and_(pc.equal(typed["database"], database), pc.equal(typed["table"], table)),
        pc.equal(typed["schema_version"], version),
    )
    return typed.filter(same)


def _index(typed: pa.Table, key: SchemaKey, rows: pa.Table) -> pa.Table:
    """The index of a schema version's typed rows: its DMLs' headers, and their changelog rows each."""
    headers = _headers_of(typed, key)
    offsets, images = np.unique(rows["_offset"].to_numpy(), return_counts=True)
    if not np.array_equal(offsets, headers["offset"].to_numpy()):
        raise AssertionError(f"{key}: the typed rows and their headers name different records")
    columns = [offsets, headers["commit_ts"].to_numpy(), headers["table_id"].to_numpy(), images]
    return pa.Table.from_arrays([pa.array(c, pa.int64()) for c in columns], schema=INDEX_SCHEMA)


def encode_range(
    topic: str,
    partition: int,
    start: int,
    end: int,
    records: Sequence[SourceRecord],
    schemas: SchemaCache,
    decoder: MessageDecoder | None,
    policy: ValuePolicy,
    cpu_seconds: float = 0.0,
) -> Segment:
    """A task's segment of the records it read from [start, end): every DML whose schema `schemas` knows or
    the range announces is typed; `schemas` learns the range's schemas (for the task's next range).
    Without a decoder (protocols whose records describe their own rows) every record is kept for the
    driver. `cpu_seconds`: what reading the records cost (the segment reports it with the decoding's)."""
    started = time.process_time()
    messages: list[DecodedMessage | None] = []
    announced: list[TableSchema] = []
    for decoded in decoder.decode_records(records) if decoder is not None else [None] * len(records):
        # a record that does not decode is decoded again by the driver, which meets the error under its policy
        message = None if isinstance(decoded, ConsumerError) else decoded
        messages.append(message)
        if isinstance(message, Bootstrap):
            announced.append(message.table_schema)
        elif isinstance(message, DDL):
            announced += [s for s in (message.table_schema, message.pre_table_schema) if s is not None]
    for schema in announced:
        schemas.add(schema)
    changes, typed = _typed_changes(topic, partition, records, messages, schemas, policy)
    table = _records_table(records, messages, typed)
    cpu = cpu_seconds + time.process_time() - started
    typed_by = {key: schema for key, (_, schema) in changes.items()}
    tables = {key: table for key, (table, _) in changes.items()}
    return Segment(
        topic, partition, start, end, table, tables, cpu, typed_by, announced=_last_of_each(announced)
    )


def _last_of_each(schemas: list[TableSchema]) -> list[TableSchema]:
    """`schemas` without repeats (BOOTSTRAPs come again and again): per key the first (a `SchemaCache` keeps
    the first it learns), placed where its key came last (and keeps it that recent)."""
    first = {schema.key: schema for schema in reversed(schemas)}
    return list(reversed(first.values()))


def _typed_changes(
    topic: str,
    partition: int,
    records: Sequence[SourceRecord],
    messages: Sequence[DecodedMessage | None],
    schemas: SchemaCache,
    policy: ValuePolicy,
) -> tuple[dict[SchemaKey, tuple[pa.Table, TableSchema]], set[int]]:
    """Changelog tables per schema version the task knows (with the schema that typed them), and the indexes
    of the records they type. A task never raises for what a record holds: a row that does not decode or
    fails verification, and every row of a version whose schema `TableCodec` refuses, are left to the
    driver, whose state machine and writer apply the error policy to them as the loop engine does."""
    runs: dict[SchemaKey, list[int]] = {}
    for index, message in enumerate(messages):
        if isinstance(message, RawDML):
            runs.setdefault(message.schema_key, []).append(index)
    changes: dict[SchemaKey, tuple[pa.Table, TableSchema]] = {}
    typed: set[int] = set()
    for key, indexes in runs.items():
        first = messages[indexes[0]]
        assert isinstance(first, RawDML)
        schema = schemas.lookup(key, first.table_id)
        codec = None if schema is None else _codec(schema, policy)
        if schema is None or codec is None:
            continue
        rows = [(messages[i], RecordLocation(topic, partition, records[i].offset)) for i in indexes]
        while rows:
            try:
                changes[key] = (table_changes(codec, rows).changelog, schema)  # type: ignore[arg-type]
            except ConsumerError as exc:
                bad = _bad_rows(exc)
                if not bad:  # which rows is unknown: the driver decodes the run
                    break
                for row in sorted(bad, reverse=True):
                    del rows[row], indexes[row]
                continue
            typed.update(indexes)
            break
    return changes, typed


@cached(LRUCache(maxsize=256))  # per worker: building one takes ~0.4 ms, and every task types its tables
def _codec(schema: TableSchema, policy: ValuePolicy) -> TableCodec | None:
    """The codec of `schema`, or None when `TableCodec` refuses it. The task's cache holds schemas no
    decoder checked: a version learned under one name serves a DML naming its table id and version under
    any other name (`SchemaCache.lookup`), even one no table may have, and the engine's recorded schemas
    may predate the run's `decode.unknown_types`. The loop engine's writer sets such rows aside
    (`SchemaRejectedError`); a task raising here would fail the Spark job instead."""
    try:
        return TableCodec(schema, policy)
    except ConsumerError:
        return None


def _bad_rows(error: ConsumerError) -> list[int]:
    """The indexes, in a run, of the rows `error` names (a value that did not decode, rows that failed
    verification); none when it names no row."""
    if isinstance(error, RejectedRowsError):
        return list(error.rejected)
    row = error.row if isinstance(error, ValueDecodeError) else None
    return [] if row is None else [row]


def _records_table(
    records: Sequence[SourceRecord], messages: Sequence[DecodedMessage | None], typed: set[int]
) -> pa.Table:
    columns: list[list[object]] = [[] for _ in RECORDS_SCHEMA]
    offset, key, value, kind, database, table, table_id, commit_ts, build_ts, version, encoding = columns
    for index, (record, message) in enumerate(zip(records, messages, strict=True)):
        offset.append(record.offset)
        if index in typed:
            assert isinstance(message, RawDML)
            key.append(None)
            value.append(None)
            kind.append(message.type.value)
            database.append(message.database)
            table.append(message.table)
            table_id.append(message.table_id)
            commit_ts.append(message.commit_ts)
            build_ts.append(message.build_ts)
            version.append(message.schema_version)
            encoding.append(message.encoding)
        else:
            key.append(record.key)
            value.append(record.value)
            for column in columns[3:]:
                column.append(None)
    return pa.Table.from_arrays(
        [pa.array(column, f.type) for column, f in zip(columns, RECORDS_SCHEMA, strict=True)],
        schema=RECORDS_SCHEMA,
    )


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def _read_ipc(data: bytes) -> pa.Table:
    return pa.ipc.open_stream(data).read_all()
