"""Simple-protocol Avro's fast paths give exactly what the general paths give, which stay as their fallbacks:
rows read columnar (`simple.avro_rows`) the same change images and row images as the per-datum fastavro path,
or the same error naming the same row and column; a DML header whose routing bytes were seen before the same
`RawDML` (or error) as one read field by field. For valid DMLs of every column type and bytes mangled from
them."""

from __future__ import annotations

import contextlib
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.errors import (
    ConsumerError,
    InternalDecodeError,
    MalformedMessageError,
    SchemaRegistryError,
    ValueDecodeError,
)
from consumer.protocol.checks import MessageChecks
from consumer.protocol.containment import decoded_each
from consumer.protocol.model import DML, Column, DataType, DMLType, RawDML, TableSchema
from consumer.protocol.simple import avro_messages
from consumer.protocol.simple import avro_rows as simple_avro_rows
from consumer.protocol.simple.avro_messages import _HeaderReader
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.sources.record import SourceRecord
from consumer.testing.strategies import BUILD_TS, TSO, dml_messages, table_schemas

PROPERTY = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _outcome(decode: Any, *args: Any) -> Any:
    try:
        result = decode(*args)
    except ConsumerError as exc:
        row = exc.row if isinstance(exc, ValueDecodeError) else None
        column = exc.column if isinstance(exc, ValueDecodeError) else None
        assert " at 0x" not in str(exc)  # the same bytes give the same reason
        return type(exc), str(exc), row, column
    if hasattr(result, "rows"):
        return result.rows, result.source, result.kinds, result.checksums
    return result.data, result.old, result.has_data, result.has_old


def _both(codec: TableCodec, method: str, raws: list[RawDML], monkeypatch: pytest.MonkeyPatch) -> Any:
    fast = _outcome(getattr(codec, method), raws)
    with monkeypatch.context() as patched:
        patched.setattr(simple_avro_rows, "read", lambda columns, raws: None)
        slow = _outcome(getattr(codec, method), raws)
    return fast, slow


def _equal(fast: Any, slow: Any) -> bool:
    if len(fast) == 4 and hasattr(fast[0], "equals") and hasattr(slow[0], "equals"):
        return bool(fast[0].equals(slow[0]) and fast[1:] == slow[1:])
    return bool(fast == slow)


@st.composite
def _mangled(draw: st.DrawFn, payload: bytes) -> bytes:
    """The payload, or bytes made from it: flipped, cut short, lengthened, a value's union branch changed."""
    how = draw(st.sampled_from(["same", "same", "flip", "cut", "append", "splice"]))
    if how == "same" or len(payload) < 4:
        return payload
    at = draw(st.integers(3, len(payload) - 1))
    if how == "flip":
        return payload[:at] + bytes([draw(st.integers(0, 255))]) + payload[at + 1 :]
    if how == "cut":
        return payload[:at]
    if how == "append":
        return payload + draw(st.binary(min_size=1, max_size=4))
    return payload[:at] + draw(st.binary(max_size=6)) + payload[at:]


def _strict_avro(payload: bytes) -> bool:
    """Whether the payload is exactly one DML datum of strict Avro: every union index in range, which neither
    fastavro (Python's negative indexing) nor polars-avro checks."""
    position = 0
    named = {schema["name"]: schema for schema in avro_messages.writer_schema_json()}

    def long() -> int:
        nonlocal position
        shift = raw = 0
        while True:
            byte = payload[position]
            position += 1
            raw |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return (raw >> 1) ^ -(raw & 1)

    def skip(schema: Any) -> None:
        nonlocal position
        if isinstance(schema, list):
            index = long()
            if not 0 <= index < len(schema):
                raise ValueError(index)
            return skip(schema[index])
        schema = named.get(schema, schema) if isinstance(schema, str) else schema
        kind = schema if isinstance(schema, str) else schema["type"]
        if kind in ("int", "long", "enum"):
            long()
        elif kind in ("string", "bytes"):
            size = long()
            position += size
        elif kind in ("float", "double", "boolean", "fixed"):
            position += {"float": 4, "double": 8, "boolean": 1}.get(kind) or schema["size"]
        elif kind == "record":
            for field in schema["fields"]:
                skip(field["type"])
        elif kind == "map":
            while (count := long()) != 0:
                if count < 0:
                    count, _ = -count, long()
                for _ in range(count):
                    skip("string")
                    skip(schema["values"])
        elif kind != "null":
            raise ValueError(kind)
        if position > len(payload):
            raise ValueError("short")
        return None

    try:
        skip(simple_avro_rows._reader_schema())
    except (ValueError, IndexError):
        return False
    return position == len(payload)


