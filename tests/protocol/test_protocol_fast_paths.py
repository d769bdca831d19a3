"""The TiCDC Avro and Debezium decoders' fast paths give what the paths they shortcut give, which stay as the
fallback: the same message, or the same error, for valid records and for bytes made to look like them."""

from __future__ import annotations

import datetime as dt
import unittest.mock
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.errors import (
    ConsumerError,
    InternalDecodeError,
    MalformedMessageError,
    NestingTooDeepError,
    ValueDecodeError,
)
from consumer.protocol.avro_container import zigzag
from consumer.protocol.containment import contained, raise_contained
from consumer.protocol.debezium import rows as debezium_rows
from consumer.protocol.debezium.decoder import DEBEZIUM, DebeziumDecoder
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.debezium.rows import DebeziumRows
from consumer.protocol.limits import DecodeLimits
from consumer.protocol.model import DML, Column, DataType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.table import TableCodec
from consumer.protocol.ticdc_avro import decoder as avro_decoder
from consumer.protocol.ticdc_avro import rows as avro_rows
from consumer.protocol.ticdc_avro.decoder import ConfluentAvroDecoder, TicdcAvroProtocol
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.protocol.types import ValuePolicy, column_type
from consumer.testing.registry import LocalSchemaRegistry
from consumer.testing.strategies import (
    avro_changes,
    avro_options,
    avro_table_schemas,
    debezium_changes,
    debezium_table_schemas,
)

PROPERTY = settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _outcome(decode: Any, *args: Any) -> Any:
    """What a call gives: its result, or its error's type and message."""
    try:
        return decode(*args)
    except ConsumerError as exc:
        return type(exc), str(exc)


# -- TiCDC Avro: the extension fields read from a datum's end ---------------------------------------------
_OPS = st.sampled_from([b"\x02c", b"\x02u", b"\x02d", b"\x02x", b"\x04cc", b"\x00", b""])


@st.composite
def _tails(draw: st.DrawFn) -> bytes:
    """Datums ending like TiCDC's (any commit ts, including ones beyond a long or with a sign), or not."""
    head = b"\x00\x00\x00\x00\x07" + draw(st.binary(max_size=40))
    commit_ts = draw(st.integers(-(1 << 70), 1 << 70))
    physical = draw(st.integers(-(1 << 70), 1 << 70))
    varint = zigzag(commit_ts) if -(1 << 63) <= commit_ts < 1 << 63 else draw(st.binary(max_size=12))
    tail = draw(_OPS) + varint + (zigzag(physical) if -(1 << 63) <= physical < 1 << 63 else b"\x01")
    return draw(st.sampled_from([head + tail, head + tail[1:], tail, head + tail + b"\x80"]))


@PROPERTY
@given(value=st.one_of(_tails(), st.binary(max_size=64)))
def test_avro_tail_read_in_c_is_the_byte_by_byte_reading(value: bytes) -> None:
    fast = avro_decoder._tail_fast(value)
    slow = _outcome(avro_decoder._tail_each, value, False)
    if fast is not None:
        assert fast == slow
    assert _outcome(avro_decoder._tail, value, False) == slow


@PROPERTY
@given(encoded=st.binary(min_size=1, max_size=10))
def test_zigzag_of_up_to_ten_bytes_packed_at_once(encoded: bytes) -> None:
    assert avro_decoder._zigzag_short(encoded) == avro_decoder._zigzag(encoded)


@PROPERTY
@given(number=st.integers(-(1 << 63), (1 << 63) - 1))
def test_zigzag_of_a_long_round_trips(number: int) -> None:
    assert avro_decoder._zigzag_short(zigzag(number)) == number


