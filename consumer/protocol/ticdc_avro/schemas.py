"""TiCDC Avro table versions (docs/protocols/ticdc-avro.md): topic and subject names, registry ids as the
SDK's schema version, and the layout of a version's writer schemas, which the decoder, the rows decoder and
the encoder share."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import fastavro

from consumer.errors import MalformedMessageError, UnsupportedTypeError
from consumer.protocol.model import (
    Column,
    DataType,
    DMLType,
    Index,
    TableSchema,
)
from consumer.protocol.self_described import TEXT, split_allowed, stable_table_id

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
OPS = {"c": DMLType.INSERT, "u": DMLType.UPDATE, "d": DMLType.DELETE}
_ID_BITS = 31  # registry ids are positive int32: a version holds both
U64 = 1 << 64

DecimalMode = Literal["precise", "string"]
UnsignedMode = Literal["long", "string"]


@dataclass(frozen=True)
class AvroOptions:
    """TiCDC's options for this protocol (docs/protocols/ticdc-avro.md §9), which the encoder follows; the
    decoder needs none of them (the writer schema says everything) but the producer's time zone, in
    `ValuePolicy.timestamp_location`.

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

    Only the shape TiCDC writes passes (docs/protocols/ticdc-avro.md §4): records of column fields of the
    primitive each
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


# Each tidb_type's Avro primitives (docs/protocols/ticdc-avro.md §5.1; integer types accept either width).
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


def frame_id(framed: bytes) -> int:
    return int.from_bytes(framed[1:5], "big")
