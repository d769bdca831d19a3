"""TiCDC's Debezium protocol (`protocol=debezium`, spec debezium-protocol.md): JSON change events shaped like
the Debezium MySQL connector's, plus TiCDC's DDL and WATERMARK events.

A DML's value usually carries its Connect schema (`schema.fields` of `before`/`after`): the decoder derives
the SDK's `TableSchema` from it (with `tidb_type` when TiCDC's extension is on, from the Connect types
alone otherwise, which cannot tell e.g. BIGINT from BIGINT UNSIGNED or text from base64 binary) and
announces it through `described_schema`. With `debezium-disable-schema` nothing types the values: such a
table's columns are `json` columns holding each value's raw JSON text. Values that the wire carries lossily
stay so: DECIMAL is a float64 (typed `double`), dates below year 100 arrive shifted, a NULL in a column with
a default arrives as the default.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from msgspec.structs import astuple

from consumer.errors import ConsumerError, MalformedMessageError, UnsupportedTypeError, ValueDecodeError
from consumer.protocol.checks import MessageChecks
from consumer.protocol.compression import LZ4_MAGIC, Compression, CompressionSetting, compress, decompress
from consumer.protocol.containment import KeyedValue, decoded_each, raise_contained
from consumer.protocol.model import (
    DDL,
    DML,
    TSO_PHYSICAL_SHIFT,
    Column,
    DataType,
    DDLType,
    DecodedMessage,
    DMLType,
    Index,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.rows import ImageKind
from consumer.protocol.self_described import (
    TEXT,
    enum_labels,
    joined_allowed,
    set_labels,
    split_allowed,
    stable_table_id,
)
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
    column_type,
    float32_text,
    fsp_of,
    in_python_range,
    json_document_text,
)
from consumer.protocol.validation import validate_schema

ENCODING = "debezium"
_OPS = {"c": DMLType.INSERT, "u": DMLType.UPDATE, "d": DMLType.DELETE}
_BINARY = frozenset(("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"))
_TEXTS = frozenset(("char", "varchar", "tinytext", "text", "mediumtext", "longtext"))
_INTS = frozenset(("tinyint", "smallint", "mediumint", "int", "bigint"))
_U64 = 1 << 64
_EPOCH = dt.date(1970, 1, 1)
_MAX_TIME_US = (838 * 3600 + 59 * 60 + 59) * 1_000_000


# -- the envelope -------------------------------------------------------------------------------------
class _Source(msgspec.Struct, gc=False):
    db: str = ""
    table: str = ""
    commit_ts: int = 0
    name: str = ""


class _DDLColumn(msgspec.Struct, gc=False):
    """A column of a DDL event's `tableChanges[].table` (spec §8)."""

    name: str
    typeName: str | None = None
    length: int | None = None
    optional: bool = False
    enumValues: list[str] | None = None


class _TableStructure(msgspec.Struct, gc=False):
    primaryKeyColumnNames: list[str] | None = None
    columns: list[_DDLColumn] | None = None


class _TableChange(msgspec.Struct, gc=False):
    id: str = ""
    table: _TableStructure | None = None


class _Payload(msgspec.Struct, gc=False):
    """Routing fields and a DDL's structure: `before`/`after` are skipped, not built."""

    op: str = ""
    source: _Source | None = None
    ddl: str | None = None
    databaseName: str | None = None
    tableChanges: list[_TableChange] | None = None


class _ConnectField(msgspec.Struct, gc=False):
    """A column's Connect schema in `before`/`after` (spec §5)."""

    field: str
    type: str = ""
    optional: bool = False
    name: str | None = None
    parameters: dict[str, str] | None = None
    tidb_type: str | None = None


class _SchemaPart(msgspec.Struct, gc=False):
    """One field of the value schema: only `before`/`after`'s column lists are read (typed)."""

    field: Any = None
    fields: msgspec.Raw = msgspec.Raw(b"null")


class _ValueSchema(msgspec.Struct, gc=False):
    fields: list[_SchemaPart] = []


class _Envelope(msgspec.Struct, gc=False):
    """Scanned once: the (large) schema is kept as bytes, the payload decoded from its own slice."""

    payload: msgspec.Raw
    schema: msgspec.Raw = msgspec.Raw(b"null")


class _KeyEnvelope(msgspec.Struct, gc=False):
    payload: dict[str, msgspec.Raw] = {}
    schema: msgspec.Raw = msgspec.Raw(b"null")


class _Images(msgspec.Struct, gc=False):
    before: dict[str, msgspec.Raw] | None = None
    after: dict[str, msgspec.Raw] | None = None


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_PAYLOAD = msgspec.json.Decoder(_Payload)
_KEY = msgspec.json.Decoder(_KeyEnvelope)
_IMAGES = msgspec.json.Decoder(_Images)
_VALUE_SCHEMA = msgspec.json.Decoder(_ValueSchema)
_CONNECT_FIELDS = msgspec.json.Decoder(list[_ConnectField])
_NULL = b"null"
_PAYLOAD_KEY = b'{"payload":'
_PAYLOAD_START = len(_PAYLOAD_KEY)
_KNOWN_SCHEMAS = 16  # value schemas `_split_known` matches by their bytes
# msgspec reports invalid UTF-8 inside a string as UnicodeDecodeError, not as one of its own errors.
_INVALID = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)


@dataclass(frozen=True)
class _Described:
    """A table version derived from a record's schema, and the bytes it was derived from."""

    value_schema: bytes
    key_identity: Any
    schema: TableSchema
    key_raw: msgspec.Raw | None = None  # the key's schema when it has one, to compare with a parsed key's