class _UncachedAvroDecoder(ConfluentAvroDecoder):
    """Looks every record's frames up, as before the previous record's layout was kept."""

    def _row(self, key: bytes | None, value: bytes) -> Any:
        self._last = None
        return super()._row(key, value)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_avro_records_decode_the_same_with_the_previous_layout_kept(
    schema_registry: LocalSchemaRegistry, data: Any
) -> None:
    """Records of two tables (and two versions of one), interleaved, some mangled: the decoder that keeps
    the previous record's layout gives what looking each one up gives."""
    registry = SchemaRegistry(schema_registry.url)
    options = data.draw(avro_options())
    schemas = [data.draw(avro_table_schemas(max_columns=4)) for _ in range(2)]
    records: list[tuple[bytes | None, bytes | None]] = []
    for _ in range(8):
        change = data.draw(avro_changes(registry, options, data.draw(st.sampled_from(schemas))))
        key, value = change.key, change.value
        mangle = data.draw(st.sampled_from(["none", "none", "key", "value", "no-key"]))
        if mangle == "key" and key:
            key = key[:1] + bytes([key[1] ^ 1]) + key[2:]
        elif mangle == "value" and value:
            value = value[:-3]
        elif mangle == "no-key":
            key = None
        records.append((key, value))
    fast, slow = ConfluentAvroDecoder(registry), _UncachedAvroDecoder(registry)
    for key, value in records:
        assert _outcome(fast.decode_record, key, value) == _outcome(slow.decode_record, key, value)


# -- Debezium: values whose schema is matched by its bytes ----------------------------------------------
class _ScanningDebeziumDecoder(DebeziumDecoder):
    """Scans every value's schema as JSON, as before schemas were matched by their bytes, and decodes every
    DML through the general path."""

    def _split_known(self, value: bytes) -> Any:
        return None

    def _known_dml(self, key: bytes | None, value: bytes | None) -> Any:
        return None


