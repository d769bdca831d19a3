"""Public hypothesis strategies: valid schemas, typed rows and messages of the Simple protocol, and row
changes encoded in TiCDC's Avro (Confluent) and Debezium protocols with what a decoder must give back.

Use them to property-test your own pipeline, e.g. that whatever our encoder writes your job reads back:

    @given(table_messages())
    def test_round_trip(pair):
        message, schema = pair
        ...

    @given(debezium_changes())
    def test_debezium_round_trip(change):
        decoded = my_job.decode(change.key, change.value)  # a DML
        assert ChangeView.of(decoded) == change.expected
"""

from __future__ import annotations

import datetime as dt
from base64 import b64encode
from dataclasses import dataclass
from decimal import Decimal
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
from hypothesis import strategies as st

from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions, wire_value
from consumer.protocol.limits import tso_of
from consumer.protocol.model import (
    DDL,
    DML,
    TSO_PHYSICAL_SHIFT,
    Bootstrap,
    Checksum,
    Column,
    DataType,
    DDLType,
    DMLType,
    Index,
    Message,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.checksum import row_checksum
from consumer.protocol.table import TableCodec
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.schemas import AvroOptions, table_topic
from consumer.protocol.types import JSON_NULL, ValuePolicy, column_type, fsp_of

if TYPE_CHECKING:  # the registry client loads an HTTP stack: only the Avro strategies need it
    from consumer.protocol.ticdc_avro.registry import SchemaRegistry

# TSOs a decoder takes for real: positive and not in the future (`DecodeLimits.max_commit_ts_ahead_s`).
_TSO_MAX = tso_of(dt.datetime(2025, 1, 1, tzinfo=dt.UTC).timestamp())
TSO = st.integers(min_value=1, max_value=_TSO_MAX)
BUILD_TS = st.integers(min_value=0, max_value=2**62)
_INTS = {"tinyint": 8, "smallint": 16, "mediumint": 24, "int": 32, "bigint": 64}
_TEXT_TYPES = ("char", "varchar", "tinytext", "text", "mediumtext", "longtext")
_BINARY_TYPES = ("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob")
_NAME = st.text(
    st.characters(codec="utf-8", exclude_characters=",", exclude_categories=["Cc"]), min_size=1, max_size=12
).filter(lambda name: not name.endswith(" "))  # MySQL refuses identifiers ending in a space
_TIMESTAMP_MIN = dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=dt.UTC)
_TIMESTAMP_MAX = dt.datetime(2038, 1, 19, 3, 14, 7, tzinfo=dt.UTC)
_TIME_MAX = dt.timedelta(hours=838, minutes=59, seconds=59)


