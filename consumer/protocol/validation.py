"""A table schema is checked once, when it arrives, against what MySQL/TiDB itself allows.

TiDB never produces a schema outside these limits, so one that breaks them is corrupt or hostile: it is
refused as a whole (`SchemaRejectedError`) before any of its types reaches Arrow, where some of them would
crash the process (a DECIMAL scale of 2^31 segfaults pyarrow). The limits are TiDB's own: identifier
lengths, column and index counts, DECIMAL precision and scale, BIT width, ENUM/SET sizes, fractional-second
precision. Column and index names are compared case-insensitively, as MySQL does.

A mysqlType this SDK does not know (a newer TiDB) is not a broken schema: under `unknown_types = "lossless"`
its values are kept as their wire text (with a warning naming the table and column, once), under `"error"`
the schema is refused so its rows go to the error policy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Literal

from cachetools import LRUCache

from consumer.errors import SchemaRejectedError
from consumer.protocol.model import Column, DataType, Index, TableSchema
from consumer.protocol.types import MYSQL_TYPES

log = logging.getLogger(__name__)

UnknownTypePolicy = Literal["lossless", "error"]

MAX_IDENTIFIER_CHARS = 64  # database, table, column and index names
MAX_COLUMNS = 4096
MAX_INDEXES = 512 + 1  # TiDB's highest `index-limit`, plus the synthetic primary TiCDC appends
MAX_KEY_PARTS = 16
MAX_DECIMAL_PRECISION = 65
MAX_DECIMAL_SCALE = 30
MAX_FLOAT_SCALE = 30
MAX_FSP = 6
MAX_BIT_WIDTH = 64
MAX_ENUM_ELEMENTS = 65535
MAX_SET_ELEMENTS = 64
MAX_VECTOR_DIMENSION = 16383
MAX_LENGTH = 0xFFFF_FFFF  # a column's flen (LONGTEXT's length); -1 means unspecified
MAX_VERSION = (1 << 63) - 1  # schema versions are TSOs, stored as int64 `_schema_version`
_UNSPECIFIED = -1
_FSP_TYPES = frozenset(("datetime", "timestamp", "time"))
_KNOWN = frozenset(MYSQL_TYPES)
_warned: LRUCache[tuple[str, str, str, str], bool] = LRUCache(1024)  # unknown types reported once each


def validate_schema(schema: TableSchema, unknown_types: UnknownTypePolicy = "lossless") -> None:
    """Raise `SchemaRejectedError` (carrying the schema's key) when `schema` is outside TiDB's limits."""
    problems = list(_problems(schema, unknown_types))
    if problems:
        table = f"{schema.database}.{schema.table}"
        raise SchemaRejectedError(
            f"schema of {table!r} version {schema.version} rejected: {'; '.join(problems[:5])}"
            + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""),
            keys=(schema.key,),
        )
    _warn_unknown_types(schema)


def _problems(schema: TableSchema, unknown_types: UnknownTypePolicy) -> Iterator[str]:
    yield from _identifier("database", schema.database)
    yield from _identifier("table", schema.table)
    if not 0 <= schema.version <= MAX_VERSION:
        yield f"version {schema.version} is no TSO"
    if len(schema.columns) > MAX_COLUMNS:
        yield f"{len(schema.columns)} columns, more than {MAX_COLUMNS}"
    seen: set[str] = set()
    for column in schema.columns:
        folded = column.name.lower()
        if folded in seen:
            yield f"column {column.name!r} appears twice (names are case-insensitive)"
        seen.add(folded)
        yield from _column(column, unknown_types)
    if len(schema.indexes) > MAX_INDEXES:
        yield f"{len(schema.indexes)} indexes, more than {MAX_INDEXES}"
    for index in schema.indexes:
        yield from _index(index, seen)


def _identifier(kind: str, name: str) -> Iterator[str]:
    if not name:
        yield f"empty {kind} name"
    elif len(name) > MAX_IDENTIFIER_CHARS:
        yield f"{kind} name of {len(name)} characters, more than {MAX_IDENTIFIER_CHARS}"
    elif name.endswith(" "):
        yield f"{kind} name {name!r} ends with a space"
    if "\x00" in name:
        yield f"{kind} name {name[:MAX_IDENTIFIER_CHARS]!r} holds a NUL character"
    if not _encodable(name):
        yield f"{kind} name {name[:MAX_IDENTIFIER_CHARS]!r} is not valid Unicode text"


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _column(column: Column, unknown_types: UnknownTypePolicy) -> Iterator[str]:
    yield from _identifier("column", column.name)
    data_type = column.data_type
    where = f"column {column.name[:MAX_IDENTIFIER_CHARS]!r}"
    kind = data_type.mysql_type
    if kind not in _KNOWN:
        if unknown_types == "error":
            yield f"{where} has mysqlType {kind[:MAX_IDENTIFIER_CHARS]!r}, which this SDK does not know"
        return
    if not _UNSPECIFIED <= data_type.length <= MAX_LENGTH:
        yield f"{where}: length {data_type.length} outside -1..{MAX_LENGTH}"
    for problem in _type_limits(data_type):
        yield f"{where}: {problem}"
    if isinstance(column.default, int) and not 0 <= column.default <= 0xFFFF_FFFF_FFFF_FFFF:
        yield f"{where}: BIT default {column.default} does not fit 64 bits"


def _type_limits(data_type: DataType) -> Iterator[str]:
    kind, length, decimal = data_type.mysql_type, data_type.length, data_type.decimal
    if kind == "decimal":
        precision = length if length > 0 else 10
        if precision > MAX_DECIMAL_PRECISION:
            yield f"DECIMAL precision {precision} above {MAX_DECIMAL_PRECISION}"
        if not 0 <= decimal <= MAX_DECIMAL_SCALE:
            yield f"DECIMAL scale {decimal} outside 0..{MAX_DECIMAL_SCALE}"
        elif decimal > precision:
            yield f"DECIMAL scale {decimal} above its precision {precision}"
    elif kind in _FSP_TYPES:
        if not _UNSPECIFIED <= decimal <= MAX_FSP:
            yield f"fractional-second precision {decimal} outside 0..{MAX_FSP}"
    elif kind in ("float", "double"):
        if not _UNSPECIFIED <= decimal <= MAX_FLOAT_SCALE:
            yield f"{kind.upper()} scale {decimal} outside 0..{MAX_FLOAT_SCALE}"
    elif kind == "bit":
        if length > MAX_BIT_WIDTH:
            yield f"BIT width {length} above {MAX_BIT_WIDTH}"
    elif kind == "vector":
        if length > MAX_VECTOR_DIMENSION:
            yield f"VECTOR dimension {length} above {MAX_VECTOR_DIMENSION}"
    elif kind in ("enum", "set"):
        yield from _elements(kind, data_type.elements)


def _elements(kind: str, elements: tuple[str, ...]) -> Iterator[str]:
    limit = MAX_ENUM_ELEMENTS if kind == "enum" else MAX_SET_ELEMENTS
    if not elements:
        yield f"{kind.upper()} without elements"
    if len(elements) > limit:
        yield f"{kind.upper()} of {len(elements)} elements, more than {limit}"
    if len(set(elements)) != len(elements):
        yield f"{kind.upper()} elements repeat"
    if kind == "set" and any("," in element for element in elements):
        yield "a SET element holds a comma"
    if not all(map(_encodable, elements)):
        yield f"an {kind.upper()} element is not valid Unicode text"


def _index(index: Index, columns: set[str]) -> Iterator[str]:
    if len(index.name) > MAX_IDENTIFIER_CHARS:
        yield f"index name of {len(index.name)} characters, more than {MAX_IDENTIFIER_CHARS}"
    where = f"index {index.name[:MAX_IDENTIFIER_CHARS]!r}"
    if len(index.columns) > MAX_KEY_PARTS:
        yield f"{where} has {len(index.columns)} columns, more than {MAX_KEY_PARTS}"
    missing = [name for name in index.columns if name.lower() not in columns]
    if missing:
        yield f"{where} names columns the table lacks: {', '.join(repr(n[:64]) for n in missing[:3])}"


def _warn_unknown_types(schema: TableSchema) -> None:
    for column in schema.columns:
        kind = column.data_type.mysql_type
        if kind in _KNOWN:
            continue
        key = (schema.database, schema.table, column.name, kind)
        if key not in _warned:
            _warned[key] = True
            log.warning(
                "%s.%s column %r has mysqlType %r, unknown to this SDK: its values are kept as their wire "
                "text (decode.unknown_types = lossless)",
                schema.database,
                schema.table,
                column.name,
                kind,
            )
