"""Typed messages -> TiCDC Avro records (docs/protocols/ticdc-avro.md), registering writer schemas as TiCDC
does."""

from __future__ import annotations

import io
import json
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import fastavro

from consumer.errors import EncodeError
from consumer.protocol.model import (
    DDL,
    DML,
    TSO_PHYSICAL_SHIFT,
    Column,
    DMLType,
    TableSchema,
)
from consumer.protocol.self_described import joined_allowed
from consumer.protocol.ticdc_avro.registry import SchemaRegistry, subject_names
from consumer.protocol.ticdc_avro.schemas import (
    BEFORE_FIELD,
    CHECKPOINT_MARK,
    CHECKSUM,
    CHECKSUM_VERSION,
    COMMIT_TS,
    CORRUPTED,
    DDL_MARK,
    DELETE_MARK,
    MAGIC,
    OP,
    PHYSICAL_TIME,
    U64,
    AvroOptions,
    sanitized,
)
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
    column_type,
    datetime_text,
    fsp_of,
    json_document_text,
)


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
        return unsigned - U64 if unsigned >= 1 << 63 else unsigned
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
    """(tidb_type, Avro type, extra connect.parameters) of a column (docs/protocols/ticdc-avro.md §5.1)."""
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