class DebeziumDecoder:
    """Kafka record (key, value) -> message, per spec §3; `compression` as configured for the changefeed's
    large-message-handle-compression ("auto": a value starting with `{` is plain JSON)."""

    registry = None  # values are self-contained JSON (see `RecordDecoder`)

    def __init__(self, compression: CompressionSetting = "auto", policy: ValuePolicy | None = None) -> None:
        self.compression = compression
        self.policy = policy or ValuePolicy()
        self._checks = MessageChecks(self.policy.limits, self.policy.unknown_types)
        self._latest: dict[tuple[str, str], _Described] = {}
        self._by_version: dict[tuple[str, str, int], TableSchema] = {}
        self._suffixes: list[tuple[bytes, bytes]] = []  # (`,"schema":S}`, S) of recent DMLs: `_split_known`

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None:
        return self._by_version.get(key)

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        return decoded_each(self.decode_record, records)

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        try:
            known = self._known_dml(key, value) if self._suffixes else None
            return known if known is not None else self._decode_record(key, value)
        except BaseException as exc:
            raise_contained(exc, "decoding a Debezium record")

    def _known_dml(self, key: bytes | None, value: bytes | None) -> RawDML | None:
        """`_decode_record` in one step for a DML of the latest version of its table: plain JSON key and
        value laid out as TiCDC writes them, the value's schema one of `_split_known`'s (compared as bytes),
        the key's schema the one that version was derived with, a commit ts already
        known plausible. None for anything else, and never an error: then `_decode_record` decodes the
        record (the same message, a property test). One flat function: it runs for every record."""
        if not key or not value or key[:1] != b"{" or self.compression not in ("auto", "none"):
            return None
        suffix, schema_bytes = self._suffixes[0]
        if not value.endswith(suffix) or not value.startswith(_PAYLOAD_KEY):  # not the latest schema
            split = self._split_known(value)
            if split is None:
                return None
            body, schema_bytes, payload = split
        else:
            body = value[_PAYLOAD_START : len(value) - len(suffix)]
            if body[:1] != b"{" or body[-1:] != b"}":
                return None
            try:
                payload = _PAYLOAD.decode(body)
            except _INVALID:
                return None
        kind = _OPS.get(payload.op)
        source = payload.source
        if kind is None or source is None or not source.table:
            return None
        commit_ts = source.commit_ts
        if not 0 < commit_ts <= self._checks.ceiling:  # `MessageChecks.commit_ts`'s own shortcut
            return None
        found = self._latest.get((source.db, source.table))
        if found is None or found.key_raw is None or found.value_schema != schema_bytes:
            return None
        try:
            if _KEY.decode(key).schema != found.key_raw:
                return None
        except _INVALID:
            return None
        schema = found.schema
        return RawDML(
            type=kind,
            database=source.db,
            table=source.table,
            table_id=schema.table_id,
            commit_ts=commit_ts,
            build_ts=0,
            schema_version=schema.version,
            payload=body,
            encoding=ENCODING,
        )

    def _decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        if not value:
            raise MalformedMessageError("a Debezium record without a value (TiCDC never writes tombstones)")
        if self.compression != "auto" or value[:1] != b"{":  # else plain JSON, as `_plain` would say
            value = self._plain(value)
        split = self._split_known(value)
        if split is not None:
            body, schema_bytes, payload = split
        else:
            try:
                envelope = _ENVELOPE.decode(value)
                body = bytes(envelope.payload)
                payload = _PAYLOAD.decode(body)
            except _INVALID as exc:
                raise self._invalid("JSON", value, exc) from exc
            schema_bytes = bytes(envelope.schema)
            if payload.op in _OPS:
                self._remember_suffix(value, schema_bytes)
        source = payload.source
        kind = _OPS.get(payload.op)
        if kind is not None:
            if source is None or not source.table:
                raise MalformedMessageError("a Debezium DML without source.db/table")
            self._checks.commit_ts(source.commit_ts, "DML")
            schema = self._described(source, schema_bytes, key, body)
            return RawDML(
                type=kind,
                database=source.db,
                table=source.table,
                table_id=schema.table_id,
                commit_ts=source.commit_ts,
                build_ts=0,
                schema_version=schema.version,
                payload=body,  # the `payload` object only: the rows' decode need not scan the schema again
                encoding=ENCODING,
            )
        if payload.op == "m":
            if source is None:
                raise MalformedMessageError("a WATERMARK without source.commit_ts")
            return self._checks.message(Watermark(commit_ts=source.commit_ts, build_ts=0))
        if not payload.op and payload.ddl is not None and source is not None:
            return self._checks.message(_ddl(payload, source, typed=schema_bytes != _NULL))
        raise MalformedMessageError(f"unknown Debezium op {payload.op!r}")

    def _split_known(self, value: bytes) -> tuple[bytes, bytes, _Payload] | None:
        """(payload bytes, schema bytes, payload) of a value laid out as TiCDC writes it,
        `{"payload":{...},"schema":S}`, whose schema S is one a recent DML carried: the (large) schema is
        matched by comparing bytes, not scanned as JSON. The payload must decode as exactly one JSON object,
        so the value is that document. None for anything else (then the whole value is decoded): the same
        answer either way (a property test), the known schema only saves the scan."""
        if not value.startswith(_PAYLOAD_KEY):
            return None
        for position, (suffix, schema_bytes) in enumerate(self._suffixes):
            if value.endswith(suffix):
                body = value[_PAYLOAD_START : len(value) - len(suffix)]
                if not body.startswith(b"{") or not body.endswith(b"}"):
                    return None
                try:
                    payload = _PAYLOAD.decode(body)
                except _INVALID:
                    return None
                if position:  # most recently used first
                    self._suffixes.insert(0, self._suffixes.pop(position))
                return body, schema_bytes, payload
        return None

    def _remember_suffix(self, value: bytes, schema_bytes: bytes) -> None:
        """Remember a DML's schema for `_split_known` when the value is laid out as TiCDC writes it."""
        if schema_bytes == _NULL or not value.startswith(_PAYLOAD_KEY):
            return
        suffix = b',"schema":' + schema_bytes + b"}"
        if value.endswith(suffix) and all(known != suffix for known, _ in self._suffixes):
            self._suffixes.insert(0, (suffix, schema_bytes))
            del self._suffixes[_KNOWN_SCHEMAS:]

    def _plain(self, value: bytes) -> bytes:
        """Keys and values are JSON, compressed only when the changefeed says so (spec §2): `auto` takes an
        LZ4 frame by its magic and anything else for JSON. A snappy block has no mark (its first byte, a
        length, may be any byte): guessing it made every bad value a bad snappy block, so snappy is
        configured."""
        compression = self.compression
        if compression == "auto":
            compression = "lz4" if value.startswith(LZ4_MAGIC) else "none"
        if compression == "none":
            return value
        return decompress(value, compression, self.policy.limits.max_decompressed_bytes)

    def _described(self, source: _Source, schema_bytes: bytes, key: bytes | None, body: bytes) -> TableSchema:
        """The record's table version: derived once per distinct (value schema, key) of a table."""
        name = (source.db, source.table)
        parsed = self._parsed_key(key)
        if parsed is not None and schema_bytes != _NULL:  # the latest version's, `_key` without copies
            found = self._latest.get(name)
            if found is not None and found.value_schema == schema_bytes and parsed.schema == found.key_raw:
                return found.schema
        return self._derived(name, source, schema_bytes, parsed, body)

    def _derived(
        self,
        name: tuple[str, str],
        source: _Source,
        schema_bytes: bytes,
        key: _KeyEnvelope | None,
        body: bytes,
    ) -> TableSchema:
        key_identity, keys = _key_of(key)
        if schema_bytes == _NULL:  # schema disabled: the identity is the column names
            try:
                images = _IMAGES.decode(body)
            except _INVALID as exc:
                raise MalformedMessageError(f"invalid Debezium row images: {exc}") from exc
            schema_bytes = "\0".join(images.after or images.before or {}).encode()
            typed = False
        else:
            typed = True
        found = self._latest.get(name)
        if found is not None and found.value_schema == schema_bytes and found.key_identity == key_identity:
            return found.schema
        derive = _typed_schema if typed else _untyped_schema
        table = derive(source.db, source.table, schema_bytes, keys)
        validate_schema(table, self.policy.unknown_types)
        key_raw = msgspec.Raw(key_identity) if isinstance(key_identity, bytes) else None
        self._latest[name] = _Described(schema_bytes, key_identity, table, key_raw)
        self._by_version[table.key] = table
        return table

    def _parsed_key(self, key: bytes | None) -> _KeyEnvelope | None:
        """The key, compressed as the value is (spec §2); None for none."""
        if not key:
            return None
        plain = self._plain(key)
        try:
            return _KEY.decode(plain)
        except _INVALID as exc:
            raise self._invalid("key", plain, exc) from exc

    def _invalid(self, what: str, data: bytes, exc: Exception) -> MalformedMessageError:
        """Bytes that are no JSON document of the envelope's shape. Under `auto`, bytes that do not even
        start like JSON may be snappy's, which is never guessed: the reason says so."""
        hint = ""
        if (
            self.compression == "auto"
            and not isinstance(exc, msgspec.ValidationError)
            and data.lstrip()[:1] not in (b"{", b"[")
        ):
            hint = " (not JSON: a changefeed compressing with snappy needs compression = snappy)"
        return MalformedMessageError(f"invalid Debezium {what}: {exc}{hint}")


