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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from consumer.batches.changes import table_changes
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
_SCHEMA_KEY = b"ticdc.schema_key"  # IPC schema metadata of a changes table: its (database, table, version)
_TABLE_SCHEMA = b"ticdc.table_schema"  # IPC schema metadata of a changes table: the schema that typed it
_CPU_NS = b"ticdc.cpu_ns"  # IPC schema metadata of `records`: the task's CPU time on this segment
_KEY = msgspec.msgpack.Decoder(tuple[str, str, int])
_SCHEMA = msgspec.msgpack.Decoder(TableSchema)


@dataclass
class Segment:
    """One partition's records of a range, and the changelog tables of the rows already typed."""

    topic: str
    partition: int
    start_offset: int
    end_offset: int
    records: pa.Table
    changes: dict[SchemaKey, pa.Table] = field(default_factory=dict)
    cpu_seconds: float = 0.0
    schemas: dict[SchemaKey, TableSchema] = field(default_factory=dict)  # the ones that typed `changes`

    @property
    def tp(self) -> TopicPartition:
        return (self.topic, self.partition)

    @classmethod
    def from_row(cls, row: dict[str, object]) -> Segment:
        records = _read_ipc(row["records"])  # type: ignore[arg-type]
        changes, schemas = {}, {}
        for data in row["changes"] or ():  # type: ignore[attr-defined]
            table = _read_ipc(data)
            key = _KEY.decode(table.schema.metadata[_SCHEMA_KEY])
            changes[key] = table.replace_schema_metadata()
            schemas[key] = _SCHEMA.decode(table.schema.metadata[_TABLE_SCHEMA])
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
        )

    def to_row(self) -> dict[str, object]:
        changes = []
        for key, table in self.changes.items():
            described = {_SCHEMA_KEY: msgspec.msgpack.encode(key)}
            keyed = table.replace_schema_metadata(
                described | {_TABLE_SCHEMA: msgspec.msgpack.encode(self.schemas[key])}
            )
            changes.append(_ipc(keyed))
        cpu = {_CPU_NS: str(round(self.cpu_seconds * 1e9)).encode()}
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
        if kept.records.num_rows:
            kept.start_offset = kept.records["offset"][0].as_py()
        return kept

    def _where(self, keep: Callable[[pa.ChunkedArray], pa.ChunkedArray], start: int) -> Segment:
        records = self.records.filter(keep(self.records["offset"]))
        changes = {}
        for key, table in self.changes.items():
            kept = table.filter(keep(table["_offset"]))
            if kept.num_rows:
                changes[key] = kept
        schemas = {key: self.schemas[key] for key in changes}
        return Segment(
            self.topic, self.partition, start, self.end_offset, records, changes, self.cpu_seconds, schemas
        )

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
        records' headers; the rows themselves stay in their changelog table."""
        typed = self.records.filter(pc.is_valid(self.records["type"]))
        blocks = []
        for key, changes in self.changes.items():
            database, table, version = key
            same = pc.and_(
                pc.and_(pc.equal(typed["database"], database), pc.equal(typed["table"], table)),
                pc.equal(typed["schema_version"], version),
            )
            rows = typed.filter(same)
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


def merged(segments: Sequence[Segment]) -> Segment:
    """Segments of one partition, in offset order, as one."""
    first, last = segments[0], segments[-1]
    if len(segments) == 1:
        return first
    keys = dict.fromkeys(key for segment in segments for key in segment.changes)
    changes = {key: pa.concat_tables([s.changes[key] for s in segments if key in s.changes]) for key in keys}
    records = pa.concat_tables([segment.records for segment in segments])
    cpu = sum(segment.cpu_seconds for segment in segments)
    schemas = {key: schema for segment in segments for key, schema in segment.schemas.items()}
    return Segment(
        first.topic, first.partition, first.start_offset, last.end_offset, records, changes, cpu, schemas
    )


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
    for decoded in decoder.decode_records(records) if decoder is not None else [None] * len(records):
        # a record that does not decode is decoded again by the driver, which meets the error under its policy
        message = None if isinstance(decoded, ConsumerError) else decoded
        messages.append(message)
        if isinstance(message, Bootstrap):
            schemas.add(message.table_schema)
        elif isinstance(message, DDL):
            for schema in (message.table_schema, message.pre_table_schema):
                if schema is not None:
                    schemas.add(schema)
    changes, typed = _typed_changes(topic, partition, records, messages, schemas, policy)
    table = _records_table(records, messages, typed)
    cpu = cpu_seconds + time.process_time() - started
    typed_by = {key: schema for key, (_, schema) in changes.items()}
    tables = {key: table for key, (table, _) in changes.items()}
    return Segment(topic, partition, start, end, table, tables, cpu, typed_by)


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
