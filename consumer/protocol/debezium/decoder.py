"""TiCDC's Debezium protocol (`protocol=debezium`, docs/protocols/debezium.md): JSON change events shaped like
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

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from consumer.errors import ConsumerError, MalformedMessageError, UnsupportedTypeError
from consumer.protocol.base import (
    DecoderSettings,
    Protocol,
    SelfDescribedRows,
    TableRows,
    collector_paused,
)
from consumer.protocol.checks import MessageChecks
from consumer.protocol.compression import LZ4_MAGIC, CompressionSetting, decompress
from consumer.protocol.containment import KeyedValue, decoded_each, raise_contained
from consumer.protocol.debezium.rows import DebeziumRows
from consumer.protocol.debezium.wire import BINARY, ENCODING, INTS, INVALID, NULL, TEXTS, UNTYPED_JSON
from consumer.protocol.model import (
    DDL,
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
from consumer.protocol.parse_errors import json_problem
from consumer.protocol.self_described import (
    TEXT,
    split_allowed,
    stable_table_id,
)
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
)
from consumer.protocol.validation import validate_schema

_OPS = {"c": DMLType.INSERT, "u": DMLType.UPDATE, "d": DMLType.DELETE}


# -- the envelope -------------------------------------------------------------------------------------
class _Source(msgspec.Struct, gc=False):
    db: str = ""
    table: str = ""
    commit_ts: int = 0
    name: str = ""


class _DDLColumn(msgspec.Struct, gc=False):
    """A column of a DDL event's `tableChanges[].table` (docs/protocols/debezium.md §8)."""

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
    """A column's Connect schema in `before`/`after` (docs/protocols/debezium.md §5)."""

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
_replace = msgspec.structs.replace
_PAYLOAD_KEY = b'{"payload":'
_PAYLOAD_START = len(_PAYLOAD_KEY)
_KNOWN_SCHEMAS = 16  # value schemas `_split_known` matches by their bytes


@dataclass(frozen=True)
class _Described:
    """A table version derived from a record's schema, and the bytes it was derived from."""

    value_schema: bytes
    key_identity: Any
    schema: TableSchema
    dml: RawDML  # its DMLs' fields but type, commit ts and payload (which `_known_dml` replaces)
    key_raw: msgspec.Raw | None = None  # the key's schema when it has one, to compare with a parsed key's


class DebeziumDecoder:
    """Kafka record (key, value) -> message, per docs/protocols/debezium.md §3; `compression` as configured
    for the changefeed's large-message-handle-compression ("auto": a value starting with `{` is plain
    JSON)."""

    def __init__(self, compression: CompressionSetting = "auto", policy: ValuePolicy | None = None) -> None:
        self.compression = compression
        self.policy = policy or ValuePolicy()
        self._checks = MessageChecks(self.policy.limits, self.policy.unknown_types)
        self._latest: dict[tuple[str, str], _Described] = {}
        self._by_version: dict[tuple[str, str, int], TableSchema] = {}
        self._suffixes: list[tuple[bytes, bytes]] = []  # (`,"schema":S}`, S) of recent DMLs: `_split_known`

    @property
    def protocol(self) -> DebeziumProtocol:
        return DEBEZIUM

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None:
        return self._by_version.get(key)

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        with collector_paused():  # a record's short-lived objects (its key's dict) form no cycles
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
            except INVALID:
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
        except INVALID:
            return None
        # fewer fields to name than a new RawDML's (its database and table are equal to the source's)
        return _replace(found.dml, type=kind, commit_ts=commit_ts, payload=body)

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
            except INVALID as exc:
                raise self._invalid("JSON", value, exc) from exc
            body = bytes(envelope.payload)
            try:
                payload = _PAYLOAD.decode(body)
            except INVALID as exc:  # its path and bytes are the payload's
                raise self._invalid("payload", body, exc) from exc
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
            return self._checks.message(_ddl(payload, source, typed=schema_bytes != NULL))
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
                except INVALID:
                    return None
                if position:  # most recently used first
                    self._suffixes.insert(0, self._suffixes.pop(position))
                return body, schema_bytes, payload
        return None

    def _remember_suffix(self, value: bytes, schema_bytes: bytes) -> None:
        """Remember a DML's schema for `_split_known` when the value is laid out as TiCDC writes it."""
        if schema_bytes == NULL or not value.startswith(_PAYLOAD_KEY):
            return
        suffix = b',"schema":' + schema_bytes + b"}"
        if value.endswith(suffix) and all(known != suffix for known, _ in self._suffixes):
            self._suffixes.insert(0, (suffix, schema_bytes))
            del self._suffixes[_KNOWN_SCHEMAS:]

    def _plain(self, value: bytes) -> bytes:
        """Keys and values are JSON, compressed only when the changefeed says so (docs/protocols/debezium.md
        §2): `auto` takes an LZ4 frame by its magic and anything else for JSON. A snappy block has no mark
        (its first byte, a length, may be any byte): guessing it made every bad value a bad snappy block, so
        snappy is configured."""
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
        if parsed is not None and schema_bytes != NULL:  # the latest version's, `_key` without copies
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
        if schema_bytes == NULL:  # schema disabled: the identity is the column names
            try:
                images = _IMAGES.decode(body)
            except INVALID as exc:
                problem = json_problem(exc, body)
                raise MalformedMessageError(f"invalid Debezium row images: {problem}") from exc
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
        dml = RawDML(
            type=DMLType.INSERT,
            database=source.db,
            table=source.table,
            table_id=table.table_id,
            commit_ts=0,
            build_ts=0,
            schema_version=table.version,
            payload=b"",
            encoding=ENCODING,
        )
        self._latest[name] = _Described(schema_bytes, key_identity, table, dml, key_raw)
        self._by_version[table.key] = table
        return table

    def _parsed_key(self, key: bytes | None) -> _KeyEnvelope | None:
        """The key, compressed as the value is (docs/protocols/debezium.md §2); None for none."""
        if not key:
            return None
        plain = self._plain(key)
        try:
            return _KEY.decode(plain)
        except INVALID as exc:
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
        return MalformedMessageError(f"invalid Debezium {what}: {json_problem(exc, data)}{hint}")


