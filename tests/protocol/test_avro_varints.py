"""Known bug of issue 26: an Avro varint of more than 10 bytes (no Avro long has one) was read as data.
fastavro reads varints of any length (`ff` x11 `01` as -9223372036854775808, a value padded with `80` bytes
as itself), so a TiCDC Avro `id` written so landed in the changelog. Every Avro path refuses it: a row value
as `value-decode` naming its row, a header or routing field as `malformed-message`."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from consumer.errors import ConsumerError, MalformedMessageError, ValueDecodeError
from consumer.protocol.avro_container import zigzag
from consumer.protocol.avro_varints import _Walk, overlong_varint
from consumer.protocol.limits import tso_of
from consumer.protocol.model import DML, Column, DataType, DMLType, Index, RawDML, TableSchema, Watermark
from consumer.protocol.simple import avro_messages
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.ticdc_avro.decoder import ConfluentAvroDecoder, TicdcAvroProtocol
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.rows import _Reader
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.sources.record import SourceRecord
from consumer.testing.registry import LocalSchemaRegistry
from consumer.testing.strategies import avro_changes, table_messages

TS = tso_of(1_767_225_600)  # 2026-01-01
ISSUE_BYTES = b"\xff" * 11 + b"\x01"  # the 12-byte long of the issue: -2^63 to fastavro
SCHEMA = TableSchema(
    "shop", "t", 7, TS - 1,
    (Column("id", DataType("bigint", length=20), nullable=False), Column("n", DataType("int"))),
    (Index("primary", True, True, False, ("id",)),),
)  # fmt: skip


def _padded(value: int, size: int = 11) -> bytes:
    """`value`'s varint padded with zero groups to `size` bytes: the same value to fastavro."""
    short = zigzag(value)
    return short[:-1] + bytes([short[-1] | 0x80]) + b"\x80" * (size - len(short) - 1) + b"\x00"


def _dml(kind: DMLType = DMLType.INSERT, **image: Any) -> DML:
    data, old = (None, image) if kind is DMLType.DELETE else (image, None)
    return DML(
        type=kind, database="shop", table="t", table_id=7, commit_ts=TS, build_ts=1,
        schema_version=SCHEMA.version, data=data, old=old,
    )  # fmt: skip


def _replaced(payload: bytes, old: bytes, new: bytes) -> bytes:
    assert payload.count(old) == 1, (payload, old)
    return payload.replace(old, new)


# -- Simple protocol, Avro encoding ----------------------------------------------------------------------
def _outcome(value: bytes) -> Any:
    try:
        return MessageDecoder().decode(value)
    except ConsumerError as exc:
        return type(exc), exc.code, str(exc)


def test_a_simple_avro_watermark_field_over_10_bytes_is_malformed() -> None:
    """Read whole by fastavro: the padded commitTs decoded as if it were valid."""
    value = MessageEncoder("avro").encode(Watermark(commit_ts=TS, build_ts=1))
    bad = _replaced(value, zigzag(TS), _padded(TS))
    with pytest.raises(MalformedMessageError, match="varint at byte 4 is longer than 10 bytes") as caught:
        MessageDecoder().decode(bad)
    assert caught.value.code == "malformed-message"


@pytest.mark.parametrize("field", ["commitTs", "schemaVersion"])
def test_a_simple_avro_dml_header_field_over_10_bytes_is_malformed_read_alone_or_in_a_poll(
    field: str,
) -> None:
    """The header reader, field by field (`decode`) or a poll's headers at once (`decode_records`)."""
    encoder = MessageEncoder("avro")
    good = encoder.encode(_dml(id=1), SCHEMA)
    longs = [TS, 1, SCHEMA.version]  # commitTs, buildTs, schemaVersion
    padded = [_padded(n) if i == ("commitTs", "", "schemaVersion").index(field) else zigzag(n)
              for i, n in enumerate(longs)]  # fmt: skip
    bad = _replaced(good, b"".join(map(zigzag, longs)), b"".join(padded))
    alone = _outcome(bad)
    assert alone[:2] == (MalformedMessageError, "malformed-message")
    assert "longer than 10 bytes (no Avro long is), in the DML header" in alone[2]
    poll = MessageDecoder().decode_records(
        [SourceRecord("t", 0, n, value=v) for n, v in enumerate([good, bad])]
    )
    assert isinstance(poll[0], RawDML) and isinstance(poll[1], MalformedMessageError)
    assert str(poll[1]) == alone[2]


