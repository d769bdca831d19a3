"""One bad record never stops the consumer (issue 10): every failure observed in the issue, reproduced at the
codec and state level, now a `ConsumerError` with a reason code; the limits, schema validation and the
unknown-type policy."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import cramjam
import lz4.frame
import msgspec
import pyarrow as pa
import pytest
from cachetools import LRUCache
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer import errors
from consumer.batches.changes import stored_name
from consumer.errors import (
    CompressionBombError,
    ConsumerError,
    DeadLetter,
    DocumentTooDeepError,
    ImplausibleTimestampError,
    NestingTooDeepError,
    RecordLocation,
    SchemaRejectedError,
    ValueDecodeError,
    ValueTooLargeError,
)
from consumer.protocol import validation
from consumer.protocol.compression import decompress
from consumer.protocol.limits import DecodeLimits, nesting_depth, tso_of
from consumer.protocol.model import DML, Bootstrap, Column, DataType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.simple import avro_messages
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.protocol.validation import validate_schema
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.state import ConsumerState
from consumer.testing.hostile import hostile_schemas

TS = tso_of(1_767_225_600)  # 2026-01-01
TEXT = DataType("varchar", "utf8mb4", "utf8mb4_bin", length=64)
SCHEMA = TableSchema(
    "shop",
    "t",
    7,
    TS - 1,
    (
        Column("id", DataType("int", length=11), nullable=False),
        Column("name", TEXT),
        Column("amount", DataType("decimal", length=50, decimal=10)),
        Column("ts", DataType("timestamp", length=19)),
        Column("doc", DataType("json", length=4294967295)),
    ),
    (Index("primary", True, True, False, ("id",)),),
)


def json_dml(data: dict, *, commit_ts: int = TS, schema: TableSchema = SCHEMA) -> bytes:
    return json.dumps(
        {
            "version": 1,
            "database": schema.database,
            "table": schema.table,
            "tableID": schema.table_id,
            "type": "INSERT",
            "commitTs": commit_ts,
            "buildTs": 1,
            "schemaVersion": schema.version,
            "data": data,
        }
    ).encode()


def insert_header(**fields: Any) -> DML:
    """An INSERT of `shop.t` without values (they are given as wire values)."""
    header = {
        "database": "shop",
        "table": "t",
        "table_id": 7,
        "commit_ts": TS,
        "schema_version": SCHEMA.version,
    }
    return DML(type=DMLType.INSERT, build_ts=1, **{**header, **fields})


def bootstrap(schema: TableSchema, encoding: str = "json") -> bytes:
    return MessageEncoder(encoding).encode(Bootstrap(table_schema=schema, build_ts=1))  # type: ignore[arg-type]


def with_column(*columns: Column, version: int = TS - 2) -> TableSchema:
    return msgspec.structs.replace(
        SCHEMA, table="bad", version=version, columns=(SCHEMA.columns[0], *columns)
    )


def rows_of(value: bytes, codec: TableCodec | None = None) -> DML:
    raw = MessageDecoder().decode(value)
    assert isinstance(raw, RawDML)
    return (codec or TableCodec(SCHEMA)).decode(raw)


# -- the observed failures, one by one ----------------------------------------------------------
def test_a_decimal_scale_of_2_to_the_31_is_refused_before_pyarrow_sees_it() -> None:
    """It segfaulted pyarrow (rc 139) on the table's first row: run in a child so a crash fails the test."""
    script = """
import json
from consumer.errors import SchemaRejectedError
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.table import TableCodec
from consumer.protocol.model import TableSchema, Column, DataType
for scale in (2147483647, 2147483648):
    bootstrap = {"version": 1, "type": "BOOTSTRAP", "commitTs": 0, "buildTs": 1, "tableSchema": {
        "schema": "d", "table": "t", "tableID": 1, "version": 5, "columns": [
        {"name": "x", "dataType": {"mysqlType": "decimal", "charset": "binary", "collate": "binary",
          "length": 12, "decimal": scale}, "nullable": True, "default": None}], "indexes": []}}
    try:
        MessageDecoder().decode(json.dumps(bootstrap).encode())
    except SchemaRejectedError as exc:
        print(exc.code, exc.keys)
    try:
        TableCodec(TableSchema("d", "t", 1, 5, (Column("x", DataType("decimal", length=12, decimal=scale)),)))
    except SchemaRejectedError as exc:
        print(exc.code)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[:4] == [
        "schema-rejected (('d', 't', 5),)",
        "schema-rejected",
        "schema-rejected (('d', 't', 5),)",
        "schema-rejected",
    ]


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (
            json_dml({"id": "1"}).replace(b'"shop"', b'"sh\xffop"'),
            errors.MalformedMessageError,
            r"^invalid JSON message: invalid UTF-8 at byte 30 \(0xff\), in `database`$",
        ),
        (  # deeper than the interpreter recurses (Python 3.13's C limit: between 5,000 and 20,000)
            json_dml({"id": "1"})[:-1] + b',"x":' + b"[" * 20_000 + b"]" * 20_000 + b"}",
            NestingTooDeepError,
            "nest",
        ),
        (
            b'{"version":1,"type":"WATERMARK","commitTs":5,"buildTs":1,"x":'
            + b"[" * 1000
            + b"]" * 1000
            + b"}",
            NestingTooDeepError,
            "nest",
        ),
        (
            b'{"version":1,"type":"WATERMARK","commitTs":%d,"buildTs":1,"x":' % TS
            + b"[" * 200
            + b"]" * 200
            + b"}",
            NestingTooDeepError,
            "201 deep, beyond max_nesting_depth = 128",  # the message's own object is one level
        ),
        (json_dml({"id": "1"}, commit_ts=2**64 - 1), ImplausibleTimestampError, "18446744073709551615"),
        (json_dml({"id": "1"}, commit_ts=-5), ImplausibleTimestampError, "-5"),
        (json_dml({"id": "1"}, commit_ts=0), ImplausibleTimestampError, "positive"),
        (
            b'{"version":1,"type":"WATERMARK","commitTs":%d,"buildTs":1}' % (2**64 - 1),
            ImplausibleTimestampError,
            "WATERMARK",
        ),
        (lz4.frame.compress(b"{" + b" " * (65 << 20) + b"}"), CompressionBombError, "inflates beyond"),
        (b"\xff\xff\xff\xff\x0f" + b"x" * 20, CompressionBombError, "declares 4294967295 bytes"),
    ],
    ids=[
        "utf8-header",
        "nesting-dml",
        "nesting-watermark",
        "nesting-limit",
        "commit-ts-max",
        "commit-ts-negative",
        "commit-ts-zero",
        "watermark-ts-max",
        "lz4-bomb",
        "snappy-declares-4gib",
    ],
)
def test_hostile_record_values_raise_consumer_errors(value: bytes, error: type, words: str) -> None:
    with pytest.raises(error, match=words) as caught:
        MessageDecoder().decode(value)
    assert caught.value.code == error.code


@pytest.mark.parametrize(
    ("data", "error", "column", "words"),
    [
        (  # @@: raw invalid UTF-8, below; {at}: its offset in the message
            {"id": "1", "name": "@@"},
            ValueDecodeError,
            "name",
            r"^column 'name': invalid UTF-8 at byte {at} \(0xff\), in `data\.name`$",
        ),
        ({"id": "1", "amount": "abc"}, ValueDecodeError, "amount", "not a valid decimal"),
        ({"id": "1", "ts": "2020-01-01 00:00:00"}, ValueDecodeError, "ts", "object"),
        (
            {"id": "1", "ts": {"location": "Europe", "value": "2020-01-01 00:00:00"}},
            ValueDecodeError,
            "ts",
            "Europe",
        ),
        (
            {"id": "1", "ts": {"location": "A" * 300, "value": "2020-01-01 00:00:00"}},
            ValueDecodeError,
            "ts",
            "zone",
        ),
        ({"id": "1", "doc": "[" * 3000 + "]" * 3000}, DocumentTooDeepError, "doc", "3000 deep"),
        ({"id": "1", "doc": "[" * 129 + "]" * 129}, DocumentTooDeepError, "doc", "129 deep"),
    ],
    ids=["utf8-value", "decimal-abc", "ts-text", "ts-europe", "ts-300", "json-deep", "json-129"],
)
def test_hostile_values_name_their_column(data: dict, error: type, column: str, words: str) -> None:
    value = json_dml(data).replace(b"@@", b"\xff\xfe")  # json.dumps would escape it
    with pytest.raises(error, match=words.replace("{at}", str(value.find(b"\xff")))) as caught:
        rows_of(value)
    assert (caught.value.code, caught.value.column) == (error.code, column)


def test_json_numbers_beyond_msgspecs_range_decode_and_read_back() -> None:
    """TiDB never writes them; they are valid JSON all the same, so they decode and read back (Python's json
    takes over from msgspec: a 5,000-digit integer as a Decimal, 1e400 as inf) instead of failing later."""
    huge = "1" * 5000
    codec = TableCodec(SCHEMA)
    raws = [
        MessageDecoder().decode(json_dml({"id": str(n), "doc": doc}))
        for n, doc in enumerate((huge, "[1e400]"))
    ]
    changes = codec.decode_changes(raws)  # type: ignore[arg-type]
    assert changes.rows.column("doc").to_pylist() == [huge, "[1e400]"]
    assert codec.columns[4].to_python(changes.rows.column("doc")) == [Decimal(huge), [float("inf")]]


def test_a_json_document_at_tidbs_depth_limit_still_decodes() -> None:
    doc = "[" * 100 + "]" * 100
    assert rows_of(json_dml({"id": "1", "doc": doc})).data["doc"] == json.loads(doc)  # type: ignore[index]


def test_an_avro_timestamp_sent_as_a_string_is_a_value_error() -> None:
    dml = insert_header()
    value = avro_messages.encode(dml, {"id": ("long", 1), "ts": ("string", "2020-01-01 00:00:00")})
    with pytest.raises(ValueDecodeError, match="not a valid timestamp") as caught:
        rows_of(value)
    assert caught.value.column == "ts"


def test_json_and_avro_rows_of_one_table_decode_in_one_batch() -> None:
    dml = insert_header()
    raws = []
    for number, encoding in enumerate(("json", "avro", "avro", "json")):
        value = MessageEncoder(encoding).encode(
            msgspec.structs.replace(dml, data={"id": number, "name": encoding}), SCHEMA
        )  # type: ignore[arg-type]
        raws.append(MessageDecoder().decode(value))
    codec = TableCodec(SCHEMA)
    images = codec.decode_batch(raws)  # type: ignore[arg-type]
    assert images.data.column("name").to_pylist() == ["json", "avro", "avro", "json"]
    changes = codec.decode_changes(raws)  # type: ignore[arg-type]
    assert changes.rows.column("id").to_pylist() == [0, 1, 2, 3] and changes.source == [0, 1, 2, 3]


def test_a_value_beyond_max_value_bytes_is_refused_with_its_row() -> None:
    policy = ValuePolicy(limits=DecodeLimits(max_value_bytes=100))
    codec = TableCodec(SCHEMA, policy)
    raws = [
        MessageDecoder().decode(json_dml({"id": str(n), "name": "x" * size}))
        for n, size in enumerate((10, 101))
    ]
    with pytest.raises(ValueTooLargeError, match="101 bytes") as caught:
        codec.decode_batch(raws)  # type: ignore[arg-type]
    assert (caught.value.column, caught.value.row, caught.value.code) == ("name", 1, "value-too-large")


# -- limits -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("compression", ["lz4", "snappy"])
def test_decompression_stops_at_the_limit_without_inflating_the_bomb(compression: str) -> None:
    payload = b"{" + b" " * (10 << 20) + b"}"
    value = (
        lz4.frame.compress(payload) if compression == "lz4" else bytes(cramjam.snappy.compress_raw(payload))
    )
    assert decompress(value, compression, max_bytes=len(payload)) == payload  # type: ignore[arg-type]
    with pytest.raises(CompressionBombError):
        decompress(value, compression, max_bytes=len(payload) - 1)  # type: ignore[arg-type]


def test_a_bomb_is_refused_in_bounded_memory() -> None:
    """A 1 GiB bomb (built in 16 MiB steps) decoded in a child whose peak memory is then read: an unbounded
    decompression would take the whole GiB."""
    script = """
