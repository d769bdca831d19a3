"""TiCDC's Avro protocol (`protocol=avro`, docs/protocols/ticdc-avro.md): a Confluent-framed key and value per
row change, writer schemas in a schema registry, one topic per table.

A record carries no schema version of TiDB's: the table version of a row is its pair of writer schemas. The
decoder derives the SDK's `TableSchema` from them (`AvroLayout.schema`, version `key id << 31 | value id`)
and hands it to the state machine through `described_schema`, so rows never wait for a BOOTSTRAP that this
protocol does not have. Row values stay undecoded in a `RawDML` (`encoding` "avro-confluent", `payload` the
framed value, or the framed key of a key-only DELETE) until a batch of them is decoded columnar
(`consumer.protocol.ticdc_avro.rows`).

Routing needs each row's operation and commit ts, which the TiDB extension puts at the *end* of the datum:
they are read backwards from the last bytes (the extension fields' layout is fixed by the writer schema),
and the columnar decode later checks them against the decoded fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from consumer.errors import ConsumerError, MalformedMessageError
from consumer.protocol.avro_varints import MAX_VARINT_BYTES, overlong_reason
from consumer.protocol.base import DecoderSettings, Protocol, SelfDescribedRows, TableRows
from consumer.protocol.checks import MessageChecks
from consumer.protocol.containment import KeyedValue, decoded_each, raise_contained
from consumer.protocol.model import (
    DDL,
    DDLType,
    DecodedMessage,
    DMLType,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.parse_errors import JSON_ERRORS, json_problem
from consumer.protocol.self_described import stable_table_id
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.rows import AvroRows
from consumer.protocol.ticdc_avro.schemas import (
    CHECKPOINT_MARK,
    DDL_MARK,
    DELETE_MARK,
    ENCODING,
    MAGIC,
    OPS,
    AvroLayout,
    frame_id,
    layout,
)
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
)
from consumer.protocol.validation import validate_schema


# -- decoding records ---------------------------------------------------------------------------------
class ConfluentAvroDecoder:
    """Kafka record (key, value) -> message, per docs/protocols/ticdc-avro.md §3.2; watermark-mode records are
    always recognised (a Confluent frame starts with 0x00, so they cannot be mistaken)."""

    def __init__(self, registry: SchemaRegistry, policy: ValuePolicy | None = None) -> None:
        self.registry = registry
        self.protocol = TicdcAvroProtocol(registry)
        self.policy = policy or ValuePolicy()
        self._checks = MessageChecks(self.policy.limits, self.policy.unknown_types)
        self._layouts: dict[tuple[int, int], AvroLayout] = {}
        self._by_version: dict[tuple[str, str, int], AvroLayout] = {}
        self._value_of_key: dict[int, int] = {}  # key schema id -> the newest value schema id seen with it
        # `_row`'s previous (key frame, value frame) and their layout
        self._last: tuple[tuple[bytes | None, bytes], AvroLayout] | None = None

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None:
        """The table version this decoder derived for a row it returned (`RawDML.schema_key`)."""
        found = self._by_version.get(key)
        return found.schema if found is not None else None

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        return decoded_each(self.decode_record, records)

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        try:
            return self._decode_record(key, value)
        except BaseException as exc:
            raise_contained(exc, "decoding a TiCDC Avro record")

    def _decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        if value:
            first = value[0]
            if first == MAGIC:
                return self._row(key, value)
            if first == DDL_MARK and key is None:
                return self._checks.message(_ddl(value))
            if first == CHECKPOINT_MARK and key is None:
                return self._checks.message(Watermark(commit_ts=_tso(value), build_ts=0))
            if first == DELETE_MARK and key:
                return self._key_only_delete(key, self._commit_ts(_tso(value)))
            raise MalformedMessageError(f"not a TiCDC Avro record: value starts with 0x{first:02x}")
        if key:
            return self._key_only_delete(key, 0)
        raise MalformedMessageError("a record with neither key nor value (TiCDC loses a keyless DELETE)")

    def layout_of(self, key_id: int, value_id: int) -> AvroLayout:
        found = self._layouts.get((key_id, value_id))
        if found is None:
            key_json = self.registry.schema(key_id) if key_id else None
            value_json = self.registry.schema(value_id) if value_id else None
            found = layout(key_json, value_json, key_id, value_id)
            validate_schema(found.schema, self.policy.unknown_types)
            self._layouts[(key_id, value_id)] = found
            self._by_version[found.schema.key] = found
        return found

    def _row(self, key: bytes | None, value: bytes) -> RawDML:
        frames = (None if key is None else key[:5], value[:5])
        last = self._last
        if last is not None and last[0] == frames:  # the previous row's schemas (frames checked then)
            found = last[1]
        else:
            value_id = _frame_id(value, "value")
            key_id = _frame_id(key, "key") if key is not None else 0
            found = self.layout_of(key_id, value_id)
            if key_id:
                self._value_of_key[key_id] = value_id
            self._last = (frames, found)
        kind, commit_ts = DMLType.INSERT, 0
        if found.extension:
            kind, commit_ts = _tail(value, found.checksum)
            self._commit_ts(commit_ts)
        elif found.before:
            kind = _last_op(value)
        return _raw(found, kind, commit_ts, value)

    def _commit_ts(self, commit_ts: int) -> int:
        self._checks.commit_ts(commit_ts, "DML")
        return commit_ts

    def _key_only_delete(self, key: bytes, commit_ts: int) -> RawDML:
        """A tombstone (or the 0x03 marker): only the key. It joins the table version of the newest value
        schema seen with its key schema, so its rows batch with theirs."""
        key_id = _frame_id(key, "key")
        found = self.layout_of(key_id, self._value_of_key.get(key_id, 0))
        return _raw(found, DMLType.DELETE, commit_ts, key)


def _raw(found: AvroLayout, kind: DMLType, commit_ts: int, payload: bytes) -> RawDML:
    schema = found.schema
    return RawDML(
        type=kind,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=commit_ts,
        build_ts=0,
        schema_version=schema.version,
        payload=payload,
        encoding=ENCODING,
    )


def _frame_id(framed: bytes, part: str) -> int:
    if len(framed) < 5 or framed[0] != MAGIC:
        raise MalformedMessageError(f"record {part} is not in the Confluent wire format (0x00 + schema id)")
    return frame_id(framed)


def _tso(value: bytes) -> int:
    if len(value) != 9:
        raise MalformedMessageError(f"a 0x{value[0]:02x} marker is 9 bytes, not {len(value)}")
    return int.from_bytes(value[1:], "big")


def _tail(value: bytes, checksum: bool) -> tuple[DMLType, int]:
    """`_tidb_op` and `_tidb_commit_ts`, read backwards from the datum's end: `[op][commit ts][physical
    time]` and, with checksums, `[checksum digits][corrupted][checksum version]` after them.

    Without checksums the varints' boundaries are found in C (`_tail_fast`); anything it does not settle
    takes the byte-by-byte reading (`_tail_each`), which gives the same answers (a property test)."""
    if not checksum:
        found = _tail_fast(value)
        if found is not None:
            return found
    return _tail_each(value, checksum)


# A byte of the last `_TAIL_WINDOW` of a datum as "1" if a varint continues after it, else "0".
_CONTINUES = bytes(0x31 if byte & 0x80 else 0x30 for byte in range(256))
_TAIL_WINDOW = 24  # op (length + 1 char), two varints of at most 10 bytes, the byte before them
_ZIGZAG_MASKS = tuple(
    (mask, mask << width, shift)
    for mask, width, shift in (
        (int.from_bytes(b"\x7f\x00" * 8, "little"), 8, 1),
        (int.from_bytes(b"\xff\x3f\x00\x00" * 4, "little"), 16, 2),
        (int.from_bytes(b"\xff\xff\xff\x0f\x00\x00\x00\x00" * 2, "little"), 32, 4),
    )
)
_LOW_56 = (1 << 56) - 1


def _tail_fast(value: bytes) -> tuple[DMLType, int] | None:
    """`_tail` without checksums when both varints and the op lie in the datum's last bytes, else None."""
    size = len(value)
    if size < _TAIL_WINDOW + 5:
        return None
    window = value[size - _TAIL_WINDOW :]
    flags = window.translate(_CONTINUES)
    if flags[-1] != 0x30:
        return None
    physical = flags.rfind(b"0", 0, _TAIL_WINDOW - 1) + 1  # where _tidb_commit_physical_time starts
    start = flags.rfind(b"0", 0, physical - 1) + 1 if physical > 1 else 0  # where _tidb_commit_ts starts
    if start < 2 or physical - start > 10 or _TAIL_WINDOW - physical > 10 or window[start - 2] != 2:
        return None  # over-long varints are named by `_tail_each`
    kind = OPS.get(chr(window[start - 1]))
    if kind is None:
        return None
    return kind, _zigzag_short(window[start:physical])


def _zigzag_short(encoded: bytes) -> int:
    """`_zigzag` of at most 10 bytes: the 7-bit groups packed by masks and shifts, not byte by byte."""
    packed = int.from_bytes(encoded, "little")
    for low, high, shift in _ZIGZAG_MASKS:
        packed = (packed & low) | ((packed & high) >> shift)
    packed = (packed & _LOW_56) | ((packed >> 64) << 56)
    return (packed >> 1) ^ -(packed & 1)


def _tail_each(value: bytes, checksum: bool) -> tuple[DMLType, int]:
    """`_tail`, byte by byte."""
    try:
        end = len(value)
        if checksum:
            end = _varint_start(value, end)  # _tidb_checksum_version
            end -= 1  # _tidb_corrupted
            digits = end
            while digits > 5 and 0x30 <= value[digits - 1] <= 0x39:
                digits -= 1
            if value[digits - 1] != 2 * (end - digits):
                raise ValueError("checksum length")
            end = digits - 1
        end = _varint_start(value, end)  # _tidb_commit_physical_time
        start = _varint_start(value, end)
        commit_ts = _zigzag(value[start:end])
        kind = OPS[chr(value[start - 1])]
        if value[start - 2] != 2:
            raise ValueError("op length")
    except (ValueError, KeyError, IndexError) as exc:
        raise MalformedMessageError(f"the TiDB extension fields do not end the datum ({exc})") from exc
    return kind, commit_ts


def _last_op(value: bytes) -> DMLType:
    """`_tidb_op` ends the datum when only `avro-include-before-value` appends it
    (docs/protocols/ticdc-avro.md §4.3): a string of one character."""
    kind = OPS.get(chr(value[-1])) if len(value) > 6 and value[-2] == 2 else None
    if kind is None:
        raise MalformedMessageError("the datum does not end with _tidb_op")
    return kind


def _varint_start(buffer: bytes, end: int) -> int:
    """Where the varint ending just before `end` starts (its last byte is the only one below 0x80)."""
    position = end - 1
    if position < 5 or buffer[position] & 0x80:
        raise ValueError("no varint")
    while position > 5 and buffer[position - 1] & 0x80:
        position -= 1
    if end - position > MAX_VARINT_BYTES:  # the value fastavro would read from it, but no Avro long
        raise MalformedMessageError(f"{overlong_reason(position)}, in the TiDB extension fields")
    return position


def _zigzag(encoded: bytes) -> int:
    result = 0
    for shift, byte in enumerate(encoded):
        result |= (byte & 0x7F) << (7 * shift)
    return (result >> 1) ^ -(result & 1)


# TiDB ActionType numbers of the watermark-mode DDL record (§7.1) as the SDK's DDL types.
_ACTIONS: dict[int, DDLType] = {
    3: DDLType.CREATE,
    4: DDLType.ERASE,
    7: DDLType.CINDEX,
    8: DDLType.DINDEX,
    11: DDLType.TRUNCATE,
    14: DDLType.RENAME,
    32: DDLType.CINDEX,
    **dict.fromkeys((5, 6, 12, 13, 15, 17, 18, 19, 20, 22, 23, 33, 41, 42, 61, 64, 71, 72), DDLType.ALTER),
}


class _DDLRecord(msgspec.Struct):
    query: str
    type: int
    schema: str
    table: str
    commitTs: int


_DDL_RECORD = msgspec.json.Decoder(_DDLRecord)


def _ddl(value: bytes) -> DDL:
    """A watermark-mode DDL. It names its table but not the columns (the next row's writer schema has them):
    its schema carries the names only, so it is a barrier for its own table alone, and a column change is an
    ALTER only in name (sinks alter nothing for a schema without columns: rows bring their columns)."""
    try:
        record = _DDL_RECORD.decode(value[1:])
    except JSON_ERRORS as exc:
        problem = json_problem(exc, value[1:])
        raise MalformedMessageError(f"invalid watermark-mode DDL record: {problem}") from exc
    kind = _ACTIONS.get(record.type, DDLType.QUERY) if record.table else DDLType.QUERY
    named = bool(record.table)
    return DDL(
        type=kind,
        sql=record.query,
        commit_ts=record.commitTs,
        build_ts=0,
        table_schema=_named(record.schema, record.table, record.commitTs) if named else None,
        database="" if named else record.schema,  # CREATE DATABASE names its database alone
    )


def _named(database: str, table: str, version: int) -> TableSchema:
    return TableSchema(database, table, stable_table_id(database, table), version)


@dataclass(frozen=True)
class TicdcAvroProtocol(Protocol):
    """TiCDC's Avro protocol: `ConfluentAvroDecoder` for records, `AvroRows` for a table version's rows,
    both reading writer schemas from `registry`."""

    name = "avro"
    registry: SchemaRegistry

    def record_decoder(self, settings: DecoderSettings) -> ConfluentAvroDecoder:
        return ConfluentAvroDecoder(self.registry, settings.policy)

    def table_rows(
        self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy
    ) -> TableRows:
        registry = self.registry
        return SelfDescribedRows(schema, columns, lambda: AvroRows(schema, columns, registry, policy))