@pytest.mark.parametrize("varint", [ISSUE_BYTES, _padded(5)], ids=["issue", "padded"])
def test_a_simple_avro_row_value_over_10_bytes_is_a_value_error_naming_its_row(varint: bytes) -> None:
    """A chunk read columnar (polars-avro refuses it) falls back to fastavro per datum, which now checks."""
    encoder = MessageEncoder("avro")
    values = [encoder.encode(_dml(id=n, n=7), SCHEMA) for n in (4, 5, 6)]
    values[1] = _replaced(values[1], b"\x04id\x02" + zigzag(5), b"\x04id\x02" + varint)
    raws = [MessageDecoder().decode(value) for value in values]
    codec = TableCodec(SCHEMA)
    for decode in (codec.decode_batch, codec.decode_changes):
        with pytest.raises(ValueDecodeError, match="longer than 10 bytes") as caught:
            decode(raws)  # type: ignore[arg-type]
        assert (caught.value.code, caught.value.column, caught.value.row) == ("value-decode", "<row>", 1)
    with pytest.raises(ValueDecodeError, match="longer than 10 bytes"):
        codec.decode(raws[1])  # type: ignore[arg-type]
    assert codec.decode(raws[0]).data == {"id": 4, "n": 7}  # type: ignore[arg-type]


# -- TiCDC Avro ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def registry(schema_registry: LocalSchemaRegistry) -> SchemaRegistry:
    return SchemaRegistry(schema_registry.url)


def _ticdc(
    registry: SchemaRegistry, options: AvroOptions, dmls: list[DML]
) -> list[tuple[bytes | None, bytes | None]]:
    encoder = ConfluentAvroEncoder(registry, options)
    return [encoder.encode_dml(dml, SCHEMA, "varints") for dml in dmls]


def _rows(
    registry: SchemaRegistry, records: list[tuple[bytes | None, bytes | None]]
) -> tuple[TableCodec, list[Any]]:
    decoder = ConfluentAvroDecoder(registry)
    raws = [decoder.decode_record(key, value) for key, value in records]
    schema = decoder.described_schema(raws[0].schema_key)  # type: ignore[union-attr]
    assert schema is not None
    return TableCodec(schema, protocol=TicdcAvroProtocol(registry)), raws


@pytest.mark.parametrize("part", ["value", "key"])
def test_a_ticdc_avro_long_over_10_bytes_is_a_value_error_naming_its_row(
    registry: SchemaRegistry, part: str
) -> None:
    """The issue's record: `id` as `ff` x11 `01`. In a row's value (an INSERT), or in the key of a key-only
    DELETE (a tombstone); columnar (polars-avro refuses the chunk), then per datum (fastavro, now checked)."""
    kind = DMLType.INSERT if part == "value" else DMLType.DELETE
    records = _ticdc(registry, AvroOptions(), [_dml(kind, id=n, n=7) for n in (4, 5, 6)])
    key, value = records[1]
    framed = value if part == "value" else key
    assert framed is not None and framed[5:6] == zigzag(5)  # `id` is the datum's first field
    bad = framed[:5] + ISSUE_BYTES + framed[6:]
    records[1] = (key, bad) if part == "value" else (bad, None)
    codec, raws = _rows(registry, records)
    reader = _Reader(registry.schema(int.from_bytes(bad[1:5], "big")))
    assert reader.container.read([bad]) is None  # the native reader refuses it: the per-datum path decides
    for decode in (codec.decode_batch, codec.decode_changes):
        with pytest.raises(ValueDecodeError, match="varint at byte 5 is longer than 10 bytes") as caught:
            decode(raws)
        assert (caught.value.code, caught.value.row) == ("value-decode", 1)
    with pytest.raises(ValueDecodeError, match="longer than 10 bytes"):
        codec.decode(raws[1])