def _mangled(value: bytes, how: str, noise: bytes) -> bytes:
    start = len(b'{"payload":')
    schema_at = value.rfind(b',"schema":')
    if schema_at < 0:
        return value + noise
    payload, rest = value[start:schema_at], value[schema_at:]
    return {
        "whitespace": b'{"payload": ' + payload + b" " + rest,
        "extra-field": b'{"payload":' + payload + b',"x":' + payload + rest,
        "two-payloads": b'{"payload":' + payload + b',"payload":' + payload + rest,
        "concatenated": b'{"payload":' + payload + payload + rest,
        "truncated": b'{"payload":' + payload[: len(payload) // 2] + rest,
        "noise": b'{"payload":' + payload[:-1] + noise + b"}" + rest,
        "schema-changed": b'{"payload":' + payload + rest[:-2] + b"}}",
    }.get(how, value)


@PROPERTY
@given(data=st.data())
def test_debezium_records_decode_the_same_with_the_schema_matched_by_bytes(data: Any) -> None:
    """Records of two tables, the same table's schema twice, and values and keys made to look like TiCDC's
    layout around a known schema: matching the schema by its bytes gives what scanning it gives."""
    options = data.draw(st.sampled_from([DebeziumOptions(tidb_extension=True), DebeziumOptions()]))
    schemas = [data.draw(debezium_table_schemas(max_columns=4)) for _ in range(2)]
    hows = ["none", "whitespace", "extra-field", "two-payloads", "concatenated", "truncated", "noise"]
    records: list[tuple[bytes | None, bytes]] = []
    for _ in range(10):
        change = data.draw(debezium_changes(options, data.draw(st.sampled_from(schemas))))
        assert change.value is not None
        how = data.draw(st.sampled_from([*hows, "schema-changed"]))
        noise = data.draw(st.sampled_from([b"", b"\xff", b'"', b"}", b",1", b' "a"']))
        key = change.key
        if key is not None and data.draw(st.booleans()):  # keys too: a known key schema
            key = _mangled(key, data.draw(st.sampled_from([*hows, "schema-changed"])), noise)
        records.append((key, _mangled(change.value, how, noise)))
    fast, slow = DebeziumDecoder(), _ScanningDebeziumDecoder()
    for key, value in records:
        assert _outcome(fast.decode_record, key, value) == _outcome(slow.decode_record, key, value)


def test_debezium_known_schemas_are_bounded_and_most_recent_first() -> None:
    decoder = DebeziumDecoder()
    for number in range(20):
        schema = b'{"n":%d}' % number
        decoder._remember_suffix(b'{"payload":{},"schema":' + schema + b"}", schema)
    assert len(decoder._suffixes) == 16 and decoder._suffixes[0][1] == b'{"n":19}'
    decoder._remember_suffix(b'{"payload":{},"schema":null}', b"null")  # nothing to match
    decoder._remember_suffix(b'{"schema":{"n":30},"payload":{}}', b'{"n":30}')  # not TiCDC's layout
    assert decoder._suffixes[0][1] == b'{"n":19}'


def test_debezium_a_known_schema_is_matched_for_every_op() -> None:
    """Not only the record that taught the schema: DML after DML, of every kind."""
    schema = TableSchema(
        "db", "t", 1, 1,
        columns=(Column("id", DataType("int"), nullable=False), Column("a", DataType("varchar"))),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )  # fmt: skip
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True))
    decoder = DebeziumDecoder()
    calls, built = [], []
    split, known = decoder._split_known, decoder._known_dml
    decoder._split_known = lambda value: calls.append(split(value)) or calls[-1]  # type: ignore[method-assign]
    decoder._known_dml = lambda key, value: built.append(known(key, value)) or built[-1]  # type: ignore[method-assign]
    for kind in DMLType:
        data = None if kind is DMLType.DELETE else {"id": 1, "a": "x"}
        old = None if kind is DMLType.INSERT else {"id": 1, "a": "y"}
        dml = DML(
            type=kind, database="db", table="t", table_id=1, commit_ts=449_811_223_446_634_498, build_ts=0,
            schema_version=1, data=data, old=old,
        )  # fmt: skip
        decoder.decode_record(*encoder.encode_dml(dml, schema))
    assert calls == [None]  # the first record's schema is scanned; the latest schema then needs no search
    assert len(built) == len(DMLType) - 1 and all(found is not None for found in built)  # built in one step


# -- containment ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (MalformedMessageError("bad"), MalformedMessageError),
        (KeyError("k"), InternalDecodeError),
        (RecursionError(), NestingTooDeepError),
        (KeyboardInterrupt(), KeyboardInterrupt),
        (BaseException("panic"), InternalDecodeError),
    ],
)
def test_raise_contained_raises_what_contained_raises(raised: BaseException, expected: type) -> None:
    outcomes = []
    for form in ("context", "function"):
        with pytest.raises(expected) as caught:
            if form == "context":
                with contained("testing"):
                    raise raised
            else:
                try:
                    raise raised
                except BaseException as exc:
                    raise_contained(exc, "testing")
        outcomes.append((type(caught.value), str(caught.value), caught.value.__cause__))
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == str(raised) or "testing" in outcomes[0][1]


# -- TiCDC Avro: columns ------------------------------------------------------------------------------
_JSON_TEXTS = st.one_of(
    st.none(),
    st.sampled_from(['{"a": [1, 2]}', "[]", "null", "1", "1,2", "[1", "", " ", '"x"', "{}{}", "1e400"]),
    st.recursive(st.just("1"), lambda inner: inner.map(lambda text: f"[{text}]"), max_leaves=140),
    st.text(max_size=8),
)