import lz4.frame
from consumer.errors import CompressionBombError
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.testing.processes import peak_rss_mib
packer = lz4.frame.LZ4FrameCompressor()
chunk = bytes(16 << 20)
head = packer.begin() + packer.compress(b"{")
body = b"".join(packer.compress(chunk) for _ in range(64))
bomb = head + body + packer.flush()
del chunk
try:
    MessageDecoder().decode(bomb)
except CompressionBombError:
    print(int(peak_rss_mib()))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout) < 512  # MiB at the peak, imports included; the default limit is 64 MiB


def test_a_child_reports_its_own_peak_memory_not_its_spawners() -> None:
    """The bound above is read in a child of the test run, whose own peak can pass 512 MiB: `ru_maxrss`
    carries it across `exec`, `peak_rss_mib` does not."""
    script = """
import resource, subprocess, sys
held = bytearray(600 << 20)
for page in range(0, len(held), 4096):
    held[page] = 1
child = "import resource; from consumer.testing.processes import peak_rss_mib; "
child += "print(int(peak_rss_mib()), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)"
print(subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    own, carried = map(int, result.stdout.split())
    assert carried >= 600 and own < 200


@given(
    st.recursive(
        st.none() | st.integers() | st.text(alphabet='[]{}"\\ab'),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.text(alphabet='[]{"\\', max_size=3), inner, max_size=3)
        ),
        max_leaves=30,
    )
)
def test_nesting_depth_matches_the_document(document: object) -> None:
    def depth(value: object) -> int:
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        return 0

    assert nesting_depth(json.dumps(document).encode()) == depth(document)


def test_nesting_depth_is_linear_on_hostile_escapes() -> None:
    hostile = b'"' + b'\\"' * 2_000_000  # a regex over strings backtracks quadratically on this
    assert nesting_depth(hostile + b"[[1]]") == 0  # an unterminated string runs to the end


def test_commit_ts_range_follows_the_clock() -> None:
    limits = DecodeLimits(max_commit_ts_ahead_s=60)
    decoder = MessageDecoder(policy=ValuePolicy(limits=limits))
    now = tso_of(__import__("time").time())
    assert isinstance(decoder.decode(json_dml({"id": "1"}, commit_ts=now)), RawDML)
    with pytest.raises(ImplausibleTimestampError):
        decoder.decode(json_dml({"id": "1"}, commit_ts=now + tso_of(120)))


# -- schema validation ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("columns", "words"),
    [
        ((Column("x", DataType("decimal", length=66)),), "precision 66 above 65"),
        ((Column("x", DataType("decimal", length=12, decimal=31)),), "scale 31 outside 0..30"),
        ((Column("x", DataType("decimal", length=5, decimal=6)),), "scale 6 above its precision 5"),
        ((Column("x", DataType("bit", length=65)),), "BIT width 65 above 64"),
        ((Column("x", DataType("datetime", length=26, decimal=7)),), "fractional-second precision 7"),
        ((Column("x", DataType("set", elements=tuple(map(str, range(65))))),), "65 elements, more than 64"),
        ((Column("x", DataType("enum", elements=("a", "a"))),), "elements repeat"),
        ((Column("x", DataType("set", elements=("a,b",))),), "comma"),
        ((Column("x", DataType("enum")),), "without elements"),
        ((Column("x", DataType("vector", length=16384)),), "dimension 16384"),
        ((Column("x", DataType("int", length=2**32)),), "length 4294967296"),
        ((Column("x", TEXT), Column("X", TEXT)), "'X' appears twice"),
        ((Column("", TEXT),), "empty column name"),
        ((Column("x" * 65, TEXT),), "65 characters"),
        ((Column("x ", TEXT),), "ends with a space"),
        ((Column("a\x00b", TEXT),), "NUL"),
    ],
)
def test_schemas_outside_tidbs_limits_are_rejected(columns: tuple[Column, ...], words: str) -> None:
    schema = with_column(*columns)
    with pytest.raises(SchemaRejectedError, match=words) as caught:
        validate_schema(schema)
    assert caught.value.keys == (schema.key,)
    with pytest.raises(SchemaRejectedError):
        MessageDecoder().decode(bootstrap(schema))


def test_index_columns_must_exist_and_names_fit() -> None:
    schema = msgspec.structs.replace(SCHEMA, indexes=(Index("primary", True, True, False, ("nope",)),))
    with pytest.raises(SchemaRejectedError, match="names columns the table lacks: 'nope'"):
        validate_schema(schema)
    with pytest.raises(SchemaRejectedError, match="database name of 65"):
        validate_schema(msgspec.structs.replace(SCHEMA, database="d" * 65))
    with pytest.raises(SchemaRejectedError, match="version 9223372036854775808 is no TSO"):
        validate_schema(msgspec.structs.replace(SCHEMA, version=2**63))


def test_tidbs_own_extremes_are_accepted() -> None:
    validate_schema(
        with_column(
            Column("d", DataType("decimal", length=65, decimal=30)),
            Column("b", DataType("bit", length=64)),
            Column("s", DataType("set", elements=tuple(map(str, range(64))))),
            Column("e", DataType("enum", elements=tuple(map(str, range(1000))))),
            Column("x" * 64, DataType("datetime", length=26, decimal=6)),
            Column("_offset", DataType("int")),
        )
    )


@settings(max_examples=300, deadline=None)
@given(hostile_schemas())
def test_a_hostile_schema_is_rejected_or_decodes_rows(schema: TableSchema) -> None:
    try:
        message = MessageDecoder().decode(bootstrap(schema))
    except ConsumerError as exc:
        assert exc.code in ("schema-rejected", "malformed-message"), exc
        return
    codec = TableCodec(message.table_schema)  # type: ignore[union-attr]
    assert len(codec.arrow_schema) == len(schema.columns)


def test_an_avro_binary_default_that_is_no_text_keeps_the_schema_writable() -> None:
    """Raw default bytes (a BINARY column's) are no UTF-8: read as U+FFFD, as TiCDC's JSON carries them,
    so snapshots of the schema (msgpack) and its JSON rendering still encode."""
    column = Column("b", DataType("binary", length=2), default="\u00ff")
    value = bootstrap(with_column(column), "avro").replace("\u00ff".encode(), b"\xff\x00")
    message = MessageDecoder().decode(value)
    assert isinstance(message, Bootstrap)
    assert message.table_schema.columns[1].default == "\ufffd\x00"
    msgspec.msgpack.encode(message.table_schema)


# -- unknown column types ---------------------------------------------------------------------------------
def test_an_unknown_type_is_kept_as_its_wire_text_with_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(validation, "_warned", LRUCache(1024))  # once per process: not yet in this test's
    schema = msgspec.structs.replace(with_column(Column("shape", DataType("geometry"))), table="geo")
    json_value = json_dml({"id": "1", "shape": "POINT(1 2)"}, schema=schema)
    dml = insert_header(table="geo", schema_version=schema.version)
    avro_value = avro_messages.encode(dml, {"id": ("long", 2), "shape": ("bytes", b"POINT(3 4)")})
    codec = TableCodec(schema)
    for _ in range(3):
        MessageDecoder().decode(bootstrap(schema))
    assert caplog.text.count("'shape' has mysqlType 'geometry'") == 1
    raws = [MessageDecoder().decode(v) for v in (json_value, avro_value)]
    assert codec.decode_batch(raws).data.column("shape").to_pylist() == ["POINT(1 2)", "POINT(3 4)"]  # type: ignore[arg-type]
    assert codec.arrow_schema.field("shape").type == pa.string()


def test_unknown_types_under_the_error_policy_reject_the_schema() -> None:
    schema = with_column(Column("shape", DataType("geometry")))
    decoder = MessageDecoder(policy=ValuePolicy(unknown_types="error"))
    with pytest.raises(SchemaRejectedError, match="mysqlType 'geometry'"):
        decoder.decode(bootstrap(schema))


# -- the state machine remembers rejected schemas ---------------------------------------------------------
def _location(offset: int) -> RecordLocation:
    return RecordLocation("t", 0, offset)


def test_rows_of_a_rejected_schema_are_set_aside_held_or_arriving() -> None:
    bad = with_column(Column("x", DataType("decimal", length=12, decimal=2147483647)))
    row = MessageDecoder().decode(json_dml({"id": "1"}, schema=bad))
    state = ConsumerState()
    state.assign([("t", 0)])
    state.process(_location(0), row)  # held: its schema has not come yet
    try:
        MessageDecoder().decode(bootstrap(bad))
    except SchemaRejectedError as exc:
        state.process_failed(_location(1), exc, b"bootstrap")
    state.process(_location(2), row)  # arrives after the rejection
    letters = [unit for unit in state.resolve() if isinstance(unit, DeadLetter)]
    assert sorted((letter.location.offset, letter.reason_code) for letter in letters) == [
        (0, "schema-rejected"),
        (1, "schema-rejected"),
        (2, "schema-rejected"),
    ]
    for letter in letters:
        state.confirm(letter)
    assert state.committable() == {("t", 0): 3}
    assert state.stats().held_rows == 0


def test_a_valid_copy_of_a_rejected_version_is_learned() -> None:
    state = ConsumerState()
    state.assign([("t", 0)])
    state.process_failed(_location(0), SchemaRejectedError("corrupt copy", keys=(SCHEMA.key,)), b"")
    state.learn_schemas([SCHEMA])
    row = MessageDecoder().decode(json_dml({"id": "1"}))
    state.process(_location(1), row)
    assert state.stats().waiting_rows == 1  # decodable now: waits for the watermark, not set aside


# -- dead letters -----------------------------------------------------------------------------------------
def test_a_dead_letter_line_carries_its_reason_code_once(tmp_path: Path) -> None:
    path = tmp_path / "dead.jsonl"
    letter = DeadLetter(_location(5), "NestingTooDeepError: deep", b"\x00\x01", "nesting-too-deep")
    sink = DeadLetterFile(path)
    sink.write(letter)
    sink.write(letter)
    sink.close()
    DeadLetterFile(path).write(letter)  # a replay after a restart
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines == [
        {
            "topic": "t",
            "partition": 0,
            "offset": 5,
            "reason": "NestingTooDeepError: deep",
            "value": base64.b64encode(b"\x00\x01").decode(),
            "reason_code": "nesting-too-deep",
            "key": None,  # a row's letter: its record's key is not known
        }
    ]


def test_every_error_class_has_its_own_stable_code() -> None:
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, ConsumerError)]
    codes = {c: c.code for c in classes}
    assert all(code and code == code.lower() and " " not in code for code in codes.values())
    shared = {code for code in codes.values() if list(codes.values()).count(code) > 1}
    assert shared == {"nesting-too-deep"}  # a message's nesting, or a JSON column's document


def test_metadata_names_compare_case_insensitively() -> None:
    assert [stored_name(n) for n in ("_OFFSET", "_Deleted", "__offset", "offset", "_Offsets")] == [
        "__OFFSET",
        "__Deleted",
        "___offset",
        "offset",
        "_Offsets",
    ]


def test_mutated_valid_values_are_deterministic_per_seed() -> None:
    from consumer.testing.hostile import mutations

    values = [json_dml({"id": str(n)}) for n in range(5)]
    assert list(mutations(values, seed=3, count=50)) == list(mutations(values, seed=3, count=50))
    assert list(mutations(values, seed=3, count=50)) != list(mutations(values, seed=4, count=50))


def test_a_failed_commit_is_offered_again() -> None:
    """A quiet partition whose last commit failed (a rebalance under way) would otherwise never commit it."""
    state = ConsumerState()
    state.assign([("t", 0)])
    state.process(
        _location(0), MessageDecoder().decode(b'{"version":1,"type":"WATERMARK","commitTs":5,"buildTs":1}')
    )
    assert state.committable() == {("t", 0): 1}
    assert state.committable() == {}
    state.commit_failed({("t", 0): 1})
    assert state.committable() == {("t", 0): 1}


class _FailsOnBatches(TableCodec):
    """A codec with a fault no row explains (an `InternalDecodeError` is one: a bug) in batches of rows."""

    def decode_changes(self, raws):  # type: ignore[no-untyped-def]
        if len(raws) > 1:
            raise errors.InternalDecodeError("a fault of the batch, not of a row")
        return super().decode_changes(raws)


def test_a_batch_failing_without_naming_a_row_is_written_row_by_row(tmp_path: Path) -> None:
    from consumer.batches.changes import table_changes
    from consumer.pipeline import Pipeline
    from consumer.sinks.dead_letter import DeadLetterFile
    from consumer.sinks.jsonl import JsonLinesSink
    from consumer.sources.capture import write_capture
    from consumer.sources.files import FileSource
    from consumer.sources.record import SourceRecord

    values = [bootstrap(SCHEMA), *(json_dml({"id": str(n)}, commit_ts=TS + n) for n in range(3))]
    values.insert(2, json_dml({"id": "9", "amount": "abc"}, commit_ts=TS + 9))
    values.append(b'{"version":1,"type":"WATERMARK","commitTs":%d,"buildTs":1}' % (TS + 100))
    path = tmp_path / "capture.jsonl"
    with path.open("wb") as file:
        write_capture([SourceRecord("t", 0, n, None, None, v) for n, v in enumerate(values)], file)
    pipeline = Pipeline(
        group="g", state=ConsumerState(), sinks=[JsonLinesSink(tmp_path / "out")],
        dead_letters=DeadLetterFile(tmp_path / "dead.jsonl"),
        row_decoder=lambda codec, rows, origins: table_changes(_FailsOnBatches(codec.schema), rows, origins),
    )  # fmt: skip
    pipeline.run(FileSource(path, listener=pipeline), until_idle=0.3)
    pipeline.close()
    rows = [json.loads(line) for line in (tmp_path / "out" / "shop" / "t.jsonl").read_bytes().splitlines()]
    assert [row["id"] for row in rows] == [0, 1, 2]
    letters = [json.loads(line) for line in (tmp_path / "dead.jsonl").read_bytes().splitlines()]
    assert [(d["offset"], d["reason_code"]) for d in letters] == [(2, "value-decode")]


# Found by the long fuzz run (benchmarks/fuzz.py): an Avro DML header whose schemaVersion varint runs past 64
# bits (its tenth byte carries more than the 64th bit) read back as a number beyond int64; the changelog's
# `_schema_version` column then overflowed outside any containment.
LONG_FUZZ_AVRO_HEADER = base64.b64decode(
    "FgYGAghzaG9wBHQxygEAgICAg9Ta7e0MmKDV7e5mgICggNTa7f/tDAAAAAIOBGlkAggQY3VzdG9tZXIINmdvbWdqZGFkbz5hWmo8PvCfmIBlYyBsb2puIAxhbW91bnQIGjE2Mjg5OTM3NTkuMjAMc3RhdHVzAgIQcXVhbnRpdHkCABR1cGRhdGVkX2F0DAZVVEMmMjAxMi0wNy0xOSAxMTozNTo0NQhub3RlCDpvcGTwn5iAbW1nWmFp8J+YgMOrPj4+IGdvw6sgbgAA"
)


def test_an_avro_header_varint_beyond_64_bits_is_malformed() -> None:
    with pytest.raises(errors.MalformedMessageError, match="beyond 64 bits"):
        MessageDecoder().decode(LONG_FUZZ_AVRO_HEADER)