def _key_of(parsed: _KeyEnvelope | None) -> tuple[Any, tuple[str, ...]]:
    """(identity, key column names): the identity is the key schema's bytes, or the names when the schema is
    disabled."""
    if parsed is None:
        return (), ()
    names = tuple(parsed.payload)
    schema = bytes(parsed.schema)
    return (schema if schema != _NULL else names), names


def _length(text: str, name: str) -> int:
    """A length parameter (Connect parameters are text)."""
    if not text.isdigit() or len(text) > 10:
        raise MalformedMessageError(f"column {name!r}: length parameter {text[:20]!r} is not a length")
    return int(text)


def _version(*parts: bytes | str) -> int:
    digest = hashlib.blake2b(digest_size=8)
    for part in parts:
        digest.update(part.encode() if isinstance(part, str) else part)
        digest.update(b"\0")
    return int.from_bytes(digest.digest(), "big") >> 2  # a positive int64


def _typed_schema(database: str, table: str, schema_bytes: bytes, keys: tuple[str, ...]) -> TableSchema:
    try:
        parts = _VALUE_SCHEMA.decode(schema_bytes).fields
        image = next((p.fields for p in parts if p.field in ("after", "before")), None)
        fields = _CONNECT_FIELDS.decode(image) if image is not None and bytes(image) != _NULL else None
    except _INVALID as exc:
        raise MalformedMessageError(f"invalid Debezium schema: {exc}") from exc
    if fields is None:
        raise MalformedMessageError("the Debezium schema has no before/after fields")
    columns = tuple(_column(f) for f in fields)
    return _table(database, table, columns, keys, _version(database, table, schema_bytes, *keys))


UNTYPED_JSON = DataType("json", collate="debezium-untyped")
"""The type of a column nothing types (`debezium-disable-schema`): a `json` column holding each value's wire
JSON. Marked apart from a typed JSON column, whose value is a JSON document sent as a string."""


def _untyped_schema(database: str, table: str, names: bytes, keys: tuple[str, ...]) -> TableSchema:
    """No schema on the wire: each column keeps its raw JSON value."""
    columns = tuple(
        Column(name, UNTYPED_JSON, nullable=name not in keys) for name in names.decode().split("\0") if name
    )
    return _table(database, table, columns, keys, _version(database, table, b"untyped", names, *keys))


def _table(
    database: str, table: str, columns: tuple[Column, ...], keys: tuple[str, ...], version: int
) -> TableSchema:
    return TableSchema(
        database=database,
        table=table,
        table_id=stable_table_id(database, table),
        version=version,
        columns=columns,
        indexes=(Index("primary", True, True, False, keys),) if keys else (),
    )


