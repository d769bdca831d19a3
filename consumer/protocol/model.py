"""Typed model of every Simple-protocol message (docs/protocols/simple.md §2-§5).

The schema structs carry their JSON wire names (`rename`), so the JSON codec encodes and decodes them
directly; the Avro codec maps its few differing names itself. DML row values are typed Python values
(see `consumer.protocol.types`), never wire strings.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

TSO_PHYSICAL_SHIFT = 18
"""A TiDB timestamp (TSO) is physical milliseconds << 18 | an 18-bit logical counter."""


def watermark_lag_seconds(watermark: int | None, now: float | None = None) -> float | None:
    """How far `watermark` (a TSO) is behind `now` (default: the clock), in seconds; None without one."""
    if not watermark:
        return None
    return max(0.0, (now or time.time()) - (watermark >> TSO_PHYSICAL_SHIFT) / 1000)


class DDLType(enum.StrEnum):
    CREATE = "CREATE"
    ALTER = "ALTER"
    ERASE = "ERASE"
    RENAME = "RENAME"
    TRUNCATE = "TRUNCATE"
    CINDEX = "CINDEX"
    DINDEX = "DINDEX"
    QUERY = "QUERY"


class DMLType(enum.StrEnum):
    INSERT = "INSERT"
    UPDATE = "UPDATE"
    DELETE = "DELETE"


class DataType(msgspec.Struct, frozen=True, omit_defaults=True, rename="camel"):
    """A column's type as TiDB describes it; `mysql_type` never holds flags or lengths
    (docs/protocols/simple.md §4.2)."""

    mysql_type: str
    charset: str = "binary"
    collate: str = "binary"
    length: int = 0
    decimal: int = 0
    elements: tuple[str, ...] = ()
    unsigned: bool = False
    zerofill: bool = False


class Column(msgspec.Struct, frozen=True, rename="camel"):
    name: str
    data_type: DataType
    nullable: bool = True
    # A string, an int (BIT defaults: JSON sends a number, Avro raw bytes) or None.
    default: str | int | None = None


class Index(msgspec.Struct, frozen=True):
    name: str
    unique: bool
    primary: bool
    nullable: bool
    columns: tuple[str, ...]


class TableSchema(msgspec.Struct, frozen=True, rename={"database": "schema", "table_id": "tableID"}):
    """One version of a table. `version` is TiDB's UpdateTS, referenced by DML `schemaVersion`."""

    database: str
    table: str
    table_id: int
    version: int
    columns: tuple[Column, ...] = ()
    indexes: tuple[Index, ...] = ()

    @property
    def key(self) -> tuple[str, str, int]:
        return (self.database, self.table, self.version)

    def column(self, name: str) -> Column | None:
        return next((c for c in self.columns if c.name == name), None)

    def handle_key(self) -> tuple[str, ...]:
        """The primary key, else the NOT NULL unique index with fewest columns, else ()
        (docs/protocols/simple.md §7.1)."""
        primary = [ix for ix in self.indexes if ix.primary]
        if primary:
            return primary[0].columns
        unique = [ix for ix in self.indexes if ix.unique and not ix.nullable]
        return min(unique, key=lambda ix: len(ix.columns)).columns if unique else ()


class Checksum(msgspec.Struct, frozen=True, gc=False):
    version: int
    corrupted: bool
    current: int
    previous: int


class Watermark(msgspec.Struct, frozen=True, kw_only=True):
    """Every DML with commit_ts <= this has been written to every partition before it."""

    commit_ts: int
    build_ts: int
    version: int = 1


class Bootstrap(msgspec.Struct, frozen=True, kw_only=True):
    """The latest schema of a table, re-sent periodically so mid-stream joiners learn it."""

    table_schema: TableSchema
    build_ts: int
    version: int = 1


class DDL(msgspec.Struct, frozen=True, kw_only=True):
    """`database`: of a DDL without a table schema (CREATE DATABASE...), the database the wire names apart
    from one (Debezium's `source.db`); "" where it names none (the Simple protocol)."""

    type: DDLType
    sql: str
    commit_ts: int
    build_ts: int
    table_schema: TableSchema | None = None
    pre_table_schema: TableSchema | None = None
    version: int = 1
    database: str = ""

    def database_name(self) -> str | None:
        """The database the DDL acted on: its table's, else the one the wire named (None: not known)."""
        schema = self.table_schema
        return schema.database if schema is not None else self.database or None


class DML(msgspec.Struct, frozen=True, kw_only=True):
    """One row change with typed values. `data`/`old` map column name to value; absent columns are absent."""

    type: DMLType
    database: str
    table: str
    table_id: int
    commit_ts: int
    build_ts: int
    schema_version: int
    data: dict[str, Any] | None = None
    old: dict[str, Any] | None = None
    checksum: Checksum | None = None
    handle_key_only: bool = False
    claim_check_location: str = ""
    version: int = 1


class RawDML(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """A DML whose routing header is decoded but whose row values are not (they need the schema).

    Holds only strings, ints and bytes, so it opts out of garbage-collector tracking (a hot-path cost).

    `payload` is the decompressed record value; `encoding` is "json" or "avro".
    """

    type: DMLType
    database: str
    table: str
    table_id: int
    commit_ts: int
    build_ts: int
    schema_version: int
    payload: bytes
    encoding: str

    @property
    def schema_key(self) -> tuple[str, str, int]:
        return (self.database, self.table, self.schema_version)


class KeyOnlyDML(msgspec.Struct, frozen=True, gc=False):
    """A DML whose message carries only the handle-key columns (docs/protocols/simple.md §7): TiCDC put the
    full message in claim-check storage at `claim_check_location`, or nowhere (handle-key-only: only upstream
    TiDB has the row). Never a row to apply as it is; `row` is the key-only message itself."""

    row: RawDML
    claim_check_location: str = ""


Message = Watermark | Bootstrap | DDL | DML
DecodedMessage = Watermark | Bootstrap | DDL | RawDML | KeyOnlyDML