@PROPERTY
@given(values=st.lists(_JSON_TEXTS, max_size=6), depth=st.sampled_from([3, 128]))
def test_avro_json_column_checked_in_arrow_is_from_json(values: list[str | None], depth: int) -> None:
    policy = ValuePolicy(limits=DecodeLimits(max_nesting_depth=depth))
    column = column_type(Column("j", DataType("json")), policy)
    array = pa.array(values, pa.string())
    fast = _outcome(avro_rows._json_documents, column, array)
    slow = _outcome(column.from_json, values)
    if isinstance(slow, pa.Array):
        assert isinstance(fast, pa.Array) and fast.equals(slow)
    else:
        assert fast == slow


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_avro_batches_in_change_order_as_before(schema_registry: LocalSchemaRegistry, data: Any) -> None:
    """A batch of only value-schema rows skips the reordering: the images and their order are those of the
    general path (`_order` and `take`)."""
    registry = SchemaRegistry(schema_registry.url)
    options = data.draw(st.sampled_from([AvroOptions(tidb_extension=True), AvroOptions()]))
    schema = data.draw(avro_table_schemas(max_columns=4))
    kinds = data.draw(st.lists(st.sampled_from([DMLType.INSERT, DMLType.UPDATE]), min_size=1, max_size=5))
    changes = [data.draw(avro_changes(registry, options, schema, kind)) for kind in kinds]
    decoder = ConfluentAvroDecoder(registry)
    raws = [decoder.decode_record(change.key, change.value) for change in changes]
    codec = TableCodec(decoder.described_schema(raws[0].schema_key), protocol=TicdcAvroProtocol(registry))  # type: ignore[arg-type, union-attr]
    rows = avro_rows.AvroRows(codec.schema, codec.columns, registry, codec.policy)
    batch, source, kinds_out, key_only = rows.images(raws)
    value_rows = list(range(len(raws)))
    datums = rows._read(rows._values, raws, value_rows)
    part = rows._typed(datums, rows.layout.columns, value_rows)
    order, source_slow, kinds_slow, key_only_slow = rows._order(raws, value_rows, [], {"value": 0}, [])
    assert batch.equals(part.take(pa.array(order, pa.int64())))
    assert (source, kinds_out, key_only) == (source_slow, kinds_slow, key_only_slow)


@PROPERTY
@given(data=st.data())
def test_debezium_insert_batches_as_the_general_loop(data: Any) -> None:
    """A batch of INSERTs skips the per-record loop: the same images as when an UPDATE joins the batch (the
    loop), and a bad record is named the same way."""
    options = data.draw(st.sampled_from([DebeziumOptions(tidb_extension=True), DebeziumOptions()]))
    schema = data.draw(debezium_table_schemas(max_columns=4))
    inserts = [data.draw(debezium_changes(options, schema, DMLType.INSERT)) for _ in range(3)]
    update = data.draw(debezium_changes(options, schema, DMLType.UPDATE))
    decoder = DebeziumDecoder()
    raws = [decoder.decode_record(change.key, change.value) for change in [*inserts, update]]
    codec = TableCodec(decoder.described_schema(raws[0].schema_key), protocol=DEBEZIUM)  # type: ignore[arg-type, union-attr]
    rows = DebeziumRows(codec.schema, codec.columns, codec.policy)
    batch, source, kinds, key_only = rows.images(raws[:3])
    mixed, mixed_source, mixed_kinds, _ = rows.images(raws)
    assert batch.equals(mixed.slice(0, 3)) and (source, kinds) == (mixed_source[:3], mixed_kinds[:3])
    assert key_only == [False] * 3
    bad = data.draw(st.sampled_from([b"{}", b'{"after":null}', b'{"after":{"id":"x"}}', b"{"]))
    broken = [*raws[:2], msgspec.structs.replace(raws[2], payload=bad)]  # type: ignore[type-var]
    errors = []
    for batch_raws in (broken, [*broken, raws[3]]):
        with pytest.raises(ValueDecodeError) as caught:
            rows.images(batch_raws)
        errors.append((str(caught.value), caught.value.column, caught.value.row))
    assert errors[0] == errors[1] and errors[0][2] == 2