_SEMANTIC = {
    "io.debezium.time.Date": DataType("date"),
    "io.debezium.time.Timestamp": DataType("datetime", decimal=3),
    "io.debezium.time.MicroTimestamp": DataType("datetime", decimal=6),
    "io.debezium.time.ZonedTimestamp": DataType("timestamp", decimal=6),
    "io.debezium.time.MicroTime": DataType("time", decimal=6),
    "io.debezium.time.Year": DataType("year"),
    "io.debezium.data.Json": DataType("json"),
    "io.debezium.data.TiDBVectorFloat32": DataType("vector"),
}
_CONNECT = {"int16": "smallint", "int32": "int", "int64": "bigint", "float": "float", "double": "double"}


def _column(field: _ConnectField) -> Column:
    return Column(field.field, _data_type(field, field.field), nullable=field.optional)


def _data_type(field: _ConnectField, name: str) -> DataType:
    semantic = field.name
    params = field.parameters or {}
    if semantic in _SEMANTIC:
        return _SEMANTIC[semantic]
    if semantic == "io.debezium.data.Bits":
        return DataType("bit", length=_length(params.get("length") or "1", name), unsigned=True)
    if semantic == "io.debezium.data.Enum":
        return DataType("enum", **TEXT, elements=split_allowed(params.get("allowed", "")))
    if semantic == "io.debezium.data.EnumSet":
        allowed = params.get("allowed", "")
        return DataType("set", **TEXT, elements=tuple(allowed.split(",")) if allowed else ())
    connect = field.type
    if connect == "boolean":
        return DataType("bit", length=1, unsigned=True)
    if field.tidb_type is not None:
        return _tidb_data_type(field.tidb_type, name)
    if connect in _CONNECT:
        return DataType(_CONNECT[connect])
    if connect == "string":
        return DataType("varchar", **TEXT)
    raise UnsupportedTypeError(f"column {name!r}: Connect type {connect!r} is not TiCDC Debezium")


def _tidb_data_type(tidb_type: str, name: str) -> DataType:
    base, _, flag = tidb_type.partition(" ")
    unsigned = flag == "unsigned"
    if base in _INTS or base in ("float", "double"):
        return DataType(base, unsigned=unsigned)
    if base == "decimal":
        return DataType("double")  # the wire holds a float64 (spec §6.1): typed as what it is
    if base in _TEXTS:
        return DataType(base, **TEXT)
    if base in _BINARY:
        return DataType(base)
    raise UnsupportedTypeError(f"column {name!r}: tidb_type {tidb_type!r} without its Debezium semantic name")


# -- DDL ----------------------------------------------------------------------------------------------
_STATEMENT = re.compile(
    r"^\s*(CREATE|DROP|TRUNCATE|RENAME|ALTER)\s+(?:UNIQUE\s+|FULLTEXT\s+)?(TABLES?|INDEX|VIEW|DATABASE|SCHEMA)",
    re.IGNORECASE,
)
_KINDS = {
    ("CREATE", "TABLE"): DDLType.CREATE,
    ("CREATE", "TABLES"): DDLType.CREATE,
    ("CREATE", "INDEX"): DDLType.CINDEX,
    ("DROP", "TABLE"): DDLType.ERASE,
    ("DROP", "INDEX"): DDLType.DINDEX,
    ("TRUNCATE", "TABLE"): DDLType.TRUNCATE,
    ("RENAME", "TABLE"): DDLType.RENAME,
    ("RENAME", "TABLES"): DDLType.RENAME,
    ("ALTER", "TABLE"): DDLType.ALTER,
}
_QUOTED_ID = re.compile(r'"((?:[^"]|"")*)"\."((?:[^"]|"")*)"')


def _ddl(payload: _Payload, source: _Source, *, typed: bool) -> DDL:
    """A DDL event: its type from the statement, its table's structure from `tableChanges` (spec §8)."""
    sql = payload.ddl or ""
    found = _STATEMENT.match(sql)
    kind = (
        _KINDS.get((found.group(1).upper(), found.group(2).upper()), DDLType.QUERY)
        if found
        else DDLType.QUERY
    )
    change = payload.tableChanges[0] if payload.tableChanges else _TableChange()
    if kind is DDLType.ALTER and re.search(r"\bADD\s+(UNIQUE\s+)?(INDEX|KEY)\b", sql, re.IGNORECASE):
        kind = DDLType.CINDEX
    table = source.table
    schema = pre = None
    if table and kind is not DDLType.QUERY:
        schema = _ddl_schema(source.db, table, change.table, typed)
        if kind is DDLType.RENAME:
            old = _QUOTED_ID.findall(change.id)
            if old:
                pre = msgspec.structs.replace(schema, database=old[0][0], table=old[0][1])
    return DDL(
        type=kind,
        sql=sql,
        commit_ts=source.commit_ts,
        build_ts=0,
        table_schema=schema,
        pre_table_schema=pre,
        database=source.db if schema is None else "",  # a database-level DDL's (spec §8.2)
    )


def _ddl_schema(database: str, table: str, structure: _TableStructure | None, typed: bool) -> TableSchema:
    """The table after the DDL; names only when the event has no structure (DROP, TRUNCATE)."""
    if structure is None:
        return _table(database, table, (), (), _version(database, table, b"names"))
    keys = tuple(structure.primaryKeyColumnNames or ())
    columns = tuple(_ddl_column(c, typed) for c in structure.columns or ())
    identity = msgspec.json.encode(structure)
    return _table(database, table, columns, keys, _version(database, table, identity))


def _ddl_column(column: _DDLColumn, typed: bool) -> Column:
    name, nullable = column.name, column.optional
    if not typed:
        return Column(name, UNTYPED_JSON, nullable)
    type_name = (column.typeName or "").lower()
    base, _, flags = type_name.partition(" ")
    length = column.length or 0
    if base in ("enum", "set"):
        elements = tuple(e[1:-1] if e.startswith("'") else e for e in column.enumValues or ())
        return Column(name, DataType(base, **TEXT, elements=elements), nullable)
    if base in ("datetime", "timestamp", "time"):
        return Column(name, DataType(base, decimal=length), nullable)
    if base == "bit":
        return Column(name, DataType("bit", length=length or 1, unsigned=True), nullable)
    if base == "decimal":
        return Column(name, DataType("double"), nullable)
    if base in _INTS or base in ("float", "double"):
        return Column(name, DataType(base, unsigned="unsigned" in flags), nullable)
    if base in _TEXTS:
        return Column(name, DataType(base, **TEXT), nullable)
    if base in _BINARY or base in ("date", "year", "json", "vector"):
        return Column(name, DataType(base), nullable)
    raise UnsupportedTypeError(f"column {name!r}: DDL type {type_name!r} is not TiCDC Debezium")


