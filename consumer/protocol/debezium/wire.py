"""What the Debezium decoder, rows decoder and encoder share: the encoding's name, MySQL type families and
wire limits (docs/protocols/debezium.md)."""

from __future__ import annotations

import datetime as dt

import msgspec

from consumer.protocol.model import DataType

ENCODING = "debezium"
BINARY = frozenset(("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"))
TEXTS = frozenset(("char", "varchar", "tinytext", "text", "mediumtext", "longtext"))
INTS = frozenset(("tinyint", "smallint", "mediumint", "int", "bigint"))
U64 = 1 << 64
EPOCH = dt.date(1970, 1, 1)
MAX_TIME_US = (838 * 3600 + 59 * 60 + 59) * 1_000_000
NULL = b"null"
# msgspec reports invalid UTF-8 inside a string as UnicodeDecodeError, not as one of its own errors.
INVALID = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)

UNTYPED_JSON = DataType("json", collate="debezium-untyped")
"""The type of a column nothing types (`debezium-disable-schema`): a `json` column holding each value's wire
JSON. Marked apart from a typed JSON column, whose value is a JSON document sent as a string."""
