"""JSON encoding (docs/protocols/simple.md §3): messages exactly as TiCDC's Go `encoding/json` writes them."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from consumer.errors import MalformedMessageError, UnknownMessageTypeError
from consumer.protocol.checks import MessageChecks
from consumer.protocol.limits import MAX_TSO, check_nesting
from consumer.protocol.model import (
    DDL,
    DML,
    Bootstrap,
    Checksum,
    DDLType,
    DecodedMessage,
    DMLType,
    KeyOnlyDML,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.parse_errors import JSON_ERRORS, json_problem

_DDL_TYPES = frozenset(DDLType)
_DML_TYPES = {kind.value: kind for kind in DMLType}


# A schema version is a TSO, stored as int64 `_schema_version`: msgspec checks the range while decoding.
_SchemaVersion = Annotated[int, msgspec.Meta(ge=0, le=MAX_TSO)]


class _Envelope(msgspec.Struct, rename="camel", gc=False):
    """Only the routing fields: decoding skips `data`/`old` without building them."""

    type: str
    commit_ts: int = 0
    build_ts: int = 0
    version: int = 0
    database: str = ""
    table: str = ""
    table_id: int = msgspec.field(default=0, name="tableID")
    schema_version: _SchemaVersion = 0
    claim_check_location: str = ""
    handle_key_only: bool = False


_ABSENT = -1  # commitTs/buildTs are always on the wire (even 0), so only a missing one is omitted


class _Wire(msgspec.Struct, omit_defaults=True, rename="camel"):
    """Every top-level field in Go's declaration order; defaults are Go's omitempty zero values."""

    version: int
    database: str = ""
    table: str = ""
    table_id: int = msgspec.field(default=0, name="tableID")
    type: str = ""
    sql: str = ""
    commit_ts: int = _ABSENT
    build_ts: int = _ABSENT
    schema_version: int = 0
    claim_check_location: str = ""
    handle_key_only: bool = False
    checksum: Checksum | None = None
    data: dict[str, Any] | None = None
    old: dict[str, Any] | None = None
    table_schema: TableSchema | None = None
    pre_table_schema: TableSchema | None = None


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_WIRE = msgspec.json.Decoder(_Wire)
_ENCODER = msgspec.json.Encoder(order="deterministic")  # map keys sorted, as Go sorts them
# Go's HTML-safe escaping; these characters can only occur inside JSON strings, so replacing is safe.
_GO_ESCAPES = (
    (b"<", b"\\u003c"),
    (b">", b"\\u003e"),
    (b"&", b"\\u0026"),
    ("\u2028".encode(), b"\\u2028"),
    ("\u2029".encode(), b"\\u2029"),
)


_DEFAULT_CHECKS = MessageChecks()


def decode(payload: bytes, checks: MessageChecks = _DEFAULT_CHECKS) -> DecodedMessage:
    """Decode one uncompressed JSON value; DML values stay undecoded in a `RawDML`. The message passes
    `checks` (its commitTs, its schemas).

    The envelope skips `data`/`old` without building them; a schema or watermark message is built in full,
    so its nesting is bounded first.
    """
    try:
        envelope = _ENVELOPE.decode(payload)
    except JSON_ERRORS as exc:
        raise MalformedMessageError(f"invalid JSON message: {json_problem(exc, payload)}") from exc
    kind = _DML_TYPES.get(envelope.type)
    if kind is not None:  # inlined: DMLs are nearly every message
        if not envelope.database:
            raise MalformedMessageError(
                "DML without `database` (a pre-v8.0 TiCDC message shape, which this SDK does not read)"
            )
        commit_ts = envelope.commit_ts
        if not 0 < commit_ts <= checks.ceiling:
            checks.commit_ts(commit_ts, "DML")
        raw = RawDML(
            type=kind,
            database=envelope.database,
            table=envelope.table,
            table_id=envelope.table_id,
            commit_ts=commit_ts,
            build_ts=envelope.build_ts,
            schema_version=envelope.schema_version,
            payload=payload,
            encoding="json",
        )
        if envelope.handle_key_only or envelope.claim_check_location:
            return KeyOnlyDML(raw, envelope.claim_check_location)
        return raw
    check_nesting(payload, checks.max_nesting_depth, f"{envelope.type[:20]} message")
    try:
        wire = _WIRE.decode(payload)
    except JSON_ERRORS as exc:
        raise MalformedMessageError(f"invalid {envelope.type} message: {json_problem(exc, payload)}") from exc
    if _ABSENT in (wire.commit_ts, wire.build_ts):
        raise MalformedMessageError(f"{wire.type} message without commitTs/buildTs")
    return checks.message(_schema_or_watermark(wire))


def _schema_or_watermark(wire: _Wire) -> Watermark | Bootstrap | DDL:
    if wire.type == "WATERMARK":
        return Watermark(commit_ts=wire.commit_ts, build_ts=wire.build_ts, version=wire.version)
    if wire.type == "BOOTSTRAP":
        if wire.table_schema is None:
            raise MalformedMessageError("BOOTSTRAP without tableSchema")
        return Bootstrap(table_schema=wire.table_schema, build_ts=wire.build_ts, version=wire.version)
    if wire.type in _DDL_TYPES:
        return DDL(
            type=DDLType(wire.type),
            sql=wire.sql,
            commit_ts=wire.commit_ts,
            build_ts=wire.build_ts,
            table_schema=wire.table_schema,
            pre_table_schema=wire.pre_table_schema,
            version=wire.version,
        )
    hint = " (the pre-v8.0 `DDL` shape)" if wire.type == "DDL" else ""
    raise UnknownMessageTypeError(f"unknown message type {wire.type!r}{hint}")


def encode(message: Watermark | Bootstrap | DDL | DML, data: Any = None, old: Any = None) -> bytes:
    """Encode a message; for a DML, `data`/`old` are the already wire-encoded row maps."""
    return _go_escaped(_ENCODER.encode(_wire_out(message, data, old)))


def _wire_out(message: Watermark | Bootstrap | DDL | DML, data: Any, old: Any) -> _Wire:
    if isinstance(message, Watermark):
        return _Wire(
            version=message.version, type="WATERMARK", commit_ts=message.commit_ts, build_ts=message.build_ts
        )
    if isinstance(message, Bootstrap):
        return _Wire(
            version=message.version,
            type="BOOTSTRAP",
            commit_ts=0,
            build_ts=message.build_ts,
            table_schema=message.table_schema,
        )
    if isinstance(message, DDL):
        return _Wire(
            version=message.version,
            type=message.type.value,
            sql=message.sql,
            commit_ts=message.commit_ts,
            build_ts=message.build_ts,
            table_schema=message.table_schema,
            pre_table_schema=message.pre_table_schema,
        )
    return _Wire(
        version=message.version,
        database=message.database,
        table=message.table,
        table_id=message.table_id,
        type=message.type.value,
        commit_ts=message.commit_ts,
        build_ts=message.build_ts,
        schema_version=message.schema_version,
        claim_check_location=message.claim_check_location,
        handle_key_only=message.handle_key_only,
        checksum=message.checksum,
        data=data or None,
        old=old or None,  # Go drops empty maps
    )


def _go_escaped(encoded: bytes) -> bytes:
    for raw, escaped in _GO_ESCAPES:
        if raw in encoded:
            encoded = encoded.replace(raw, escaped)
    return encoded