# -- rows ---------------------------------------------------------------------------------------------
def _wire_kind(column: ColumnType) -> Any:
    """What msgspec decodes a column's JSON value into (base64 text straight to bytes, in C)."""
    kind = column.data_type.mysql_type
    if kind in _INTS or kind in ("date", "datetime", "time", "year"):
        return int
    if kind in ("float", "double"):
        return float
    if kind in _BINARY:
        return bytes
    if kind == "bit":
        return bool if max(column.data_type.length, 1) == 1 else bytes
    if kind == "timestamp":
        return dt.datetime
    return str


class DebeziumRows:
    """The rows of one table version -> typed images, through a msgspec Struct generated for the table."""

    def __init__(self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy) -> None:
        self.schema = schema
        self.columns = tuple(columns)
        self.policy = policy
        self.image_schema = pa.schema([pa.field(c.name, c.arrow_type) for c in self.columns])
        self._untyped = bool(self.columns) and all(c.data_type == UNTYPED_JSON for c in self.columns)
        self._keys = set(schema.handle_key())
        fields = [
            (f"c{i}", msgspec.Raw, msgspec.Raw(_NULL))
            if self._untyped
            else (f"c{i}", _wire_kind(c) | None, None)
            for i, c in enumerate(self.columns)
        ]
        try:
            row: Any = msgspec.defstruct(
                f"Debezium_{schema.table}",
                fields,
                rename={f"c{i}": c.name for i, c in enumerate(self.columns)},
            )
        except ValueError:  # names msgspec cannot rename to (`\\`, `"`, control characters)
            row = None
        self._row = row
        # Without a Struct, rows decode as dicts of raw JSON, each column's values then as its wire kind.
        self._values = [msgspec.json.Decoder(_wire_kind(c) | None) for c in self.columns]
        image = row if row is not None else dict[str, msgspec.Raw]
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_payload_struct(image))
        # TIMESTAMP columns read as text, parsed by Arrow (`_stamps_of_text`): pyarrow is slow to take
        # zone-aware datetimes. Only for the Struct: the dict path is the fallback's fallback.
        self._text_decoder: msgspec.json.Decoder[Any] | None = None
        if row is not None and not self._untyped and any(_is_stamp(c) for c in self.columns):
            text_row = msgspec.defstruct(
                f"DebeziumText_{schema.table}",
                [
                    (f"c{i}", (str if _is_stamp(c) else _wire_kind(c)) | None, None)
                    for i, c in enumerate(self.columns)
                ],
                rename={f"c{i}": c.name for i, c in enumerate(self.columns)},
            )
            self._text_decoder = msgspec.json.Decoder(_payload_struct(text_row))

    def images(self, raws: Sequence[RawDML]) -> tuple[pa.RecordBatch, list[int], list[int], list[bool]]:
        """(rows, source, kinds, key_only) as `AvroRows.images` gives them."""
        if self._text_decoder is not None:
            try:
                return self._images(raws, self._text_decoder, text=True)
            except Exception:  # whatever the text path does not settle, the general path does
                pass  # ... giving the same rows, or naming the bad record, row and column (a property test)
        return self._images(raws, self._decoder, text=False)

    def _images(
        self, raws: Sequence[RawDML], decoder: msgspec.json.Decoder[Any], *, text: bool
    ) -> tuple[pa.RecordBatch, list[int], list[int], list[bool]]:
        decode = decoder.decode
        try:
            bodies = [decode(raw.payload) for raw in raws]
        except _INVALID:
            bodies = None  # the loop below names the record
        if bodies is not None and all(raw.type is DMLType.INSERT for raw in raws):
            inserted = [body.after for body in bodies]
            if all(image is not None for image in inserted):  # else the loop below names the record
                count = len(raws)
                return (
                    self._batch(inserted, text),
                    list(range(count)),
                    [ImageKind.INSERT] * count,
                    [False] * count,
                )
        images: list[Any] = []
        source: list[int] = []
        kinds: list[int] = []
        for index, raw in enumerate(raws):
            try:
                body = bodies[index] if bodies is not None else decode(raw.payload)
            except _INVALID as exc:
                raise ValueDecodeError(str(exc), column=_column_in(str(exc)), row=index) from exc
            if raw.type is DMLType.UPDATE:
                if body.before is not None:
                    images.append(body.before)
                    source.append(index)
                    kinds.append(ImageKind.UPDATE_OLD)
                images.append(body.after)
                kinds.append(ImageKind.UPDATE_NEW)
            elif raw.type is DMLType.INSERT:
                images.append(body.after)
                kinds.append(ImageKind.INSERT)
            else:
                images.append(body.before)
                kinds.append(ImageKind.DELETE)
            source.append(index)
            if images[-1] is None:
                raise ValueDecodeError(
                    f"a Debezium {raw.type.value} without its row image", column="<row>", row=index
                )
        try:
            batch = self._batch(images, text)
        except ValueDecodeError as exc:
            if exc.row is not None:
                exc.row = source[exc.row]
            raise
        return batch, source, kinds, [False] * len(images)

    def _batch(self, images: list[Any], text: bool = False) -> pa.RecordBatch:
        if self._row is not None and self.columns:
            values: list[Sequence[Any]] = (
                list(zip(*map(astuple, images), strict=True)) if images else [()] * len(self.columns)
            )
        else:
            values = [[image.get(c.name) for image in images] for c in self.columns]
            if not self._untyped:
                values = [
                    _wire_values(c, d, v) for c, d, v in zip(self.columns, self._values, values, strict=True)
                ]
        arrays = [
            _stamps_of_text(list(column_values))
            if text and _is_stamp(column)
            else self._typed(column, list(column_values))
            for column, column_values in zip(self.columns, values, strict=True)
        ]
        if not self.columns:
            return pa.RecordBatch.from_pylist([{}] * len(images), schema=self.image_schema)
        return pa.RecordBatch.from_arrays(arrays, schema=self.image_schema)

    def _typed(self, column: ColumnType, values: list[Any]) -> pa.Array:
        if self._untyped:
            return column.from_json(_json_texts(values, column.name))
        try:
            return _typed_values(column, values)
        except ValueDecodeError:
            raise
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
            for row, value in enumerate(values):
                try:
                    _typed_values(column, [value])
                except (pa.ArrowException, ValueError, TypeError, OverflowError) as bad:
                    raise ValueDecodeError(
                        f"value {value!r:.80} is not a valid {column.data_type.mysql_type}: {bad}",
                        column=column.name,
                        row=row,
                    ) from bad
            raise ValueDecodeError(str(exc), column=column.name) from exc