@st.composite
def data_types(draw: st.DrawFn, mysql_type: str | None = None) -> DataType:
    """A DataType as TiDB would describe it, for any (or the given) mysqlType."""
    kind = mysql_type or draw(st.sampled_from(ALL_MYSQL_TYPES))
    if kind in _INTS:
        unsigned = draw(st.booleans())
        return DataType(kind, length=_INTS[kind] // 3 + 2, unsigned=unsigned, zerofill=draw(st.booleans()))
    if kind in ("float", "double"):
        return DataType(kind, length=12 if kind == "float" else 22, unsigned=draw(st.booleans()))
    if kind == "decimal":
        precision = draw(st.integers(1, 65))
        return DataType(kind, length=precision, decimal=draw(st.integers(0, min(precision, 30))))
    if kind in _TEXT_TYPES or kind in ("enum", "set"):
        elements = (
            draw(st.lists(_NAME, min_size=1, max_size=6, unique=True)) if kind in ("enum", "set") else []
        )
        return DataType(kind, "utf8mb4", "utf8mb4_bin", length=255, elements=tuple(elements))
    if kind in _BINARY_TYPES:
        return DataType(kind, length=255)
    if kind in ("datetime", "timestamp", "time"):
        fsp = draw(st.integers(0, 6))
        base = 10 if kind == "time" else 19
        return DataType(kind, length=base + (fsp + 1 if fsp else 0), decimal=fsp)
    if kind == "year":
        return DataType(kind, length=4, unsigned=True, zerofill=True)
    if kind == "bit":
        return DataType(kind, length=draw(st.integers(1, 64)), unsigned=True)
    if kind == "json":
        return DataType(kind, length=4294967295)
    if kind == "vector":
        return DataType(kind, length=draw(st.integers(1, 8)))
    return DataType(kind, length=10)  # date


ALL_MYSQL_TYPES: tuple[str, ...] = (
    *_INTS, "float", "double", "decimal", *_TEXT_TYPES, *_BINARY_TYPES, "date", "datetime", "timestamp",
    "time", "year", "enum", "set", "bit", "json", "vector",
)  # fmt: skip


def values(column: Column) -> st.SearchStrategy[Any]:
    """Typed Python values valid for the column (None included when it is nullable)."""
    strategy = _non_null_values(column.data_type)
    return st.one_of(st.none(), strategy) if column.nullable else strategy


def _non_null_values(data_type: DataType) -> st.SearchStrategy[Any]:
    kind = data_type.mysql_type
    if kind in _INTS:
        bits = _INTS[kind]
        if data_type.unsigned:
            return st.integers(0, 2**bits - 1)
        return st.integers(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    if kind == "float":
        return st.floats(width=32, allow_nan=False, allow_infinity=False)
    if kind == "double":
        return st.floats(allow_nan=False, allow_infinity=False)
    if kind == "decimal":
        limit, scale = 10**data_type.length - 1, data_type.decimal  # exact: no 28-digit context rounding
        return st.integers(-limit, limit).map(lambda digits: Decimal(f"{digits}e-{scale}"))
    if kind in _TEXT_TYPES:
        return st.text(max_size=20)
    if kind in _BINARY_TYPES:
        return st.binary(max_size=20)
    if kind == "date":
        return st.dates()
    if kind == "datetime":
        return st.datetimes().map(lambda v: _truncate(v, fsp_of(data_type)))
    if kind == "timestamp":
        return st.datetimes(_TIMESTAMP_MIN.replace(tzinfo=None), _TIMESTAMP_MAX.replace(tzinfo=None)).map(
            lambda v: _truncate(v, fsp_of(data_type)).replace(tzinfo=dt.UTC)
        )
    if kind == "time":
        return st.timedeltas(-_TIME_MAX, _TIME_MAX).map(lambda v: _truncate_delta(v, fsp_of(data_type)))
    if kind == "year":
        return st.one_of(st.just(0), st.integers(1901, 2155))
    if kind == "enum":
        return st.sampled_from(data_type.elements)
    if kind == "set":
        return st.sets(st.sampled_from(data_type.elements)).map(
            lambda chosen: ",".join(e for e in data_type.elements if e in chosen)
        )
    if kind == "bit":
        return st.booleans() if data_type.length == 1 else st.integers(0, 2**data_type.length - 1)
    if kind == "json":
        return st.one_of(st.just(JSON_NULL), json_documents())
    if kind == "vector":
        element = st.floats(width=32, allow_nan=False, allow_infinity=False)
        return st.lists(element, min_size=data_type.length, max_size=data_type.length)
    raise ValueError(f"no value strategy for mysqlType {kind!r}")


def json_documents() -> st.SearchStrategy[Any]:
    """JSON documents TiDB can store (integers within 64 bits, finite floats)."""
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(max_size=10),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=8,
    ).filter(lambda v: v is not None)


def _truncate(value: dt.datetime, fsp: int) -> dt.datetime:
    step = 10 ** (6 - fsp)
    return value.replace(microsecond=value.microsecond // step * step)


def _truncate_delta(value: dt.timedelta, fsp: int) -> dt.timedelta:
    step = 10 ** (6 - fsp)
    micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    sign = -1 if micros < 0 else 1
    return dt.timedelta(microseconds=sign * (abs(micros) // step * step))


@st.composite
def columns(draw: st.DrawFn, name: str | None = None, mysql_type: str | None = None) -> Column:
    data_type = draw(data_types(mysql_type))
    default: str | int | None = None
    if draw(st.booleans()):
        default = (
            draw(st.integers(0, 2**data_type.length - 1))
            if data_type.mysql_type == "bit"
            else draw(st.text(max_size=8))
        )
    return Column(
        name=name or draw(_NAME), data_type=data_type, nullable=draw(st.booleans()), default=default
    )


@st.composite
def table_schemas(
    draw: st.DrawFn,
    min_columns: int = 1,
    max_columns: int = 8,
    mysql_types: tuple[str, ...] | None = None,
    names: st.SearchStrategy[str] | None = None,
) -> TableSchema:
    """A table version with unique column names, an integer primary key first, and the given types;
    `names` draws the database, table and column names (any MySQL identifier by default)."""
    names = _NAME if names is None else names
    column_names = draw(st.lists(names, min_size=min_columns, max_size=max_columns, unique_by=str.lower))
    kinds = st.sampled_from(mysql_types or ALL_MYSQL_TYPES)
    cols = [draw(columns(name=n, mysql_type=draw(kinds))) for n in column_names]
    key = Column(name="id", data_type=DataType("bigint", length=20), nullable=False)
    cols = [key, *(c for c in cols if c.name.lower() != "id")]
    return TableSchema(
        database=draw(names),
        table=draw(names),
        table_id=draw(st.integers(1, 2**40)),
        version=draw(TSO),
        columns=tuple(cols),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )


@st.composite
def rows(draw: st.DrawFn, schema: TableSchema, omit_columns: bool = False) -> dict[str, Any]:
    """A full row; with `omit_columns`, some non-key columns are left out (column selectors)."""
    row = {c.name: draw(values(c)) for c in schema.columns}
    if omit_columns:
        for column in schema.columns[1:]:
            if draw(st.booleans()):
                del row[column.name]
    return row


@st.composite
def dml_messages(draw: st.DrawFn, schema: TableSchema) -> DML:
    """A full row change as TiCDC sends it; with every column present, maybe with its row checksums
    (docs/protocols/simple.md §8.3, computed from the values as TiCDC computes them)."""
    kind = draw(st.sampled_from(DMLType))
    omit = draw(st.booleans())
    data = draw(rows(schema, omit)) if kind != DMLType.DELETE else None
    old = draw(rows(schema, omit)) if kind != DMLType.INSERT else None
    if data is not None and old is not None:  # an UPDATE carries the same columns in both images
        by_name = {c.name: c for c in schema.columns}
        old = {name: draw(values(by_name[name])) for name in data}
    checksum = None
    if not omit and draw(st.booleans()):  # column selectors make checksums unverifiable: none then
        codec = TableCodec(schema)
        checksum = Checksum(
            draw(st.integers(0, 2)), False, row_checksum(codec, data), row_checksum(codec, old)
        )
    return DML(
        type=kind,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=draw(TSO),
        build_ts=draw(BUILD_TS),
        schema_version=schema.version,
        data=data,
        old=old,
        checksum=checksum,
    )


@st.composite
def ddl_messages(draw: st.DrawFn, schema: TableSchema) -> DDL:
    kind = draw(st.sampled_from(DDLType))
    schema_less = kind == DDLType.QUERY and draw(st.booleans())
    return DDL(
        type=kind,
        sql=draw(st.text(min_size=1, max_size=40)),
        commit_ts=draw(TSO),
        build_ts=draw(BUILD_TS),
        table_schema=None if schema_less else schema,
        pre_table_schema=draw(st.none() | st.just(schema)) if not schema_less else None,
    )


def watermarks() -> st.SearchStrategy[Watermark]:
    return st.builds(Watermark, commit_ts=TSO, build_ts=BUILD_TS)


@st.composite
def table_messages(draw: st.DrawFn, **schema_options: Any) -> tuple[Message, TableSchema]:
    """Any message together with the table schema a DML needs to be encoded and decoded."""
    schema = draw(table_schemas(**schema_options))
    message = draw(
        st.one_of(
            watermarks(),
            st.builds(Bootstrap, table_schema=st.just(schema), build_ts=BUILD_TS),
            ddl_messages(schema),
            dml_messages(schema),
        )
    )
    return message, schema


# -- TiCDC's Avro (Confluent) and Debezium protocols --------------------------------------------------
# Names the Avro protocol keeps as they are (it sanitizes the others, docs/protocols/ticdc-avro.md §4.6),
# clear of its extension fields' names.
AVRO_NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True).filter(
    lambda name: not name.startswith(("_tidb", "_ticdc"))
)
# a physical time of at least 1 ms
COMMIT_TS = st.integers(min_value=1 << TSO_PHYSICAL_SHIFT, max_value=_TSO_MAX)


class ChangeView(NamedTuple):
    """What a decoded row change says: compare `ChangeView.of(decoded)` with `EncodedChange.expected`."""

    type: DMLType
    commit_ts: int
    data: dict[str, Any] | None
    old: dict[str, Any] | None

    @classmethod
    def of(cls, dml: DML) -> ChangeView:
        return cls(dml.type, dml.commit_ts, dml.data, dml.old)


@dataclass(frozen=True)
class EncodedChange:
    """A row change as one Kafka record of a protocol, and what decoding it must give back: `expected` is
    the change as far as that protocol's wire carries it (see `avro_view`, `debezium_view`)."""

    key: bytes | None
    value: bytes | None
    schema: TableSchema
    change: DML
    expected: ChangeView


@st.composite
def row_changes(draw: st.DrawFn, schema: TableSchema, kind: DMLType | None = None) -> DML:
    """An INSERT, UPDATE or DELETE of full rows (the images Avro and Debezium carry), commit ts a TSO."""
    kind = kind or draw(st.sampled_from(DMLType))
    return DML(
        type=kind,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=draw(COMMIT_TS),
        build_ts=0,
        schema_version=schema.version,
        data=draw(rows(schema)) if kind is not DMLType.DELETE else None,
        old=draw(rows(schema)) if kind is not DMLType.INSERT else None,
    )


def _carried_elements(schema: TableSchema) -> bool:
    """ENUM (and Avro SET) elements are joined by `,` with `,` escaped as `\\,`, and `\\` is not escaped:
    an element ending in `\\` before the next one reads as that pair joined by a comma
    (docs/protocols/ticdc-avro.md §4.5), so such a schema cannot round-trip."""
    return not any(e.endswith("\\") for c in schema.columns for e in c.data_type.elements[:-1])


def avro_table_schemas(**options: Any) -> st.SearchStrategy[TableSchema]:
    """`table_schemas` (same options) whose names and ENUM/SET elements the Avro protocol carries."""
    return table_schemas(names=AVRO_NAMES, **options).filter(_carried_elements)


def debezium_table_schemas(**options: Any) -> st.SearchStrategy[TableSchema]:
    """`table_schemas` (same options) whose ENUM elements the Debezium protocol carries."""
    return table_schemas(**options).filter(_carried_elements)


@st.composite
def avro_options(draw: st.DrawFn) -> AvroOptions:
    """Any combination of the Avro protocol's options (docs/protocols/ticdc-avro.md §9)."""
    extension = draw(st.booleans())
    return AvroOptions(
        decimal=draw(st.sampled_from(("precise", "string"))),
        bigint_unsigned=draw(st.sampled_from(("long", "string"))),
        tidb_extension=extension,
        include_before=draw(st.booleans()),
        checksum=extension and draw(st.booleans()),
        watermark=draw(st.booleans()),
        bit_bytes=draw(st.sampled_from(("fixed", "minimal"))),
    )


@st.composite
def debezium_options(draw: st.DrawFn) -> DebeziumOptions:
    """Any combination of the Debezium protocol's options that change the wire (docs/protocols/debezium.md
    §11), with the compressions a decoder's `auto` recognises (a snappy block has no mark: it is configured,
    so draw it as `DebeziumOptions(compression="snappy")` beside a decoder configured so)."""
    return DebeziumOptions(
        tidb_extension=draw(st.booleans()),
        disable_schema=draw(st.booleans()),
        output_old_value=draw(st.booleans()),
        cluster_id=draw(st.sampled_from(("default", "cluster-1"))),
        compression=draw(st.sampled_from(("none", "lz4"))),
    )


@st.composite
def avro_changes(
    draw: st.DrawFn,
    registry: SchemaRegistry,
    options: AvroOptions | None = None,
    schema: TableSchema | None = None,
    kind: DMLType | None = None,
) -> EncodedChange:
    """A row change as TiCDC's Avro protocol writes it (writer schemas registered in `registry`, as TiCDC
    does), with any options unless given; the schema from `avro_table_schemas` unless given. A DELETE
    without a value is a tombstone: its record has only the key."""
    options = options or draw(avro_options())
    schema = schema or draw(avro_table_schemas(max_columns=6))
    change = draw(row_changes(schema, kind))
    topic = table_topic("tidb", schema.database, schema.table)
    key, value = ConfluentAvroEncoder(registry, options).encode_dml(change, schema, topic)
    return EncodedChange(key, value, schema, change, avro_view(change, schema, options))


@st.composite
def debezium_changes(
    draw: st.DrawFn,
    options: DebeziumOptions | None = None,
    schema: TableSchema | None = None,
    kind: DMLType | None = None,
) -> EncodedChange:
    """A row change as TiCDC's Debezium protocol writes it, with any options unless given; the schema from
    `debezium_table_schemas` unless given."""
    options = options or draw(debezium_options())
    schema = schema or draw(debezium_table_schemas(max_columns=6))
    change = draw(row_changes(schema, kind))
    key, value = DebeziumEncoder(options).encode_dml(change, schema)
    return EncodedChange(key, value, schema, change, debezium_view(change, schema, options))


def avro_view(change: DML, schema: TableSchema, options: AvroOptions) -> ChangeView:
    """What the Avro wire carries of a change (docs/protocols/ticdc-avro.md §6): without `_tidb_op` (no
    extension, no before value) an UPDATE reads as an INSERT; the commit ts only with the extension (a
    tombstone has none, the watermark mode's delete marker has it); an UPDATE's old image only with the before
    value; a DELETE without it, its key only."""
    with_op = options.tidb_extension or options.include_before
    kind = change.type if with_op or change.type is DMLType.DELETE else DMLType.INSERT
    tombstone = change.type is DMLType.DELETE and not options.include_before
    stamped = options.tidb_extension and (not tombstone or options.watermark)
    old = change.old if options.include_before else None
    if tombstone:
        keys = schema.handle_key()
        old = {name: value for name, value in (change.old or {}).items() if name in keys}
    return ChangeView(kind, change.commit_ts if stamped else 0, change.data, old)


def debezium_view(change: DML, schema: TableSchema, options: DebeziumOptions) -> ChangeView:
    """What the Debezium wire carries of a change (docs/protocols/debezium.md §6): DECIMAL as a float64, years
    below 100 shifted (+2000 below 70, else +1900), DATETIME(0-3) in milliseconds; without `tidb_type` (no
    extension) BIGINT UNSIGNED as its signed bit pattern and binary values as base64 text; without the schema
    every column's JSON value as sent; an UPDATE's old image only with `output_old_value`."""
    types = {c.name: column_type(c, ValuePolicy()) for c in schema.columns}

    def view(image: dict[str, Any] | None) -> dict[str, Any] | None:
        if image is None:
            return None
        if options.disable_schema:
            return {name: _json_value(wire_value(types[name], value)) for name, value in image.items()}
        return {name: _debezium_value(types[name].data_type, value, options) for name, value in image.items()}

    old = change.old if change.type is not DMLType.UPDATE or options.output_old_value else None
    return ChangeView(change.type, change.commit_ts, view(change.data), view(old))


def _json_value(wire: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(wire))


def _debezium_value(data_type: DataType, value: Any, options: DebeziumOptions) -> Any:
    kind = data_type.mysql_type
    if value is None:
        return None
    if kind == "decimal":
        return float(value)
    if kind in ("date", "datetime") and value.year < 100:
        value = value.replace(year=value.year + (2000 if value.year < 70 else 1900))
    if kind == "datetime" and fsp_of(data_type) <= 3:
        return value.replace(microsecond=value.microsecond // 1000 * 1000)
    if not options.tidb_extension and kind == "bigint" and data_type.unsigned and value >= 1 << 63:
        return value - (1 << 64)
    if not options.tidb_extension and kind in _BINARY_TYPES:
        return b64encode(value).decode()
    return value