def _images_or_error(rows: DebeziumRows, raws: list[RawDML], whole: bool) -> Any:
    try:
        batch, source, kinds, key_only = rows._chunk(raws) if whole else rows.images(raws)
    except ValueDecodeError as exc:
        return str(exc), exc.column, exc.row
    return batch.to_pylist(), batch.schema, source, kinds, key_only


@PROPERTY
@given(data=st.data())
def test_debezium_batches_decoded_in_chunks_are_the_batch_decoded_at_once(data: Any) -> None:
    """A batch is decoded `_CHUNK_ROWS` at a time and joined: the same images as the whole batch at once, and
    with bad records in it the same error (the whole batch's first bad column's first bad row)."""
    options = data.draw(st.sampled_from([DebeziumOptions(tidb_extension=True), DebeziumOptions()]))
    schema = data.draw(debezium_table_schemas(max_columns=4))
    changes = [data.draw(debezium_changes(options, schema)) for _ in range(data.draw(st.integers(2, 7)))]
    decoder = DebeziumDecoder()
    raws: list[Any] = [decoder.decode_record(change.key, change.value) for change in changes]
    codec = TableCodec(decoder.described_schema(raws[0].schema_key), protocol=DEBEZIUM)  # type: ignore[arg-type]
    rows = DebeziumRows(codec.schema, codec.columns, codec.policy)
    bad = [b"{}", b'{"after":null,"before":null}', b'{"after":{"id":"x"}}', b"{", b'{"after":{"id":1e999}}']
    for _ in range(data.draw(st.integers(0, 2))):
        at = data.draw(st.integers(0, len(raws) - 1))
        raws[at] = msgspec.structs.replace(raws[at], payload=data.draw(st.sampled_from(bad)))
    whole = _images_or_error(rows, raws, whole=True)
    with unittest.mock.patch.object(debezium_rows, "_CHUNK_ROWS", data.draw(st.integers(1, 3))):
        assert _images_or_error(rows, raws, whole=False) == whole


# -- Debezium: TIMESTAMP columns read as text and parsed by Arrow ----------------------------------------
_STAMP_SCHEMA = TableSchema(
    "db", "stamps", 1, 1,
    columns=(
        Column("id", DataType("int"), nullable=False),
        Column("ts", DataType("timestamp", decimal=6)),
        Column("ts0", DataType("timestamp")),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)  # fmt: skip
_ODD_STAMPS = [
    "0000-01-01T00:00:00Z", "0001-01-01T00:00:00Z", "9999-12-31T23:59:59.999999Z", "2020-02-29T00:00:00Z",
    "2021-02-29T00:00:00Z", "2020-02-30T12:00:00Z", "2020-04-31T00:00:00Z", "2020-13-01T00:00:00Z",
    "2020-00-10T00:00:00Z", "2020-01-00T00:00:00Z", "2020-01-01T24:00:00Z", "2020-01-01T23:59:60Z",
    "2020-01-01T23:60:00Z", "2020-01-01T00:00:00.1234567Z", "2020-01-01T00:00:00.Z", "2020-01-01T00:00:00z",
    "2020-01-01t00:00:00Z", "2020-01-01 00:00:00Z", "2020-01-01T00:00:00+01:00", "2020-01-01T00:00:00-00:30",
    "2020-01-01T00:00:00", "2020-01-01T00:00Z", "+2020-01-01T00:00:00Z", "2020-1-01T00:00:00Z",
    "\uff12\uff10\uff12\uff10-01-01T00:00:00Z", "2020-01-01T00:00:00.5Z", "", "Z",
]  # fmt: skip


@st.composite
def _stamp_json(draw: st.DrawFn) -> bytes:
    """A TIMESTAMP's wire JSON: as TiCDC writes it (any fsp), made odd, escaped, or not a string at all."""
    instant = draw(st.datetimes(dt.datetime(1, 1, 1), dt.datetime(9999, 12, 31, 23, 59, 59, 999_999)))
    fsp = draw(st.integers(0, 6))
    text = instant.strftime("%Y-%m-%dT%H:%M:%S") + (f".{instant.microsecond:06d}"[: fsp + 1] if fsp else "")
    text = f"{instant.year:04d}" + text[text.index("-") :] + "Z"
    how = draw(st.sampled_from(["wire", "wire", "wire", "odd", "escaped", "edited", "other"]))
    if how == "odd":
        text = draw(st.sampled_from(_ODD_STAMPS))
    elif how == "edited":
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.text(max_size=2)) + text[at + draw(st.integers(0, 2)) :]
    if how == "other":
        return draw(st.sampled_from([b"null", b"0", b"1.5", b"true", b"[]", b'{"a":1}', b'"\\ud800"']))
    if how == "escaped":
        return b'"' + "".join(f"\\u{ord(c):04x}" for c in text).encode() + b'"'
    return msgspec.json.encode(text)