def _payload_struct(image: Any) -> Any:
    return msgspec.defstruct("Payload", [("before", image | None, None), ("after", image | None, None)])


def _is_stamp(column: ColumnType) -> bool:
    return column.data_type.mysql_type == "timestamp"


class _Unsettled(Exception):
    """A fast path's input it does not decide on: the general path decodes it."""


# ZonedTimestamp text as TiCDC writes it (`wire_value`), years 0001-9999: within it, Arrow's parse accepts
# what msgspec's RFC 3339 parse accepts (both reject Feb 30, 24:00, leap seconds) with the same instant.
_STAMP_TEXT = (
    r"^(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])-[0-9]{2}-[0-9]{2}"
    r"T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?Z$"
)
_UTC_US = pa.timestamp("us", tz="UTC")


def _stamps_of_text(values: list[str | None]) -> pa.Array:
    """A TIMESTAMP column's wire text -> timestamp[us, UTC], as `_typed_values` makes of msgspec's datetimes;
    `_Unsettled` (or Arrow's error) for text outside `_STAMP_TEXT` or that Arrow does not parse."""
    texts = pa.array(values, pa.string())
    if pc.all(pc.match_substring_regex(texts, _STAMP_TEXT)).as_py() is False:
        raise _Unsettled("a TIMESTAMP not in TiCDC's layout")
    return in_python_range(texts.cast(_UTC_US))


def _wire_values(column: ColumnType, decoder: msgspec.json.Decoder[Any], raws: Sequence[Any]) -> list[Any]:
    """Raw JSON values of a column decoded as its Struct field would decode them."""
    out = []
    for row, raw in enumerate(raws):
        try:
            out.append(None if raw is None else decoder.decode(raw))
        except _INVALID as exc:
            raise ValueDecodeError(str(exc), column=column.name, row=row) from exc
    return out


def _json_texts(values: list[Any], name: str) -> list[str | None]:
    """Raw JSON values of an untyped column as text (msgspec does not check a Raw span's UTF-8)."""
    out: list[str | None] = []
    for row, value in enumerate(values):
        raw = None if value is None else bytes(value)
        try:
            out.append(None if raw is None or raw == _NULL else raw.decode())
        except UnicodeDecodeError as exc:
            raise ValueDecodeError(f"value is not UTF-8: {exc}", column=name, row=row) from exc
    return out


def _typed_values(column: ColumnType, values: list[Any]) -> pa.Array:
    """One column's wire values (spec §6.1) -> its SDK Arrow array."""
    data_type = column.data_type
    kind = data_type.mysql_type
    if kind == "bigint" and data_type.unsigned:
        return column.from_json([v + _U64 if v is not None and v < 0 else v for v in values])
    if kind in _INTS or kind == "year":
        return column.from_json(values)
    if kind in ("float", "double"):
        return pa.array(values, pa.float64()).cast(column.arrow_type, safe=False)
    if kind == "date":
        return in_python_range(pa.array(values, pa.int32()).cast(pa.date32()))
    if kind == "datetime":
        unit = "ms" if data_type.decimal <= 3 else "us"
        return in_python_range(pa.array(values, pa.int64()).cast(pa.timestamp(unit)).cast(pa.timestamp("us")))
    if kind == "timestamp":
        return in_python_range(pa.array(values, pa.timestamp("us", tz="UTC")))
    if kind == "time":
        micros = pa.array(values, pa.int64())
        if len(micros) and pc.any(pc.greater(pc.abs(micros), _MAX_TIME_US)).as_py():
            raise ValueError("duration beyond 838:59:59.999999")
        return micros.cast(pa.duration("us"))
    if kind == "bit":
        if max(data_type.length, 1) == 1:
            return pa.array(values, pa.bool_())
        return column.from_json([None if v is None else int.from_bytes(v, "little") for v in values])
    if kind == "enum":
        return enum_labels(pa.array(values, pa.string()), data_type.elements)
    if kind == "set":
        return set_labels(pa.array(values, pa.string()), data_type.elements)
    if kind in ("json", "vector"):
        return column.from_json(values)
    if kind in _BINARY:
        return pa.array(values, pa.binary())
    return pa.array(values, pa.string())


def _column_in(message: str) -> str:
    found = re.search(r"at `\$\.(?:before|after)\.(.+?)`", message)
    return found.group(1) if found else "<row>"


# -- encoding ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DebeziumOptions:
    """TiCDC's options for this protocol (spec §11) that change the wire."""

    tidb_extension: bool = False
    disable_schema: bool = False
    output_old_value: bool = True
    cluster_id: str = "default"
    compression: Compression = "none"


