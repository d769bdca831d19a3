"""Records as a consumer receives them, for tests of the stages after the codec (users' tests too)."""

from __future__ import annotations

from typing import Any

from consumer.protocol.model import DML, Checksum, DMLType, RawDML, TableSchema
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.simple.rows import Encoding


def raw_dml(
    schema: TableSchema,
    kind: DMLType,
    data: dict[str, Any] | None = None,
    old: dict[str, Any] | None = None,
    *,
    commit_ts: int,
    encoding: Encoding = "json",
) -> RawDML:
    """A DML of `schema`'s table encoded as TiCDC would send it, then decoded to its routing header: the
    values go through the real wire forms, as in production."""
    dml = table_dml(schema, kind, data, old, commit_ts=commit_ts)
    raw = MessageDecoder(encoding).decode(MessageEncoder(encoding).encode(dml, schema))
    if not isinstance(raw, RawDML):
        raise TypeError(f"a DML decoded as {type(raw).__name__}")
    return raw


def table_dml(
    schema: TableSchema,
    kind: DMLType,
    data: dict[str, Any] | None = None,
    old: dict[str, Any] | None = None,
    *,
    commit_ts: int,
    checksum: Checksum | None = None,
) -> DML:
    """A DML of `schema`'s table, its header taken from the schema, before encoding."""
    return DML(
        type=kind,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=commit_ts,
        build_ts=0,
        schema_version=schema.version,
        data=data,
        old=old,
        checksum=checksum,
    )