def test_a_ticdc_avro_commit_ts_over_10_bytes_is_malformed_when_routed(registry: SchemaRegistry) -> None:
    """`_tidb_commit_ts`, read backwards from the datum's end to route the row, padded to its same value."""
    ((key, value),) = _ticdc(registry, AvroOptions(tidb_extension=True), [_dml(id=1, n=2)])
    assert value is not None
    bad = _replaced(value, b"\x02c" + zigzag(TS), b"\x02c" + _padded(TS))
    with pytest.raises(MalformedMessageError, match=r"longer than 10 bytes .*TiDB extension") as caught:
        ConfluentAvroDecoder(registry).decode_record(key, bad)
    assert caught.value.code == "malformed-message"


# -- the check itself ----------------------------------------------------------------------------------
def test_only_datums_with_a_run_of_10_high_bytes_are_walked_and_valid_ones_pass() -> None:
    """Text of non-Latin scripts has such runs: a valid datum holding one passes the walk."""
    value = avro_messages.encode(_dml(), {"id": ("long", 1), "n": ("string", "数据库表" * 4)})
    start = len(avro_messages.DML_PREFIX)
    assert overlong_varint(value, start, avro_messages._DML_SCHEMA, avro_messages._NAMED) is None
    assert avro_messages.read_dml(value)["data"]["n"] == "数据库表" * 4
    assert overlong_varint(_padded(1), 0, "long", {}) == 0
    assert overlong_varint(_padded(1, size=10), 0, "long", {}) is None  # 10 bytes: a long may take them


class _Recording(_Walk):
    """The walk, noting where each varint starts."""

    def __init__(self, payload: bytes, position: int, named: Any) -> None:
        super().__init__(payload, position, named)
        self.starts: list[int] = []

    def long(self) -> int:
        self.starts.append(self.position)
        return super().long()


def _walked(payload: bytes, start: int, schema: Any, named: Any) -> list[int]:
    """The varints' starts of a valid datum, whose walk must end exactly where the datum does."""
    walk = _Recording(payload, start, named)
    walk.skip(schema)
    assert walk.position == len(payload)
    return walk.starts


def _pad_at(payload: bytes, start: int) -> bytes:
    end = start
    while payload[end] & 0x80:
        end += 1
    padded = bytes(payload[start : end + 1])
    padded = padded[:-1] + bytes([padded[-1] | 0x80]) + b"\x80" * (10 - len(padded)) + b"\x00"
    return payload[:start] + padded + payload[end + 1 :]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_varint_of_a_simple_avro_message_padded_is_found(data: Any) -> None:
    """The walk goes through a valid message (every message type, every column type) exactly as fastavro
    does; any one of its varints padded to 11 bytes, the same value to fastavro, is found where it starts."""
    message, schema = data.draw(table_messages(max_columns=4))
    value = MessageEncoder("avro").encode(message, schema)
    starts = _walked(value, 0, avro_messages._SCHEMA, avro_messages._NAMED)
    assert overlong_varint(value, 0, avro_messages._SCHEMA, avro_messages._NAMED) is None
    start = data.draw(st.sampled_from(starts))
    padded = _pad_at(value, start)
    assert overlong_varint(padded, 0, avro_messages._SCHEMA, avro_messages._NAMED) == start
    with pytest.raises(MalformedMessageError, match=f"varint at byte {start} is longer than 10 bytes"):
        avro_messages.read_datum(padded)  # the whole message, rows too, as the per-datum path reads it


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_varint_of_a_ticdc_avro_datum_padded_is_found(registry: SchemaRegistry, data: Any) -> None:
    """As for the Simple protocol, for TiCDC's datums of every option (before images, extension fields)."""
    change = data.draw(avro_changes(registry))
    framed = change.value if change.value is not None and change.value[:1] == b"\x00" else change.key
    assume(framed is not None)
    reader = _Reader(registry.schema(int.from_bytes(framed[1:5], "big")))
    starts = _walked(framed, 5, reader.parsed, reader.named)
    assume(starts)
    start = data.draw(st.sampled_from(starts))
    assert overlong_varint(_pad_at(framed, start), 5, reader.parsed, reader.named) == start