class DebeziumEncoder:
    """Typed messages -> (key, value) records as TiCDC writes them (spec §4-§9)."""

    def __init__(self, options: DebeziumOptions | None = None, policy: ValuePolicy | None = None) -> None:
        self.options = options or DebeziumOptions()
        self.policy = policy or ValuePolicy()
        self._types: dict[tuple[str, str, int], tuple[ColumnType, ...]] = {}

    def encode_dml(self, dml: DML, schema: TableSchema, wall_ms: int = 0) -> tuple[bytes, bytes]:
        types = self._column_types(schema)
        op = {DMLType.INSERT: "c", DMLType.UPDATE: "u", DMLType.DELETE: "d"}[dml.type]
        before = dml.old if dml.type is not DMLType.INSERT else None
        if dml.type is DMLType.UPDATE and not self.options.output_old_value:
            before = None
        payload = {
            "source": self._source(schema.database, schema.table, dml.commit_ts),
            "ts_ms": wall_ms,
            "transaction": None,
            "op": op,
            "before": None if before is None else self._row(types, before),
            "after": None if dml.type is DMLType.DELETE else self._row(types, dml.data or {}),
        }
        keys = set(schema.handle_key())
        image = dml.old if dml.type is DMLType.DELETE else dml.data
        key_payload = {t.name: wire_value(t, (image or {}).get(t.name)) for t in types if t.name in keys}
        prefix = f"{self.options.cluster_id}.{schema.database}.{schema.table}"
        columns = [self._column_schema(t) for t in types]
        key_schema = {
            "type": "struct",
            "name": f"{prefix}.Key",
            "optional": False,
            "fields": [c for c, t in zip(columns, types, strict=True) if t.name in keys],
        }
        value_schema = {
            "type": "struct",
            "optional": False,
            "name": f"{prefix}.Envelope",
            "version": 1,
            "fields": [
                {
                    "type": "struct",
                    "optional": True,
                    "name": f"{prefix}.Value",
                    "field": "before",
                    "fields": columns,
                },
                {
                    "type": "struct",
                    "optional": True,
                    "name": f"{prefix}.Value",
                    "field": "after",
                    "fields": columns,
                },
                self._source_schema(),
                {"type": "string", "optional": False, "field": "op"},
                {"type": "int64", "optional": True, "field": "ts_ms"},
            ],
        }
        return self._document(key_payload, key_schema), self._document(payload, value_schema)

    def encode_ddl(self, ddl: DDL, wall_ms: int = 0) -> tuple[bytes, bytes]:
        schema = ddl.table_schema
        database = schema.database if schema else ddl.database
        table = schema.table if schema and ddl.type is not DDLType.QUERY else ""
        payload = {
            "source": self._source(database, table, ddl.commit_ts),
            "ts_ms": wall_ms,
            "databaseName": database,
            "schemaName": None,
            "ddl": ddl.sql,
            "tableChanges": self._table_changes(ddl),
        }
        key_schema = {
            "type": "struct",
            "name": "io.debezium.connector.mysql.SchemaChangeKey",
            "optional": False,
            "version": 1,
            "fields": [{"field": "databaseName", "optional": False, "type": "string"}],
        }
        value_schema = {
            "type": "struct",
            "name": "io.debezium.connector.mysql.SchemaChangeValue",
            "version": 1,
        }
        return self._document({"databaseName": database}, key_schema), self._document(payload, value_schema)

    def encode_watermark(self, resolved_ts: int, wall_ms: int = 0) -> tuple[bytes, bytes]:
        payload = {
            "source": self._source("", "", resolved_ts),
            "ts_ms": wall_ms,
            "transaction": None,
            "op": "m",
        }
        cluster = self.options.cluster_id
        key_schema = {"type": "struct", "name": f"{cluster}.watermark.Key", "optional": False, "fields": []}
        value_schema = {"type": "struct", "name": f"{cluster}.watermark.Envelope", "version": 1}
        return self._document({}, key_schema), self._document(payload, value_schema)

    def _document(self, payload: Any, schema: Any) -> bytes:
        document = (
            {"payload": payload} if self.options.disable_schema else {"payload": payload, "schema": schema}
        )
        return compress(msgspec.json.encode(document), self.options.compression)

    def _column_types(self, schema: TableSchema) -> tuple[ColumnType, ...]:
        found = self._types.get(schema.key)
        if found is None:
            found = self._types[schema.key] = tuple(column_type(c, self.policy) for c in schema.columns)
        return found

    def _row(self, types: Sequence[ColumnType], image: dict[str, Any]) -> dict[str, Any]:
        return {t.name: wire_value(t, image.get(t.name)) for t in types if t.name in image}

    def _source(self, database: str, table: str, commit_ts: int) -> dict[str, Any]:
        cluster = self.options.cluster_id
        return {
            "version": "2.4.0.Final",
            "connector": "TiCDC",
            "name": cluster,
            "ts_ms": commit_ts >> TSO_PHYSICAL_SHIFT,
            "snapshot": "false",
            "db": database,
            "table": table,
            "server_id": 0,
            "gtid": None,
            "file": "",
            "pos": 0,
            "row": 0,
            "thread": 0,
            "query": None,
            "commit_ts": commit_ts,
            "cluster_id": cluster,
        }

    def _source_schema(self) -> dict[str, Any]:
        fields = [
            {"type": "string", "optional": False, "field": "version"},
            {"type": "string", "optional": False, "field": "connector"},
            {"type": "string", "optional": False, "field": "name"},
            {"type": "int64", "optional": False, "field": "ts_ms"},
            {"type": "string", "optional": True, "field": "db"},
            {"type": "string", "optional": True, "field": "table"},
        ]
        if self.options.tidb_extension:
            fields += [
                {"type": "int64", "optional": False, "field": "commit_ts"},
                {"type": "string", "optional": False, "field": "cluster_id"},
            ]
        return {
            "type": "struct",
            "fields": fields,
            "optional": False,
            "name": "io.debezium.connector.mysql.Source",
            "field": "source",
        }

    def _column_schema(self, column: ColumnType) -> dict[str, Any]:
        data_type = column.data_type
        kind = data_type.mysql_type
        out: dict[str, Any] = {}
        if self.options.tidb_extension:
            unsigned = (
                " unsigned" if data_type.unsigned and (kind in _INTS or kind in ("float", "double")) else ""
            )
            out["tidb_type"] = kind + unsigned
        connect, semantic, params = _connect_type(data_type)
        out |= {"type": connect, "optional": column.column.nullable}
        if semantic:
            out |= {"name": semantic}
            if semantic != "io.debezium.data.TiDBVectorFloat32":
                out["version"] = 1
            if params:
                out["parameters"] = params
        out["field"] = column.name
        return out

    def _table_changes(self, ddl: DDL) -> list[Any]:
        schema = ddl.table_schema
        if schema is None or ddl.type in (DDLType.TRUNCATE, DDLType.QUERY):
            return []
        change = {DDLType.CREATE: "CREATE", DDLType.ERASE: "DROP", DDLType.DINDEX: "DROP"}.get(
            ddl.type, "ALTER"
        )
        identity = f'"{schema.database}"."{schema.table}"'
        if ddl.type is DDLType.RENAME and ddl.pre_table_schema is not None:
            old = ddl.pre_table_schema
            identity = f'"{old.database}"."{old.table}",{identity}'
        table = None
        if ddl.type is not DDLType.ERASE:
            table = {
                "defaultCharsetName": "utf8mb4",
                "primaryKeyColumnNames": list(schema.handle_key()),
                "columns": [_ddl_column_out(c, position) for position, c in enumerate(schema.columns, 1)],
                "comment": None,
            }
        return [{"type": change, "id": identity, "table": table}]