@PROPERTY
@given(data=st.data())
def test_columnar_rows_decode_as_the_per_datum_path(data: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    schema = data.draw(table_schemas(max_columns=6))
    tz = data.draw(st.sampled_from(["UTC", "Asia/Shanghai", "America/New_York"]))
    policy = ValuePolicy(timestamp_location=tz)
    encoder = MessageEncoder("avro", policy=policy, variant=data.draw(st.sampled_from(["ticdc", "tiflow"])))
    messages = data.draw(st.lists(dml_messages(schema), min_size=1, max_size=6))
    mangle = data.draw(st.booleans())
    raws = []
    for message in messages:
        payload = encoder.encode(message, schema)
        if mangle:
            payload = data.draw(_mangled(payload))
        with contextlib.suppress(MalformedMessageError):  # dead-lettered before any table codec sees it
            header = avro_messages.decode(payload)
            if isinstance(header, RawDML):
                raws.append(header)
    if not raws:
        return
    assert mangle or all(_strict_avro(raw.payload) for raw in raws)  # what TiCDC writes is strict
    codec = TableCodec(schema, policy)
    for method in ("decode_changes", "decode_batch"):
        fast, slow = _both(codec, method, raws, monkeypatch)
        # Known limit: a negative union index (invalid Avro) is read by each reader by its own rule
        assert _equal(fast, slow) or not all(_strict_avro(raw.payload) for raw in raws), (method, fast, slow)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_valid_rows_are_read_columnar(data: Any) -> None:
    """The fast path is taken (not only fallen back from) for valid rows."""
    schema = data.draw(table_schemas(max_columns=6))
    message = data.draw(dml_messages(schema))
    raw = avro_messages.decode(MessageEncoder("avro").encode(message, schema))
    assert isinstance(raw, RawDML)
    assert simple_avro_rows.read(TableCodec(schema).columns, [raw.payload, raw.payload]) is not None


def _varint_each(buffer: bytes) -> Any:
    """The byte-by-byte reading the packed one replaced."""
    result = shift = position = 0
    while True:
        if shift > 63:
            return "Avro varint at byte 0 is longer than 10 bytes (no Avro long is), in the DML header"
        if position >= len(buffer):
            return "truncated or corrupt Avro DML header"
        byte = buffer[position]
        position += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            if result >> 64:
                return "Avro long beyond 64 bits in the DML header"
            return (result >> 1) ^ -(result & 1), position


@settings(max_examples=500)
@given(
    st.binary(max_size=13) | st.lists(st.sampled_from([0x80, 0xFF, 0x7F, 0x01, 0x00]), max_size=12).map(bytes)
)
def test_header_varint_packed_is_the_byte_by_byte_reading(buffer: bytes) -> None:
    reader = _HeaderReader(buffer, 0)
    try:
        got: Any = (reader.long(), reader.position)
    except MalformedMessageError as exc:
        got = exc.reason
    assert got == _varint_each(buffer)


def _header(payload: bytes) -> Any:
    try:
        return avro_messages.decode(payload)
    except ConsumerError as exc:
        return type(exc), str(exc)


@st.composite
def _key_only(draw: st.DrawFn, message: Any) -> Any:
    """The message, or its key-only form (claim-check location and/or handle-key-only flag)."""
    how = draw(st.sampled_from(["full", "full", "claim-check", "handle-key-only"]))
    if how == "claim-check":
        return msgspec.structs.replace(message, claim_check_location=draw(st.text(max_size=20)))
    if how == "handle-key-only":
        return msgspec.structs.replace(message, handle_key_only=True)
    return message


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_header_of_known_routing_bytes_reads_as_the_full_header(data: Any) -> None:
    schema = data.draw(table_schemas(max_columns=3))
    encoder = MessageEncoder("avro")
    first = data.draw(dml_messages(schema))
    message = data.draw(_key_only(msgspec.structs.replace(first, commit_ts=data.draw(TSO))))
    payload = data.draw(_mangled(encoder.encode(message, schema)))
    avro_messages._ROUTES = avro_messages._Routes()
    known = avro_messages.decode(encoder.encode(first, schema))  # its routing bytes are known from here on
    assert isinstance(known, RawDML)
    fast = _header(payload)
    avro_messages._ROUTES = avro_messages._Routes()
    assert fast == _header(payload)


def _varint_bytes(raw: int) -> bytes:
    out = bytearray()
    while raw >= 0x80:
        out.append(raw & 0x7F | 0x80)
        raw >>= 7
    return bytes([*out, raw])


def _decoded(decoder: MessageDecoder, value: bytes | None) -> Any:
    try:
        return decoder.decode(value)
    except ConsumerError as exc:
        return exc


def _same_outcome(got: Any, expected: Any) -> bool:
    if isinstance(expected, ConsumerError):  # a reason that names the clock's TSO, which moves
        return type(got) is type(expected) and _no_tso(got) == _no_tso(expected)
    return bool(got == expected)


def _no_tso(error: Any) -> str:
    return re.sub(r"TSO \d+", "TSO", str(error))


def _polled(values: list[bytes | None]) -> list[SourceRecord]:
    return [SourceRecord("t", 0, offset, value=value) for offset, value in enumerate(values)]


_NOW_TSO = 449_811_223_446_634_498
_OTHER_VALUES = st.none() | st.binary(max_size=40) | st.just(b'{"type":"WATERMARK"}')


@settings(max_examples=80, deadline=None)
@given(data=st.data(), encoding=st.sampled_from(["auto", "avro"]))
def test_a_polls_headers_read_at_once_are_each_records_own(data: Any, encoding: Any) -> None:
    """`decode_records` reads the headers of a poll's Avro DMLs of known routes as columns: every record gets
    what `decode` gives it alone (message or error), for DMLs of every commitTs, buildTs and version size,
    key-only ones, mangled ones and values that are no Avro DML at all; and the ordinary DMLs are read by the
    columnar path (not left to the fallback)."""
    schema = data.draw(table_schemas(max_columns=2))
    encoder = MessageEncoder("avro")
    first = data.draw(dml_messages(schema))
    avro_messages._ROUTES = avro_messages._Routes()
    assert isinstance(avro_messages.decode(encoder.encode(first, schema)), RawDML)  # its route is known now
    ordinary = msgspec.structs.replace(first, commit_ts=_NOW_TSO, build_ts=0, schema_version=_NOW_TSO)
    values: list[bytes | None] = [encoder.encode(ordinary, schema)]
    small = st.integers(-3, 3)
    longs = st.tuples(TSO | small, BUILD_TS | st.integers(-(1 << 62), 3), TSO | small)
    for commit_ts, build_ts, version in data.draw(st.lists(longs, min_size=20, max_size=60)):
        message = msgspec.structs.replace(first, commit_ts=commit_ts, build_ts=build_ts)
        message = msgspec.structs.replace(message, schema_version=version)
        how = data.draw(st.sampled_from(["plain", "plain", "plain", "odd", "other"]))
        if how == "plain":
            values.append(encoder.encode(message, schema))
        elif how == "odd":
            values.append(data.draw(_mangled(encoder.encode(data.draw(_key_only(message)), schema))))
        else:
            values.append(data.draw(_OTHER_VALUES))
    decoder = MessageDecoder(encoding)
    got = decoder.decode_records(_polled(values))
    expected = [_decoded(decoder, value) for value in values]
    assert all(_same_outcome(g, e) for g, e in zip(got, expected, strict=True)), (got, expected)
    known = avro_messages.known_headers(values, decoder._checks)
    assert known[0] == expected[0]  # an ordinary DML: read at once, not by the fallback


def test_headers_read_at_once_in_a_poll_of_thousands_and_mixed_layouts() -> None:
    """More headers than one matrix holds, their longs in four layouts (buildTs 0 or a TSO, commitTs of 3 or 9
    bytes): each is read at once, as `decode` reads it alone. Beyond the layouts tried, the rest are read
    one by one, to the same messages."""
    values: list[bytes | None] = [
        _one_column(n, commit_ts=(_NOW_TSO if n % 2 else 20_000) + n, build_ts=0 if n % 3 else _NOW_TSO)
        for n in range(9000)
    ]
    decoder = MessageDecoder("avro")
    expected = [decoder.decode(value) for value in values]
    assert avro_messages.known_headers(values, decoder._checks) == expected
    assert decoder.decode_records(_polled(values)) == expected
    odd_first = [_one_column(0, build_ts=1 << 62), _one_column(1, claim_check_location="s3://b/k"), *values]
    known = avro_messages.known_headers(
        odd_first, decoder._checks
    )  # a 10-byte long, a claim-check: by decode
    assert known == [None, None, *expected]
    many = [_one_column(n, commit_ts=1 << (7 * (n % 9)), build_ts=1 << (7 * (n % 7))) for n in range(300)]
    expected = [decoder.decode(value) for value in many]
    known = avro_messages.known_headers(many, decoder._checks)
    assert all(k is None or k == e for k, e in zip(known, expected, strict=True))
    assert sum(k is not None for k in known) >= avro_messages._LAYOUTS_TRIED * 300 // 63
    assert decoder.decode_records(_polled(many)) == expected


def test_a_poll_whose_first_value_is_no_bytes_is_still_each_records_own() -> None:
    """A poll long enough to be read at once, led by a value that is not bytes (a source gone wrong): that
    record gets `decode`'s contained error, the rest their messages."""
    good = [_one_column(n) for n in range(20)]
    records = [SourceRecord("t", 0, 0, value=5), *_polled(good)]  # type: ignore[arg-type]
    decoder = MessageDecoder()
    out = decoder.decode_records(records)
    assert isinstance(out[0], InternalDecodeError)
    assert out[1:] == [decoder.decode(value) for value in good]


def test_a_dependency_error_stops_the_poll_and_a_records_error_is_its_own() -> None:
    """`decoded_each`: a record's error is returned in its place, the rest still decode; a dependency's error
    (no record's fault) is raised."""
    good = _one_column(1)

    def decode(key: bytes | None, value: bytes | None) -> Any:
        if value == b"registry":
            raise SchemaRegistryError("the registry is down")
        return MessageDecoder("avro").decode(value)

    out = decoded_each(decode, _polled([good, b"\x16\x00", good]))
    assert out[0] == out[2] == MessageDecoder("avro").decode(good)
    assert isinstance(out[1], MalformedMessageError)
    with pytest.raises(SchemaRegistryError):
        decoded_each(decode, _polled([good, b"registry"]))


@settings(max_examples=400, deadline=None)
@given(
    raw=st.integers(0, (1 << 64) - 1) | st.integers(1 << 64, (1 << 70) - 1) | st.integers(0, 1 << 22),
    known_high=st.booleans(),
)
def test_every_commit_ts_varint_reads_through_remembered_high_groups_as_in_full(
    raw: int, known_high: bool
) -> None:
    """The known header's commitTs: its high groups remembered by their bytes, its low three computed; for
    every varint of up to 10 bytes (negative longs, short ones, beyond 64 bits) what the field-by-field
    reading gives, or its error."""
    valid = _one_column(0)
    assert isinstance(avro_messages.decode(valid), RawDML)  # its routing bytes are known from here on
    header = _HeaderReader(valid, 3)
    header.long(), header.string(), header.string(), header.long(), header.long()  # version ... type
    at = header.position
    header.long()  # commitTs
    payload = valid[:at] + _varint_bytes(raw) + valid[header.position :]
    if known_high:  # a commitTs with the same high groups was read before
        with contextlib.suppress(ConsumerError):
            avro_messages.decode(valid[:at] + _varint_bytes(raw ^ 2) + valid[header.position :])
    fast = _header(payload)
    avro_messages._ROUTES = avro_messages._Routes()
    avro_messages._HIGH_GROUPS.clear()
    slow = _header(payload)
    if isinstance(slow, tuple):  # an implausible commitTs: the reason names the clock's TSO, which moves
        fast, slow = (re.sub(r"TSO \d+", "TSO", str(outcome)) for outcome in (fast, slow))
    assert fast == slow


@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_known_routing_bytes_are_recognised_and_bounded(data: Any) -> None:
    schema = data.draw(table_schemas(max_columns=2))
    message = data.draw(dml_messages(schema))
    encoder = MessageEncoder("avro")
    avro_messages._ROUTES = avro_messages._Routes()
    avro_messages.decode(encoder.encode(message, schema))
    later = msgspec.structs.replace(message, commit_ts=message.commit_ts // 2 + 1)
    assert avro_messages.known_header(encoder.encode(later, schema), MessageChecks()) == avro_messages.decode(
        encoder.encode(later, schema)
    )
    for table in range(
        avro_messages._MAX_REMEMBERED + 10
    ):  # a stream of ever new tables: the memory stays bounded
        avro_messages.decode(encoder.encode(msgspec.structs.replace(message, table=f"t{table}"), schema))
    assert 0 < len(avro_messages._ROUTES) <= avro_messages._MAX_REMEMBERED


ONE_COLUMN = TableSchema("d", "t", 1, 7, (Column("id", DataType("int", length=11)),))


def _one_column(n: int, **changes: Any) -> bytes:
    """The Avro value of an INSERT of row `n` into `ONE_COLUMN`, with `changes` to the message."""
    insert = DML(
        type=DMLType.INSERT,
        database="d",
        table="t",
        table_id=1,
        commit_ts=5 + n,
        build_ts=1,
        schema_version=7,
        data={"id": n},
    )
    return MessageEncoder("avro").encode(msgspec.structs.replace(insert, **changes), ONE_COLUMN)


def test_routing_bytes_of_many_lengths_read_right_from_many_threads() -> None:
    """Claim-check threads decode at once: tables whose names give ever new prefix lengths (past the bound
    on lengths) and known ones, decoded from 4 threads, each as the full header read says."""
    payloads = [_one_column(n, table="t" * (1 + n % 40)) for n in range(400)]
    avro_messages._ROUTES = avro_messages._Routes()
    expected = [avro_messages.decode(p) for p in payloads]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            avro_messages._ROUTES = avro_messages._Routes()
            assert list(pool.map(avro_messages.decode, payloads)) == expected
    assert len(avro_messages._ROUTES.lengths) <= avro_messages._MAX_LENGTHS


def test_a_column_whose_values_come_from_two_union_branches_reads_as_per_datum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hostile input: one row's `id` a long, another's a string (written as if the column were VARCHAR). The
    chunk is still read columnar, and gives the per-datum path's error, naming that row."""
    as_text = TableSchema("d", "t", 1, 7, (Column("id", DataType("varchar", length=10)),))
    text_id = DML(
        type=DMLType.INSERT,
        database="d",
        table="t",
        table_id=1,
        commit_ts=9,
        build_ts=1,
        schema_version=7,
        data={"id": "12"},
    )
    payloads = [_one_column(1), MessageEncoder("avro").encode(text_id, as_text), _one_column(3)]
    raws = [avro_messages.decode(p) for p in payloads]
    codec = TableCodec(ONE_COLUMN)
    assert simple_avro_rows.read(codec.columns, payloads) is not None
    fast, slow = _both(codec, "decode_batch", raws, monkeypatch)
    assert _equal(fast, slow), (fast, slow)
    assert fast[0] is ValueDecodeError and fast[2:] == (1, "id"), fast


def test_a_chunk_whose_maps_hold_no_value_reads_as_nulls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every column absent from every image (a union with no entry at all): NULLs, as fastavro's gives."""
    raws = [
        avro_messages.decode(
            _one_column(
                0,
                type=kind,
                data=None if kind is DMLType.DELETE else {},
                old=None if kind is DMLType.INSERT else {},
            )
        )
        for kind in DMLType
    ]
    codec = TableCodec(ONE_COLUMN)
    for method in ("decode_changes", "decode_batch"):
        fast, slow = _both(codec, method, raws, monkeypatch)
        assert _equal(fast, slow), (method, fast, slow)
    assert codec.decode_batch(raws).data.column("id").to_pylist() == [None, None, None]


def test_long_routing_bytes_are_read_each_time_and_any_bytes_like_value_decodes() -> None:
    """A 600-character table name (DMLs carry no schema to refuse it) is not remembered: a hostile stream
    of long names cannot fill memory. A bytearray value decodes as its bytes do."""
    payload = _one_column(1, table="t" * 600)
    avro_messages._ROUTES = avro_messages._Routes()
    first = avro_messages.decode(payload)
    assert isinstance(first, RawDML) and first.table == "t" * 600
    assert len(avro_messages._ROUTES) == 0
    assert avro_messages.decode(bytearray(payload)) == first
    short = _one_column(1)
    assert (
        avro_messages.decode(bytearray(short))
        == avro_messages.decode(bytearray(short))
        == avro_messages.decode(short)
    )


def test_a_sliced_chunk_is_refused_rather_than_mapped_from_the_wrong_entries() -> None:
    batch = simple_avro_rows._CONTAINER.read([_one_column(n, commit_ts=5) for n in range(3)])
    assert batch is not None
    columns = TableCodec(ONE_COLUMN).columns
    assert simple_avro_rows.AvroChunk(columns, batch).typed([0, 1, 2])[0].to_pylist() == [0, 1, 2]
    with pytest.raises(ValueError, match="slice"):
        simple_avro_rows.AvroChunk(columns, batch.slice(1))
