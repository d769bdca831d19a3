"""TiCDC's Avro protocol (`protocol=avro`, spec avro-protocol.md): a Confluent-framed key and value per row
change, writer schemas in a schema registry, one topic per table.

A record carries no schema version of TiDB's: the table version of a row is its pair of writer schemas. The
decoder derives the SDK's `TableSchema` from them (`AvroLayout.schema`, version `key id << 31 | value id`)
and hands it to the state machine through `described_schema`, so rows never wait for a BOOTSTRAP that this
protocol does not have. Row values stay undecoded in a `RawDML` (`encoding` "avro-confluent", `payload` the
framed value, or the framed key of a key-only DELETE) until a batch of them is decoded columnar
(`consumer.protocol.avro_rows`).

Routing needs each row's operation and commit ts, which the TiDB extension puts at the *end* of the datum:
they are read backwards from the last bytes (the extension fields' layout is fixed by the writer schema),
and the columnar decode later checks them against the decoded fields.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Literal
from zoneinfo import ZoneInfo

import fastavro
import msgspec

from consumer.errors import ConsumerError, EncodeError, MalformedMessageError, UnsupportedTypeError
from consumer.protocol.avro_varints import MAX_VARINT_BYTES, overlong_reason
from consumer.protocol.checks import MessageChecks
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
from consumer.protocol.registry import SchemaRegistry, subject_names
from consumer.protocol.self_described import TEXT, joined_allowed, split_allowed, stable_table_id
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
    column_type,
    datetime_text,
    fsp_of,
    json_document_text,
)
from consumer.protocol.validation import validate_schema

ENCODING = "avro-confluent"
MAGIC, DDL_MARK, CHECKPOINT_MARK, DELETE_MARK = 0, 1, 2, 3
BEFORE_FIELD = "_ticdc_before"
OP, COMMIT_TS, PHYSICAL_TIME = "_tidb_op", "_tidb_commit_ts", "_tidb_commit_physical_time"
CHECKSUM, CORRUPTED, CHECKSUM_VERSION = (
    "_tidb_row_level_checksum",
    "_tidb_corrupted",
    "_tidb_checksum_version",
)
EXTENSION_FIELDS = frozenset(
    (BEFORE_FIELD, OP, COMMIT_TS, PHYSICAL_TIME, CHECKSUM, CORRUPTED, CHECKSUM_VERSION)
)
_OPS = {"c": DMLType.INSERT, "u": DMLType.UPDATE, "d": DMLType.DELETE}
_ID_BITS = 31  # registry ids are positive int32: a version holds both
_U64 = 1 << 64

DecimalMode = Literal["precise", "string"]
UnsignedMode = Literal["long", "string"]


@dataclass(frozen=True)
class AvroOptions:
    """TiCDC's options for this protocol (spec §9), which the encoder follows; the decoder needs none of them
    (the writer schema says everything) but the producer's time zone, in `ValuePolicy.timestamp_location`.

    `bit_bytes` "fixed" writes BIT as ⌈M/8⌉ bytes (new TiCDC), "minimal" as few as the value needs (classic).
    """

    decimal: DecimalMode = "precise"
    bigint_unsigned: UnsignedMode = "long"
    tidb_extension: bool = False
    include_before: bool = False
    checksum: bool = False
    watermark: bool = False
    bit_bytes: Literal["fixed", "minimal"] = "fixed"


# -- names ------------------------------------------------------------------------------------------
def sanitized(name: str) -> str:
    """Spec §4.6: `[A-Za-z_][A-Za-z0-9_]*`, a bad first digit kept after a `_`, anything else as `_`."""
    out = []
    for position, char in enumerate(name):
        ascii_letter = char.isascii() and (char.isalpha() or char == "_")
        if position == 0 and not ascii_letter:
            out.append("_" + char if char.isascii() and char.isdigit() else "_")
        else:
            out.append(char if ascii_letter or (char.isascii() and char.isdigit()) else "_")
    return "".join(out)


def table_topic(prefix: str, database: str, table: str) -> str:
    """A topic per table, as TiCDC's dispatcher `<prefix>_{schema}_{table}` names it: characters outside
    `[A-Za-z0-9._-]` become `_`, and the name is cut at 249 characters."""
    raw = f"{prefix}_{database}_{table}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", raw)[:249]


def schema_version(key_id: int, value_id: int) -> int:
    return key_id << _ID_BITS | value_id


def schema_ids(version: int) -> tuple[int, int]:
    """(key id, value id) of a version made by `schema_version`; 0 stands for "none"."""
    return version >> _ID_BITS, version & ((1 << _ID_BITS) - 1)


# -- writer schemas -> the SDK's table version ---------------------------------------------------------
@dataclass(frozen=True)
class AvroColumn:
    """One column field of a writer schema: its Avro primitive and the SDK type it decodes to."""

    name: str
    avro: str  # int long float double string bytes boolean
    nullable: bool
    data_type: DataType
    precise: tuple[int, int] | None = None  # (precision, scale) of a bytes-decimal


@dataclass(frozen=True)
class AvroLayout:
    """What a (key, value) writer schema pair says: the table version, and where a datum holds what."""

    schema: TableSchema
    key_id: int
    value_id: int
    columns: tuple[AvroColumn, ...]  # the value's column fields (the key's when there is no value schema)
    key_columns: tuple[AvroColumn, ...]
    value_json: Any
    key_json: Any
    extension: bool  # _tidb_op, _tidb_commit_ts, _tidb_commit_physical_time
    checksum: bool
    before: bool


_TIDB_TYPES: dict[str, tuple[str, bool]] = {
    "INT": ("int", False),
    "INT UNSIGNED": ("int", True),
    "BIGINT": ("bigint", False),
    "BIGINT UNSIGNED": ("bigint", True),
    "FLOAT": ("float", False),
    "DOUBLE": ("double", False),
    "TEXT": ("text", False),
    "BLOB": ("blob", False),
    "DATE": ("date", False),
    "DATETIME": ("datetime", False),
    "TIMESTAMP": ("timestamp", False),
    "TIME": ("time", False),
    "YEAR": ("year", False),
    "JSON": ("json", False),
    "TiDBVECTORFloat32": ("vector", False),
}
WIDEST_DECIMAL = (65, 30)  # string-mode DECIMAL: precision and scale are not on the wire


def layout(key_json: Any, value_json: Any, key_id: int, value_id: int) -> AvroLayout:
    """Derive the table version from writer schemas (either may be None: a keyless table, a key-only
    DELETE of a table whose value schema this consumer has not seen).

    Only the shape TiCDC writes passes (spec §4): records of column fields of the primitive each
    `tidb_type` has, then TiCDC's extension fields in their order. The columnar reader is native code
    and is never handed anything else (arrays, maps, recursion, unknown logical types...)."""
    main = value_json if value_json is not None else key_json
    fields = _record_fields(main, "writer schema")
    column_fields, extension = _extension(fields)
    columns = tuple(_avro_column(f) for f in column_fields)
    key_columns = tuple(_avro_column(f) for f in _record_fields(key_json, "key schema")) if key_json else ()
    for schema in (key_json, value_json):
        if schema is not None:
            _parsable(schema)
    database = str(main.get("namespace") or "").partition(".")[2]
    table = str(main["name"])
    key_names = tuple(c.name for c in key_columns)
    schema = TableSchema(
        database=database,
        table=table,
        table_id=stable_table_id(database, table),
        version=schema_version(key_id, value_id),
        columns=tuple(Column(c.name, c.data_type, c.nullable) for c in columns),
        indexes=(Index("primary", True, True, False, key_names),) if key_names else (),
    )
    return AvroLayout(
        schema=schema,
        key_id=key_id,
        value_id=value_id,
        columns=columns,
        key_columns=key_columns,
        value_json=value_json,
        key_json=key_json,
        extension=value_json is not None and COMMIT_TS in extension,
        checksum=value_json is not None and CHECKSUM in extension,
        before=value_json is not None and BEFORE_FIELD in extension,
    )


_EXTENSION_TYPES = {
    OP: "string",
    COMMIT_TS: "long",
    PHYSICAL_TIME: "long",
    CHECKSUM: "string",
    CORRUPTED: "boolean",
    CHECKSUM_VERSION: "int",
}
_TIDB_EXTENSION = (OP, COMMIT_TS, PHYSICAL_TIME)
_CHECKSUMMED = (*_TIDB_EXTENSION, CHECKSUM, CORRUPTED, CHECKSUM_VERSION)
_EXTENSION_ORDERS = frozenset(
    (
        (),
        _TIDB_EXTENSION,
        _CHECKSUMMED,
        (BEFORE_FIELD, OP),
        (BEFORE_FIELD, *_TIDB_EXTENSION),
        (BEFORE_FIELD, *_CHECKSUMMED),
    )
)
_AVRO_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _record_fields(schema: Any, what: str) -> list[dict[str, Any]]:
    """The fields of a record schema whose field names are valid and unique Avro names."""
    fields = schema.get("fields") if isinstance(schema, dict) else None
    if (
        not isinstance(schema, dict)
        or schema.get("type") != "record"
        or not isinstance(schema.get("name"), str)
        or not isinstance(fields, list)
        or not all(isinstance(f, dict) for f in fields)
    ):
        raise MalformedMessageError(f"{what} is not an Avro record")
    names = [f.get("name") for f in fields]
    bad = next((n for n in names if not isinstance(n, str) or not _AVRO_NAME.fullmatch(n)), None)
    if bad is not None or len(set(names)) != len(names):
        shown = repr(bad) if bad is not None else "a duplicate"
        raise MalformedMessageError(f"{what} has {shown} as a field name")
    return fields


def _extension(fields: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], tuple[str, ...]]:
    """(column fields, extension field names): the extension fields end the record, in TiCDC's order, each
    of its type; `_ticdc_before` a nullable record of column fields."""
    start = len(fields)
    while start and fields[start - 1]["name"] in EXTENSION_FIELDS:
        start -= 1
    names = tuple(f["name"] for f in fields[start:])
    if names not in _EXTENSION_ORDERS or any(f["name"] in EXTENSION_FIELDS for f in fields[:start]):
        raise MalformedMessageError(f"extension fields {list(names)} are not in TiCDC's order")
    for field in fields[start:]:
        if field["name"] == BEFORE_FIELD:
            branches = field.get("type")
            records = [b for b in branches if b != "null"] if isinstance(branches, list) else []
            if len(records) != 1 or len(branches or ()) != 2:
                raise MalformedMessageError(f"{BEFORE_FIELD} is not a nullable record")
            for column in _record_fields(records[0], BEFORE_FIELD):
                _avro_column(column)
        elif field.get("type") != _EXTENSION_TYPES[field["name"]]:
            raise MalformedMessageError(
                f"extension field {field['name']} is not a {_EXTENSION_TYPES[field['name']]}"
            )
    return fields[:start], names


def _parsable(schema: Any) -> None:
    """fastavro (the reader behind the native one) must take the schema: defaults of their field's type,
    named types defined once."""
    try:
        fastavro.parse_schema(schema, _write_hint=False)
    # fastavro raises SchemaParseException, UnknownType, ValueError... on bad schemas
    except Exception as exc:
        raise MalformedMessageError(f"writer schema is not valid Avro: {type(exc).__name__}: {exc}") from exc


# Each tidb_type's Avro primitives (spec §5.1; integer types accept either width).
_AVRO_OF_TIDB: dict[str, frozenset[str]] = {
    **dict.fromkeys(("INT", "INT UNSIGNED", "YEAR"), frozenset(("int", "long"))),
    "BIGINT": frozenset(("long",)),
    "BIGINT UNSIGNED": frozenset(("long", "string")),
    "FLOAT": frozenset(("float", "double")),
    "DOUBLE": frozenset(("double",)),
    "DECIMAL": frozenset(("bytes", "string")),
    "BLOB": frozenset(("bytes",)),
    "BIT": frozenset(("bytes",)),
    **dict.fromkeys(
        ("TEXT", "DATE", "DATETIME", "TIMESTAMP", "TIME", "JSON", "ENUM", "SET", "TiDBVECTORFloat32"),
        frozenset(("string",)),
    ),
}
_MAX_DECIMAL = (65, 30)  # TiDB's widest DECIMAL: precision, scale


def _avro_column(field: dict[str, Any]) -> AvroColumn:
    name = field["name"]
    branches = field.get("type")
    branches = branches if isinstance(branches, list) else [branches]
    typed = [b for b in branches if b != "null"]
    if len(typed) != 1 or len(branches) > 2 or not isinstance(typed[0], dict):
        raise MalformedMessageError(f"column field {name!r} is not a TiCDC column shape")
    wire = typed[0]
    params = wire.get("connect.parameters")
    if not isinstance(params, dict) or not all(isinstance(v, str) for v in params.values()):
        raise MalformedMessageError(f"column field {name!r} has no text connect.parameters")
    tidb_type, avro = str(params.get("tidb_type")), wire.get("type")
    if tidb_type not in _AVRO_OF_TIDB:
        raise UnsupportedTypeError(f"column {name!r}: tidb_type {tidb_type!r} ({avro}) is not TiCDC Avro")
    if not isinstance(avro, str) or avro not in _AVRO_OF_TIDB[tidb_type]:
        raise MalformedMessageError(
            f"column {name!r}: tidb_type {tidb_type} is never carried as Avro {avro!r}"
        )
    precise = _decimal(wire, name) if "logicalType" in wire else None
    if tidb_type == "DECIMAL" and avro == "bytes" and precise is None:
        raise MalformedMessageError(f"column {name!r}: a bytes DECIMAL without its logicalType")
    data_type = _data_type(tidb_type, params, precise, name)
    return AvroColumn(name, str(avro), len(branches) > 1, data_type, precise)


def _decimal(wire: dict[str, Any], name: str) -> tuple[int, int]:
    precision, scale = wire.get("precision", 10), wire.get("scale", 0)
    if (
        wire.get("logicalType") != "decimal"
        or wire.get("type") != "bytes"
        or not isinstance(precision, int)
        or not isinstance(scale, int)
        or not (0 < precision <= _MAX_DECIMAL[0] and 0 <= scale <= min(precision, _MAX_DECIMAL[1]))
    ):
        raise MalformedMessageError(f"column {name!r}: not a DECIMAL TiDB can hold: {wire}")
    return precision, scale


def _data_type(
    tidb_type: str, params: dict[str, str], precise: tuple[int, int] | None, name: str
) -> DataType:
    if tidb_type == "DECIMAL":
        length, scale = precise or WIDEST_DECIMAL
        return DataType("decimal", length=length, decimal=scale)
    if tidb_type == "BIT":
        bits = params.get("length") or "1"
        if not bits.isdigit() or not 0 < int(bits) <= 64:
            raise MalformedMessageError(f"column {name!r}: BIT length {bits[:20]!r} is not 1-64")
        return DataType("bit", length=int(bits), unsigned=True)
    if tidb_type in ("ENUM", "SET"):
        return DataType(tidb_type.lower(), **TEXT, elements=split_allowed(params.get("allowed", "")))
    mysql_type, unsigned = _TIDB_TYPES[tidb_type]
    if mysql_type == "text":
        return DataType("text", **TEXT)
    if mysql_type in ("datetime", "timestamp", "time"):
        return DataType(mysql_type, decimal=6)  # fsp is not on the wire; values keep their digits
    return DataType(mysql_type, unsigned=unsigned)


# -- decoding records ---------------------------------------------------------------------------------
class ConfluentAvroDecoder:
    """Kafka record (key, value) -> message, per spec §3.2; watermark-mode records are always recognised
    (a Confluent frame starts with 0x00, so they cannot be mistaken)."""

    def __init__(self, registry: SchemaRegistry, policy: ValuePolicy | None = None) -> None:
        self.registry = registry
        self.policy = policy or ValuePolicy()
        self._checks = MessageChecks(self.policy.limits, self.policy.unknown_types)
        self._layouts: dict[tuple[int, int], AvroLayout] = {}
        self._by_version: dict[tuple[str, str, int], AvroLayout] = {}
        self._value_of_key: dict[int, int] = {}  # key schema id -> the newest value schema id seen with it
        # `_row`'s previous (key frame, value frame) and their layout
        self._last: tuple[tuple[bytes | None, bytes], AvroLayout] | None = None

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None:
        """The table version this decoder derived for a row it returned (`RawDML.schema_key`)."""
        found = self._by_version.get(key)
        return found.schema if found is not None else None

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        return decoded_each(self.decode_record, records)

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        try:
            return self._decode_record(key, value)
        except BaseException as exc:
            raise_contained(exc, "decoding a TiCDC Avro record")

    def _decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        if value:
            first = value[0]
            if first == MAGIC:
                return self._row(key, value)
            if first == DDL_MARK and key is None:
                return self._checks.message(_ddl(value))
            if first == CHECKPOINT_MARK and key is None:
                return self._checks.message(Watermark(commit_ts=_tso(value), build_ts=0))
            if first == DELETE_MARK and key:
                return self._key_only_delete(key, self._commit_ts(_tso(value)))
            raise MalformedMessageError(f"not a TiCDC Avro record: value starts with 0x{first:02x}")
        if key:
            return self._key_only_delete(key, 0)
        raise MalformedMessageError("a record with neither key nor value (TiCDC loses a keyless DELETE)")

    def layout_of(self, key_id: int, value_id: int) -> AvroLayout:
        found = self._layouts.get((key_id, value_id))
        if found is None:
            key_json = self.registry.schema(key_id) if key_id else None
            value_json = self.registry.schema(value_id) if value_id else None
            found = layout(key_json, value_json, key_id, value_id)
            validate_schema(found.schema, self.policy.unknown_types)
            self._layouts[(key_id, value_id)] = found
            self._by_version[found.schema.key] = found
        return found

    def _row(self, key: bytes | None, value: bytes) -> RawDML:
        frames = (None if key is None else key[:5], value[:5])
        last = self._last
        if last is not None and last[0] == frames:  # the previous row's schemas (frames checked then)
            found = last[1]
        else:
            value_id = _frame_id(value, "value")
            key_id = _frame_id(key, "key") if key is not None else 0
            found = self.layout_of(key_id, value_id)
            if key_id:
                self._value_of_key[key_id] = value_id
            self._last = (frames, found)
        kind, commit_ts = DMLType.INSERT, 0
        if found.extension:
            kind, commit_ts = _tail(value, found.checksum)
            self._commit_ts(commit_ts)
        elif found.before:
            kind = _last_op(value)
        return _raw(found, kind, commit_ts, value)

    def _commit_ts(self, commit_ts: int) -> int:
        self._checks.commit_ts(commit_ts, "DML")
        return commit_ts

    def _key_only_delete(self, key: bytes, commit_ts: int) -> RawDML:
        """A tombstone (or the 0x03 marker): only the key. It joins the table version of the newest value
        schema seen with its key schema, so its rows batch with theirs."""
        key_id = _frame_id(key, "key")
        found = self.layout_of(key_id, self._value_of_key.get(key_id, 0))
        return _raw(found, DMLType.DELETE, commit_ts, key)


def _raw(found: AvroLayout, kind: DMLType, commit_ts: int, payload: bytes) -> RawDML:
    schema = found.schema
    return RawDML(
        type=kind,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=commit_ts,
        build_ts=0,
        schema_version=schema.version,
        payload=payload,
        encoding=ENCODING,
    )


def frame_id(framed: bytes) -> int:
    return int.from_bytes(framed[1:5], "big")


def _frame_id(framed: bytes, part: str) -> int:
    if len(framed) < 5 or framed[0] != MAGIC:
        raise MalformedMessageError(f"record {part} is not in the Confluent wire format (0x00 + schema id)")
    return frame_id(framed)


def _tso(value: bytes) -> int:
    if len(value) != 9:
        raise MalformedMessageError(f"a 0x{value[0]:02x} marker is 9 bytes, not {len(value)}")
    return int.from_bytes(value[1:], "big")


def _tail(value: bytes, checksum: bool) -> tuple[DMLType, int]:
    """`_tidb_op` and `_tidb_commit_ts`, read backwards from the datum's end: `[op][commit ts][physical
    time]` and, with checksums, `[checksum digits][corrupted][checksum version]` after them.

    Without checksums the varints' boundaries are found in C (`_tail_fast`); anything it does not settle
    takes the byte-by-byte reading (`_tail_each`), which gives the same answers (a property test)."""
    if not checksum:
        found = _tail_fast(value)
        if found is not None:
            return found
    return _tail_each(value, checksum)


# A byte of the last `_TAIL_WINDOW` of a datum as "1" if a varint continues after it, else "0".
_CONTINUES = bytes(0x31 if byte & 0x80 else 0x30 for byte in range(256))
_TAIL_WINDOW = 24  # op (length + 1 char), two varints of at most 10 bytes, the byte before them
_ZIGZAG_MASKS = tuple(
    (mask, mask << width, shift)
    for mask, width, shift in (
        (int.from_bytes(b"\x7f\x00" * 8, "little"), 8, 1),
        (int.from_bytes(b"\xff\x3f\x00\x00" * 4, "little"), 16, 2),
        (int.from_bytes(b"\xff\xff\xff\x0f\x00\x00\x00\x00" * 2, "little"), 32, 4),
    )
)
_LOW_56 = (1 << 56) - 1


def _tail_fast(value: bytes) -> tuple[DMLType, int] | None:
    """`_tail` without checksums when both varints and the op lie in the datum's last bytes, else None."""
    size = len(value)
    if size < _TAIL_WINDOW + 5:
        return None
    window = value[size - _TAIL_WINDOW :]
    flags = window.translate(_CONTINUES)
    if flags[-1] != 0x30:
        return None
    physical = flags.rfind(b"0", 0, _TAIL_WINDOW - 1) + 1  # where _tidb_commit_physical_time starts
    start = flags.rfind(b"0", 0, physical - 1) + 1 if physical > 1 else 0  # where _tidb_commit_ts starts
    if start < 2 or physical - start > 10 or _TAIL_WINDOW - physical > 10 or window[start - 2] != 2:
        return None  # over-long varints are named by `_tail_each`
    kind = _OPS.get(chr(window[start - 1]))
    if kind is None:
        return None
    return kind, _zigzag_short(window[start:physical])


def _zigzag_short(encoded: bytes) -> int:
    """`_zigzag` of at most 10 bytes: the 7-bit groups packed by masks and shifts, not byte by byte."""
    packed = int.from_bytes(encoded, "little")
    for low, high, shift in _ZIGZAG_MASKS:
        packed = (packed & low) | ((packed & high) >> shift)
    packed = (packed & _LOW_56) | ((packed >> 64) << 56)
    return (packed >> 1) ^ -(packed & 1)


def _tail_each(value: bytes, checksum: bool) -> tuple[DMLType, int]:
    """`_tail`, byte by byte."""
    try:
        end = len(value)
        if checksum:
            end = _varint_start(value, end)  # _tidb_checksum_version
            end -= 1  # _tidb_corrupted
            digits = end
            while digits > 5 and 0x30 <= value[digits - 1] <= 0x39:
                digits -= 1
            if value[digits - 1] != 2 * (end - digits):
                raise ValueError("checksum length")
            end = digits - 1
        end = _varint_start(value, end)  # _tidb_commit_physical_time
        start = _varint_start(value, end)
        commit_ts = _zigzag(value[start:end])
        kind = _OPS[chr(value[start - 1])]
        if value[start - 2] != 2:
            raise ValueError("op length")
    except (ValueError, KeyError, IndexError) as exc:
        raise MalformedMessageError(f"the TiDB extension fields do not end the datum ({exc})") from exc
    return kind, commit_ts


def _last_op(value: bytes) -> DMLType:
    """`_tidb_op` ends the datum when only `avro-include-before-value` appends it (spec §4.3): a string of
    one character."""
    kind = _OPS.get(chr(value[-1])) if len(value) > 6 and value[-2] == 2 else None
    if kind is None:
        raise MalformedMessageError("the datum does not end with _tidb_op")
    return kind


def _varint_start(buffer: bytes, end: int) -> int:
    """Where the varint ending just before `end` starts (its last byte is the only one below 0x80)."""
    position = end - 1
    if position < 5 or buffer[position] & 0x80:
        raise ValueError("no varint")
    while position > 5 and buffer[position - 1] & 0x80:
        position -= 1
    if end - position > MAX_VARINT_BYTES:  # the value fastavro would read from it, but no Avro long
        raise MalformedMessageError(f"{overlong_reason(position)}, in the TiDB extension fields")
    return position


def _zigzag(encoded: bytes) -> int:
    result = 0
    for shift, byte in enumerate(encoded):
        result |= (byte & 0x7F) << (7 * shift)
    return (result >> 1) ^ -(result & 1)


# TiDB ActionType numbers of the watermark-mode DDL record (§7.1) as the SDK's DDL types.
_ACTIONS: dict[int, DDLType] = {
    3: DDLType.CREATE,
    4: DDLType.ERASE,
    7: DDLType.CINDEX,
    8: DDLType.DINDEX,
    11: DDLType.TRUNCATE,
    14: DDLType.RENAME,
    32: DDLType.CINDEX,
    **dict.fromkeys((5, 6, 12, 13, 15, 17, 18, 19, 20, 22, 23, 33, 41, 42, 61, 64, 71, 72), DDLType.ALTER),
}


class _DDLRecord(msgspec.Struct):
    query: str
    type: int
    schema: str
    table: str
    commitTs: int


_DDL_RECORD = msgspec.json.Decoder(_DDLRecord)


def _ddl(value: bytes) -> DDL:
    """A watermark-mode DDL. It names its table but not the columns (the next row's writer schema has them):
    its schema carries the names only, so it is a barrier for its own table alone, and a column change is an
    ALTER only in name (sinks alter nothing for a schema without columns: rows bring their columns)."""
    try:
        record = _DDL_RECORD.decode(value[1:])
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise MalformedMessageError(f"invalid watermark-mode DDL record: {exc}") from exc
    kind = _ACTIONS.get(record.type, DDLType.QUERY) if record.table else DDLType.QUERY
    named = bool(record.table)
    return DDL(
        type=kind,
        sql=record.query,
        commit_ts=record.commitTs,
        build_ts=0,
        table_schema=_named(record.schema, record.table, record.commitTs) if named else None,
        database="" if named else record.schema,  # CREATE DATABASE names its database alone
    )


def _named(database: str, table: str, version: int) -> TableSchema:
    return TableSchema(database, table, stable_table_id(database, table), version)


# -- encoding ---------------------------------------------------------------------------------------
class ConfluentAvroEncoder:
    """Typed messages -> Kafka records as TiCDC writes them, registering writer schemas as TiCDC does.

    `encode_dml` gives (key, value): a DELETE is a tombstone (value None), or with the watermark mode the
    0x03 marker; with `include_before` a full value. `encode_ddl` and `encode_checkpoint` exist only in the
    watermark mode (TiCDC sends them nowhere else).
    """

    def __init__(
        self, registry: SchemaRegistry, options: AvroOptions | None = None, policy: ValuePolicy | None = None
    ) -> None:
        self.registry = registry
        self.options = options or AvroOptions()
        self.policy = policy or ValuePolicy()
        self._parsed: dict[int, Any] = {}
        self._columns: dict[tuple[str, str, int], tuple[ColumnType, ...]] = {}

    def encode_dml(self, dml: DML, schema: TableSchema, topic: str) -> tuple[bytes | None, bytes | None]:
        key_subject, value_subject = subject_names(topic)
        key_fields = _key_columns(schema)
        key_id = self.registry.register(key_subject, key_schema(schema, self.options)) if key_fields else 0
        if dml.type is DMLType.DELETE and not self.options.include_before:
            key = self._framed(key_id, self._key_datum(schema, dml.old or {})) if key_id else None
            if self.options.watermark and self.options.tidb_extension:
                return key, bytes((DELETE_MARK,)) + dml.commit_ts.to_bytes(8, "big")
            return key, None
        value_id = self.registry.register(value_subject, value_schema(schema, self.options))
        image = dml.old if dml.type is DMLType.DELETE else dml.data
        datum = self._row_datum(schema, image or {})
        if self.options.include_before:
            before = None if dml.type is DMLType.INSERT else dml.old
            datum[BEFORE_FIELD] = None if before is None else self._row_datum(schema, before)
        if self.options.tidb_extension or self.options.include_before:
            datum[OP] = {DMLType.INSERT: "c", DMLType.UPDATE: "u", DMLType.DELETE: "d"}[dml.type]
        if self.options.tidb_extension:
            datum[COMMIT_TS] = dml.commit_ts
            datum[PHYSICAL_TIME] = dml.commit_ts >> TSO_PHYSICAL_SHIFT
            if self.options.checksum:
                checksum = dml.checksum
                datum[CHECKSUM] = str(checksum.current) if checksum else ""
                datum[CORRUPTED] = bool(checksum and checksum.corrupted)
                datum[CHECKSUM_VERSION] = checksum.version if checksum else 0
        key = self._framed(key_id, self._key_datum(schema, image or {})) if key_id else None
        return key, self._framed(value_id, datum)

    def encode_ddl(self, ddl: DDL, action: int) -> bytes:
        schema = ddl.table_schema
        body = {
            "query": ddl.sql,
            "type": action,
            "schema": schema.database if schema else ddl.database,
            "table": schema.table if schema else "",
            "commitTs": ddl.commit_ts,
        }
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026")):
            text = text.replace(raw, escaped)
        return bytes((DDL_MARK,)) + text.encode()

    @staticmethod
    def encode_checkpoint(resolved_ts: int) -> bytes:
        return bytes((CHECKPOINT_MARK,)) + resolved_ts.to_bytes(8, "big")

    def _framed(self, schema_id: int, datum: dict[str, Any]) -> bytes:
        parsed = self._parsed.get(schema_id)
        if parsed is None:
            parsed = self._parsed[schema_id] = fastavro.parse_schema(self.registry.schema(schema_id))
        stream = io.BytesIO()
        stream.write(bytes((MAGIC,)) + schema_id.to_bytes(4, "big"))
        try:
            fastavro.schemaless_writer(stream, parsed, datum)
        except (ValueError, TypeError, OverflowError) as exc:
            raise EncodeError(f"Avro datum does not fit its writer schema: {exc}") from exc
        return stream.getvalue()

    def _types(self, schema: TableSchema) -> tuple[ColumnType, ...]:
        found = self._columns.get(schema.key)
        if found is None:
            found = self._columns[schema.key] = tuple(column_type(c, self.policy) for c in schema.columns)
        return found

    def _row_datum(self, schema: TableSchema, image: dict[str, Any]) -> dict[str, Any]:
        return {sanitized(t.name): self._value(t, image.get(t.name)) for t in self._types(schema)}

    def _key_datum(self, schema: TableSchema, image: dict[str, Any]) -> dict[str, Any]:
        keys = set(_key_columns(schema))
        return {
            sanitized(t.name): self._value(t, image.get(t.name))
            for t in self._types(schema)
            if t.name in keys
        }

    def _value(self, column: ColumnType, value: Any) -> Any:
        if value is None:
            return None
        try:
            return _avro_value(column, value, self.options, self.policy)
        except (TypeError, ValueError, OverflowError, ArithmeticError) as exc:
            raise EncodeError(f"column {column.name!r}: cannot encode {value!r}: {exc}") from exc


def _avro_value(column: ColumnType, value: Any, options: AvroOptions, policy: ValuePolicy) -> Any:
    data_type = column.data_type
    kind = data_type.mysql_type
    if kind == "bigint" and data_type.unsigned:
        unsigned = int(column.to_json(value))
        if options.bigint_unsigned == "string":
            return str(unsigned)
        return unsigned - _U64 if unsigned >= 1 << 63 else unsigned
    if kind in ("tinyint", "smallint", "mediumint", "int", "bigint", "year"):
        return int(column.to_json(value))
    if kind in ("float", "double"):
        return float(value)
    if kind == "decimal":
        text = column.to_json(value)
        return text if options.decimal == "string" else Decimal(text)
    if kind == "timestamp":
        local = value.astimezone(ZoneInfo(policy.timestamp_location))
        return datetime_text(local, fsp_of(data_type))
    if kind in ("date", "datetime", "time", "vector"):
        return column.to_json(value)
    if kind == "bit":
        integer = int(column.to_json(value))
        width = (
            (max(data_type.length, 1) + 7) // 8
            if options.bit_bytes == "fixed"
            else max(1, (integer.bit_length() + 7) // 8)
        )
        return integer.to_bytes(width, "big")
    if kind == "json":
        return json_document_text(value)
    if kind in ("enum", "set"):
        column.to_json(value)  # checks the labels
        return value
    if kind in ("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"):
        return bytes(value)
    if not isinstance(value, str):
        raise TypeError(f"expected str, got {type(value).__name__}")
    return value


# -- writer schemas (encoder side) ------------------------------------------------------------------
_BINARY = frozenset(("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"))
_INTS = frozenset(("tinyint", "smallint", "mediumint", "int"))


def _key_columns(schema: TableSchema) -> tuple[str, ...]:
    """New TiCDC's key: the PRIMARY KEY columns only, in table order."""
    primary = next((ix for ix in schema.indexes if ix.primary), None)
    wanted = set(primary.columns) if primary else set()
    return tuple(c.name for c in schema.columns if c.name in wanted)


def _tidb_type(column: Column, options: AvroOptions) -> tuple[str, Any, dict[str, str]]:
    """(tidb_type, Avro type, extra connect.parameters) of a column (spec §5.1)."""
    data_type = column.data_type
    kind, unsigned = data_type.mysql_type, data_type.unsigned
    if kind in _INTS:
        wide = unsigned and kind == "int"
        return ("INT UNSIGNED" if unsigned else "INT"), ("long" if wide else "int"), {}
    if kind == "bigint":
        if unsigned:
            return "BIGINT UNSIGNED", ("string" if options.bigint_unsigned == "string" else "long"), {}
        return "BIGINT", "long", {}
    if kind in ("float", "double"):
        return kind.upper(), kind, {}
    if kind == "decimal":
        return "DECIMAL", ("string" if options.decimal == "string" else "bytes"), {}
    if kind in _BINARY:
        return "BLOB", "bytes", {}
    if kind in ("date", "datetime", "timestamp", "time"):
        return kind.upper(), "string", {}
    if kind == "year":
        return "YEAR", "int", {}
    if kind == "bit":
        return "BIT", "bytes", {"length": str(max(data_type.length, 1))}
    if kind in ("enum", "set"):
        return kind.upper(), "string", {"allowed": joined_allowed(data_type.elements)}
    if kind == "json":
        return "JSON", "string", {}
    if kind == "vector":
        return "TiDBVECTORFloat32", "string", {}
    return "TEXT", "string", {}


def _column_field(column: Column, options: AvroOptions) -> dict[str, Any]:
    tidb_type, avro, extra = _tidb_type(column, options)
    wire: dict[str, Any] = {"type": avro, "connect.parameters": {"tidb_type": tidb_type, **extra}}
    if tidb_type == "DECIMAL" and avro == "bytes":
        length = column.data_type.length if column.data_type.length > 0 else 10
        wire |= {"logicalType": "decimal", "precision": length, "scale": column.data_type.decimal}
    name = sanitized(column.name)
    if column.nullable:
        return {"default": None, "name": name, "type": ["null", wire]}
    return {"name": name, "type": wire}


def _record(schema: TableSchema, fields: list[dict[str, Any]]) -> dict[str, Any]:
    namespace = f"default.{sanitized(schema.database)}" if schema.database else "default"
    return {"type": "record", "name": sanitized(schema.table), "namespace": namespace, "fields": fields}


def key_schema(schema: TableSchema, options: AvroOptions) -> dict[str, Any]:
    keys = set(_key_columns(schema))
    return _record(schema, [_column_field(c, options) for c in schema.columns if c.name in keys])


def value_schema(schema: TableSchema, options: AvroOptions) -> dict[str, Any]:
    columns = [_column_field(c, options) for c in schema.columns]
    fields = list(columns)
    if options.include_before:
        before = {
            "type": "record",
            "name": f"{sanitized(schema.table)}_before",
            "namespace": _record(schema, [])["namespace"],
            "fields": columns,
        }
        fields.append({"default": None, "name": BEFORE_FIELD, "type": ["null", before]})
    if options.tidb_extension or options.include_before:
        fields.append({"default": "", "name": OP, "type": "string"})
    if options.tidb_extension:
        fields += [
            {"default": 0, "name": COMMIT_TS, "type": "long"},
            {"default": 0, "name": PHYSICAL_TIME, "type": "long"},
        ]
        if options.checksum:
            fields += [
                {"default": "", "name": CHECKSUM, "type": "string"},
                {"default": False, "name": CORRUPTED, "type": "boolean"},
                {"default": 0, "name": CHECKSUM_VERSION, "type": "int"},
            ]
    return _record(schema, fields)
