"""Typed messages and values as plain JSON-able objects: the `decode` command's output, the JSONL sink's rows
and the simulator's ground truth share these exact forms."""

from __future__ import annotations

import base64
import datetime as dt
from decimal import Decimal
from typing import Any

from consumer.protocol.model import DDL, DML, Bootstrap, Watermark
from consumer.protocol.types import JsonNull


def message_object(message: Watermark | Bootstrap | DDL | DML) -> dict[str, Any]:
    if isinstance(message, Watermark):
        return {"kind": "WATERMARK", "commitTs": message.commit_ts}
    if isinstance(message, Bootstrap):
        schema = message.table_schema
        return {
            "kind": "BOOTSTRAP",
            "database": schema.database,
            "table": schema.table,
            "tableID": schema.table_id,
            "schemaVersion": schema.version,
            "columns": [c.name for c in schema.columns],
        }
    if isinstance(message, DDL):
        described = message.table_schema
        return {
            "kind": "DDL",
            "type": message.type.value,
            "sql": message.sql,
            "commitTs": message.commit_ts,
            "database": message.database_name(),
            "table": described.table if described else None,
            "schemaVersion": described.version if described else None,
        }
    return {
        "kind": "DML",
        "type": message.type.value,
        "database": message.database,
        "table": message.table,
        "tableID": message.table_id,
        "commitTs": message.commit_ts,
        "schemaVersion": message.schema_version,
        "data": row_object(message.data),
        "old": row_object(message.old),
    }


def row_object(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if row is None else {name: value_object(value) for name, value in row.items()}


def value_object(value: Any) -> Any:
    """Exact JSON forms: decimals as strings with their scale, TIME as [-]H:MM:SS[.ffffff], bytes base64."""
    if isinstance(value, JsonNull):
        return None
    if isinstance(value, Decimal):
        return format(value, "f")
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).isoformat() if value.tzinfo else value.isoformat()
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return duration_text(value)
    return value


def duration_text(value: dt.timedelta) -> str:
    micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
    seconds, fraction = divmod(abs(micros), 1_000_000)
    hours, rest = divmod(seconds, 3600)
    text = f"{'-' if micros < 0 else ''}{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{text}.{fraction:06d}" if fraction else text
