"""Public hypothesis strategies: valid Simple-protocol schemas, typed rows and messages.

Use them to property-test your own pipeline, e.g. that whatever our encoder writes your job reads back:

    @given(table_messages())
    def test_round_trip(pair):
        message, schema = pair
        ...
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

from hypothesis import strategies as st

from consumer.protocol.checksum import row_checksum
from consumer.protocol.limits import tso_of
from consumer.protocol.model import (
    DDL,
    DML,
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
from consumer.protocol.rows import TableCodec
from consumer.protocol.types import JSON_NULL, fsp_of

# TSOs a decoder takes for real: positive and not in the future (`DecodeLimits.max_commit_ts_ahead_s`).
TSO = st.integers(min_value=1, max_value=tso_of(dt.datetime(2025, 1, 1, tzinfo=dt.UTC).timestamp()))
BUILD_TS = st.integers(min_value=0, max_value=2**62)
_INTS = {"tinyint": 8, "smallint": 16, "mediumint": 24, "int": 32, "bigint": 64}
_TEXT_TYPES = ("char", "varchar", "tinytext", "text", "mediumtext", "longtext")
_BINARY_TYPES = ("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob")
_NAME = st.text(
    st.characters(codec="utf-8", exclude_characters=",", exclude_categories=("Cc",)), min_size=1, max_size=12
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
    draw: st.DrawFn, min_columns: int = 1, max_columns: int = 8, mysql_types: tuple[str, ...] | None = None
) -> TableSchema:
    """A table version with unique column names, an integer primary key first, and the given types."""
    names = draw(st.lists(_NAME, min_size=min_columns, max_size=max_columns, unique_by=str.lower))
    kinds = st.sampled_from(mysql_types or ALL_MYSQL_TYPES)
    cols = [draw(columns(name=n, mysql_type=draw(kinds))) for n in names]
    key = Column(name="id", data_type=DataType("bigint", length=20), nullable=False)
    cols = [key, *(c for c in cols if c.name.lower() != "id")]
    return TableSchema(
        database=draw(_NAME),
        table=draw(_NAME),
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
    (spec §8.3, computed from the values as TiCDC computes them)."""
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