def _key_of(parsed: _KeyEnvelope | None) -> tuple[Any, tuple[str, ...]]:
    """(identity, key column names): the identity is the key schema's bytes, or the names when the schema is
    disabled."""
    if parsed is None:
        return (), ()
    names = tuple(parsed.payload)
    schema = bytes(parsed.schema)
    return (schema if schema != NULL else names), names


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
    except INVALID as exc:
        raise MalformedMessageError(f"invalid Debezium schema: {json_problem(exc, schema_bytes)}") from exc
    image = next((p.fields for p in parts if p.field in ("after", "before")), None)
    try:
        fields = _CONNECT_FIELDS.decode(image) if image is not None and bytes(image) != NULL else None
    except INVALID as exc:  # its path and bytes are the image's fields'
        problem = json_problem(exc, bytes(image) if image is not None else b"")
        raise MalformedMessageError(f"invalid Debezium schema fields: {problem}") from exc
    if fields is None:
        raise MalformedMessageError("the Debezium schema has no before/after fields")
    columns = tuple(_column(f) for f in fields)
    return _table(database, table, columns, keys, _version(database, table, schema_bytes, *keys))


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
    if base in INTS or base in ("float", "double"):
        return DataType(base, unsigned=unsigned)
    if base == "decimal":
        # the wire holds a float64 (docs/protocols/debezium.md §6.1): typed as what it is
        return DataType("double")
    if base in TEXTS:
        return DataType(base, **TEXT)
    if base in BINARY:
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
    """A DDL event: its type from the statement, its table's structure from `tableChanges`
    (docs/protocols/debezium.md §8)."""
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
        # a database-level DDL's (docs/protocols/debezium.md §8.2)
        database=source.db if schema is None else "",
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
    if base in INTS or base in ("float", "double"):
        return Column(name, DataType(base, unsigned="unsigned" in flags), nullable)
    if base in TEXTS:
        return Column(name, DataType(base, **TEXT), nullable)
    if base in BINARY or base in ("date", "year", "json", "vector"):
        return Column(name, DataType(base), nullable)
    raise UnsupportedTypeError(f"column {name!r}: DDL type {type_name!r} is not TiCDC Debezium")


class DebeziumProtocol(Protocol):
    """TiCDC's Debezium protocol: `DebeziumDecoder` for records, `DebeziumRows` for a table version's rows."""

    name = "debezium"

    def record_decoder(self, settings: DecoderSettings) -> DebeziumDecoder:
        return DebeziumDecoder(settings.compression, settings.policy)

    def table_rows(
        self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy
    ) -> TableRows:
        return SelfDescribedRows(schema, columns, lambda: DebeziumRows(schema, columns, policy))

    def __eq__(self, other: object) -> bool:
        return type(other) is DebeziumProtocol

    def __hash__(self) -> int:
        return hash(DebeziumProtocol)


DEBEZIUM = DebeziumProtocol()