@PROPERTY
@given(data=st.data())
def test_debezium_timestamps_read_as_text_as_the_general_path(data: Any) -> None:
    """TIMESTAMP values read as text and parsed by Arrow behind a strict layout check give what msgspec's
    datetimes give: the same column, or (through the general path) the same error naming row and column."""
    kinds = [data.draw(st.sampled_from(["c", "u", "d"])) for _ in range(data.draw(st.integers(1, 4)))]
    raws = []
    for index, op in enumerate(kinds):
        image = b'{"id":%d,"ts":%s,"ts0":%s}' % (index, data.draw(_stamp_json()), data.draw(_stamp_json()))
        before, after = (b"null", image) if op == "c" else (image, b"null") if op == "d" else (image, image)
        raws.append(
            RawDML(
                type={"c": DMLType.INSERT, "u": DMLType.UPDATE, "d": DMLType.DELETE}[op],
                database="db",
                table="stamps",
                table_id=1,
                commit_ts=1,
                build_ts=0,
                schema_version=1,
                payload=b'{"before":%s,"after":%s}' % (before, after),
                encoding="debezium",
            )
        )
    columns = [column_type(c, ValuePolicy()) for c in _STAMP_SCHEMA.columns]
    fast, slow = (
        DebeziumRows(_STAMP_SCHEMA, columns, ValuePolicy()),
        DebeziumRows(_STAMP_SCHEMA, columns, ValuePolicy()),
    )
    slow._text_decoder = None
    expected = _outcome(slow.images, raws)
    assert _outcome(fast.images, raws) == expected
    if not isinstance(expected, tuple) or not isinstance(expected[0], pa.RecordBatch):
        return
    assert expected[0].schema == fast.image_schema


def test_debezium_timestamps_of_ticdc_are_read_as_text() -> None:
    """The layout TiCDC writes is settled by the text path, not handed to the general one."""
    columns = [column_type(c, ValuePolicy()) for c in _STAMP_SCHEMA.columns]
    rows = DebeziumRows(_STAMP_SCHEMA, columns, ValuePolicy())
    payload = b'{"after":{"id":1,"ts":"2020-10-03T13:38:32.5Z","ts0":"0001-01-01T00:00:00Z"}}'
    raw = RawDML(
        type=DMLType.INSERT, database="db", table="stamps", table_id=1, commit_ts=1, build_ts=0,
        schema_version=1, payload=payload, encoding="debezium",
    )  # fmt: skip
    general = rows._images
    rows._images = lambda raws, decoder, *, text: general(raws, decoder, text=text) if text else pytest.fail()  # type: ignore[method-assign]
    batch = rows.images([raw])[0]
    assert batch.column("ts").to_pylist() == [dt.datetime(2020, 10, 3, 13, 38, 32, 500_000, tzinfo=dt.UTC)]
    assert batch.column("ts0").to_pylist() == [dt.datetime(1, 1, 1, tzinfo=dt.UTC)]