def _connect_type(data_type: DataType) -> tuple[str, str | None, dict[str, str] | None]:
    kind = data_type.mysql_type
    unsigned = data_type.unsigned
    if kind in ("tinyint", "smallint") and not (kind == "smallint" and unsigned):
        return "int16", None, None
    if kind in ("smallint", "mediumint") or (kind == "int" and not unsigned):
        return "int32", None, None
    if kind in ("int", "bigint"):
        return "int64", None, None
    if kind == "float":
        return "float", None, None
    if kind in ("double", "decimal"):
        return "double", None, None
    if kind == "date":
        return "int32", "io.debezium.time.Date", None
    if kind == "datetime":
        return (
            "int64",
            ("io.debezium.time.Timestamp" if fsp_of(data_type) <= 3 else "io.debezium.time.MicroTimestamp"),
            None,
        )
    if kind == "timestamp":
        return "string", "io.debezium.time.ZonedTimestamp", None
    if kind == "time":
        return "int64", "io.debezium.time.MicroTime", None
    if kind == "year":
        return "int32", "io.debezium.time.Year", None
    if kind == "bit":
        if max(data_type.length, 1) == 1:
            return "boolean", None, None
        return "bytes", "io.debezium.data.Bits", {"length": str(data_type.length)}
    if kind == "enum":
        return "string", "io.debezium.data.Enum", {"allowed": joined_allowed(data_type.elements)}
    if kind == "set":
        return "string", "io.debezium.data.EnumSet", {"allowed": ",".join(data_type.elements)}
    if kind == "json":
        return "string", "io.debezium.data.Json", None
    if kind == "vector":
        return "string", "io.debezium.data.TiDBVectorFloat32", None
    return "string", None, None


def _ddl_column_out(column: Column, position: int) -> dict[str, Any]:
    data_type = column.data_type
    kind = data_type.mysql_type
    unsigned = " UNSIGNED" if data_type.unsigned and (kind in _INTS or kind in ("float", "double")) else ""
    length: int | None = None
    if kind in ("datetime", "timestamp", "time"):
        length = fsp_of(data_type)
    elif kind in ("decimal", "bit"):
        length = data_type.length
    return {
        "name": column.name,
        "jdbcType": 12,
        "nativeType": None,
        "comment": None,
        "defaultValueExpression": None,
        "enumValues": [f"'{e}'" for e in data_type.elements] if kind in ("enum", "set") else None,
        "typeName": kind.upper() + unsigned,
        "typeExpression": kind.upper() + unsigned,
        "charsetName": data_type.charset if kind in _TEXTS else None,
        "length": length,
        "scale": data_type.decimal if kind == "decimal" else None,
        "position": position,
        "optional": column.nullable,
        "autoIncremented": False,
        "generated": False,
    }


def wire_value(column: ColumnType, value: Any) -> Any:
    """A typed value as TiCDC's Debezium JSON writes it (spec §6.1-§6.2)."""
    if value is None:
        return None
    data_type = column.data_type
    kind = data_type.mysql_type
    if kind == "bigint" and data_type.unsigned:
        integer = int(column.to_json(value))
        return integer - _U64 if integer >= 1 << 63 else integer
    if kind in _INTS or kind == "year":
        return int(column.to_json(value))
    if kind == "float":
        return msgspec.Raw(float32_text(float(value)).encode())
    if kind in ("double", "decimal"):
        return float(value)
    if kind == "date":
        return (_two_digit_year(value) - _EPOCH).days
    if kind == "datetime":
        shifted = value.replace(year=_two_digit_year(value).year)
        micros = (shifted - dt.datetime(1970, 1, 1)) // dt.timedelta(microseconds=1)
        return micros // 1000 if fsp_of(data_type) <= 3 else micros
    if kind == "timestamp":
        text = value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S")
        fsp = fsp_of(data_type)
        return text + (f".{value.microsecond:06d}"[: fsp + 1] if fsp else "") + "Z"
    if kind == "time":
        return (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    if kind == "bit":
        integer = int(value)
        if max(data_type.length, 1) == 1:
            return bool(integer)
        return base64.b64encode(integer.to_bytes((data_type.length + 7) // 8, "little")).decode()
    if kind == "json":
        return json_document_text(value)
    if kind in _BINARY:
        return base64.b64encode(bytes(value)).decode()
    if kind == "vector":
        return column.to_json(value)
    return value


def _two_digit_year(value: dt.date) -> dt.date:
    """Debezium's shift of years below 100 (spec §6.2): 0-69 -> 2000+, 70-99 -> 1900+."""
    if value.year >= 100:
        return value
    return value.replace(year=value.year + (2000 if value.year < 70 else 1900))
