"""Typed messages -> Debezium change events as TiCDC writes them (docs/protocols/debezium.md)."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from consumer.protocol.compression import Compression, compress
from consumer.protocol.debezium.wire import BINARY, EPOCH, INTS, TEXTS, U64
from consumer.protocol.model import (
    DDL,
    DML,
    TSO_PHYSICAL_SHIFT,
    Column,
    DataType,
    DDLType,
    DMLType,
    TableSchema,
)
from consumer.protocol.self_described import (
    joined_allowed,
)
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
    column_type,
    float32_text,
    fsp_of,
    json_document_text,
)


# -- encoding ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DebeziumOptions:
    """TiCDC's options for this protocol (docs/protocols/debezium.md §11) that change the wire."""

    tidb_extension: bool = False
    disable_schema: bool = False
    output_old_value: bool = True
    cluster_id: str = "default"
    compression: Compression = "none"


class DebeziumEncoder:
    """Typed messages -> (key, value) records as TiCDC writes them (docs/protocols/debezium.md §4-§9)."""

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
                " unsigned" if data_type.unsigned and (kind in INTS or kind in ("float", "double")) else ""
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
    unsigned = " UNSIGNED" if data_type.unsigned and (kind in INTS or kind in ("float", "double")) else ""
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
        "charsetName": data_type.charset if kind in TEXTS else None,
        "length": length,
        "scale": data_type.decimal if kind == "decimal" else None,
        "position": position,
        "optional": column.nullable,
        "autoIncremented": False,
        "generated": False,
    }


def wire_value(column: ColumnType, value: Any) -> Any:
    """A typed value as TiCDC's Debezium JSON writes it (docs/protocols/debezium.md §6.1-§6.2)."""
    if value is None:
        return None
    data_type = column.data_type
    kind = data_type.mysql_type
    if kind == "bigint" and data_type.unsigned:
        integer = int(column.to_json(value))
        return integer - U64 if integer >= 1 << 63 else integer
    if kind in INTS or kind == "year":
        return int(column.to_json(value))
    if kind == "float":
        return msgspec.Raw(float32_text(float(value)).encode())
    if kind in ("double", "decimal"):
        return float(value)
    if kind == "date":
        return (_two_digit_year(value) - EPOCH).days
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
    if kind in BINARY:
        return base64.b64encode(bytes(value)).decode()
    if kind == "vector":
        return column.to_json(value)
    return value


def _two_digit_year(value: dt.date) -> dt.date:
    """Debezium's shift of years below 100 (docs/protocols/debezium.md §6.2): 0-69 -> 2000+, 70-99 ->
    1900+."""
    if value.year >= 100:
        return value
    return value.replace(year=value.year + (2000 if value.year < 70 else 1900))
