"""Every malformed input raises a DecodeError subclass naming what was wrong and where."""

from __future__ import annotations

import json

import lz4.frame
import pyarrow as pa
import pytest

from consumer.errors import (
    CompressionError,
    DecodeError,
    MalformedMessageError,
    SchemaRejectedError,
    UnknownMessageTypeError,
    UnrepresentableValueError,
    ValueDecodeError,
)
from consumer.protocol import checks as checks_module
from consumer.protocol.checks import MessageChecks
from consumer.protocol.compression import compress
from consumer.protocol.model import (
    DML,
    Bootstrap,
    Column,
    DataType,
    DMLType,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.protocol.validation import UnknownTypePolicy, validate_schema

SCHEMA = TableSchema(
    database="d",
    table="t",
    table_id=1,
    version=7,
    columns=(
        Column("id", DataType("int", length=11)),
        Column("blob", DataType("blob", length=65535)),
        Column("kind", DataType("enum", "utf8mb4", "utf8mb4_bin", length=1, elements=("a", "b"))),
        Column("born", DataType("date", length=10)),
    ),
)


def _json_dml(data: dict) -> bytes:
    return json.dumps(
        {
            "version": 1,
            "database": "d",
            "table": "t",
            "tableID": 1,
            "type": "INSERT",
            "commitTs": 5,
            "buildTs": 1,
            "schemaVersion": 7,
            "data": data,
        }
    ).encode()


def _typed(value: bytes, policy: ValuePolicy | None = None) -> object:
    raw = MessageDecoder().decode(value)
    assert isinstance(raw, RawDML)
    return TableCodec(SCHEMA, policy).decode(raw)


WATERMARK_JSON = MessageEncoder("json").encode(Watermark(commit_ts=5, build_ts=1))
WATERMARK_AVRO = MessageEncoder("avro").encode(Watermark(commit_ts=5, build_ts=1))


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (WATERMARK_JSON[:-3], MalformedMessageError, "invalid JSON"),
        (b'{"version":1,"type":"WATERMARK","commitTs":"x","buildTs":1}', MalformedMessageError, "commitTs"),
        (b'{"version":1,"type":"NOPE","commitTs":1,"buildTs":1}', UnknownMessageTypeError, "NOPE"),
        (
            b'{"version":1,"type":"DDL","sql":"x","commitTs":1,"buildTs":1}',
            UnknownMessageTypeError,
            "pre-v8.0",
        ),
        (b'{"version":1,"type":"BOOTSTRAP","commitTs":0,"buildTs":1}', MalformedMessageError, "tableSchema"),
        (b'{"version":1,"type":"WATERMARK"}', MalformedMessageError, "commitTs"),
        (WATERMARK_AVRO[:-2], MalformedMessageError, "Avro"),
        (WATERMARK_AVRO + b"\x00\x01", MalformedMessageError, "garbage after the Avro datum"),
        (b"\x16\x00\x02\x02\x02\x02", MalformedMessageError, "Avro"),  # WATERMARK type, Bootstrap branch
        (b"\x16\x06\x06\x02", MalformedMessageError, "truncated"),  # DML header cut short
        (b"\x16\x06\x02\x02", MalformedMessageError, "DML payload"),  # DML type, Bootstrap branch
        (lz4.frame.compress(WATERMARK_JSON) + b"junk", CompressionError, "garbage after the lz4 frame"),
        (lz4.frame.compress(WATERMARK_JSON)[:-6], CompressionError, "lz4"),
        (compress(WATERMARK_JSON, "snappy")[:-4] + b"\xff\xff\xff", CompressionError, "snappy"),
        (b"garbage", CompressionError, "not JSON, Avro or LZ4"),
        (b"", MalformedMessageError, "empty"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_malformed_record_values(value: bytes, error: type, words: str) -> None:
    with pytest.raises(error) as caught:
        MessageDecoder().decode(value)
    assert isinstance(caught.value, DecodeError)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("data", "column", "words"),
    [
        ({"id": "12x"}, "id", "expected an integer or null, got a string, in `data.id`"),
        ({"id": "2147483648"}, "id", "not a valid int"),
        ({"blob": 5}, "blob", "expected base64 text or null, got an integer, in `data.blob`"),
        ({"blob": "***"}, "blob", "not valid base64, in `data.blob`"),
        ({"kind": "3"}, "kind", "enum index outside 0..2"),
        ({"born": "2026-02-30"}, "born", "not a valid date"),
        ({"extra": "1"}, "extra", "unknown field `extra`, in `data`"),
    ],
)
def test_bad_values_name_the_column(data: dict, column: str, words: str) -> None:
    with pytest.raises(ValueDecodeError) as caught:
        _typed(_json_dml(data))
    assert caught.value.column == column
    assert words in str(caught.value)


def _avro_insert(data: dict, schema: TableSchema = SCHEMA) -> bytes:
    return MessageEncoder("avro").encode(
        DML(
            type=DMLType.INSERT,
            database="d",
            table="t",
            table_id=1,
            commit_ts=5,
            build_ts=1,
            schema_version=7,
            data=data,
        ),
        schema,
    )


def test_wrong_avro_branch_for_a_column_names_it() -> None:
    good = _avro_insert({"id": 3})
    wrong = good.replace(b"\x04id\x02\x06", b"\x04id\x08\x02x")  # long 3 -> string "x"
    with pytest.raises(ValueDecodeError) as caught:
        _typed(wrong)
    assert caught.value.column == "id"


def test_a_cut_avro_row_gives_the_same_reason_each_time() -> None:
    """fastavro's error on a cut double names its stream object; the reason is the SDK's, the same each
    time."""
    schema = TableSchema(
        "d", "t", 1, 7, (Column("id", DataType("int", length=11)), Column("x", DataType("double")))
    )
    full = _avro_insert({"id": 3, "x": 0.5}, schema)
    cut = full[: full.index(b"\x02x") + 6]  # inside the double's 8 bytes
    raw = MessageDecoder().decode(cut)
    assert isinstance(raw, RawDML)
    reasons = set()
    for _ in range(2):
        with pytest.raises(ValueDecodeError) as caught:
            TableCodec(schema).decode(raw)
        reasons.add(str(caught.value))
    (reason,) = reasons
    assert reason == (
        "column '<row>': invalid Avro datum: the datum is cut short: its schema reads beyond its last byte "
        f"({len(cut) - 1})"
    )


def test_zero_date_is_null_and_counted_by_default_or_raises_on_request() -> None:
    codec = TableCodec(SCHEMA)
    raw = MessageDecoder().decode(_json_dml({"id": "1", "born": "0000-00-00"}))
    assert isinstance(raw, RawDML)
    assert codec.decode(raw).data == {"id": 1, "born": None}
    assert codec.stats.unrepresentable == 1
    with pytest.raises(UnrepresentableValueError, match="born"):
        _typed(_json_dml({"id": "1", "born": "2026-00-10"}), ValuePolicy(unrepresentable="raise"))


def test_unknown_mysql_type_is_kept_as_its_text_or_refused_on_request() -> None:
    schema = TableSchema(
        "d", "t", 1, 7, (Column("id", DataType("int")), Column("shape", DataType("geometry")))
    )
    raw = MessageDecoder().decode(_json_dml({"id": "1", "shape": "POINT(1 2)"}))
    assert isinstance(raw, RawDML)
    codec = TableCodec(schema)
    assert codec.arrow_schema.field("shape").type == pa.string()
    assert codec.decode(raw).data == {"id": 1, "shape": "POINT(1 2)"}
    with pytest.raises(SchemaRejectedError, match=r"'shape'.*'geometry'") as caught:
        TableCodec(schema, ValuePolicy(unknown_types="error"))
    assert caught.value.keys == (("d", "t", 7),)


def test_a_repeated_schema_is_validated_once_and_a_rejected_one_every_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    valid = TableSchema("d", "t", 1, 7, (Column("id", DataType("int")),))
    refused = TableSchema("d", "t", 1, 8, (Column("shape", DataType("geometry")),))
    checks = MessageChecks(unknown_types="error")
    validated: list[int] = []

    def counted(schema: TableSchema, unknown_types: UnknownTypePolicy = "lossless") -> None:
        validated.append(schema.version)
        validate_schema(schema, unknown_types)

    monkeypatch.setattr(checks_module, "validate_schema", counted)
    for _ in range(3):  # TiCDC sends a table's BOOTSTRAP again and again
        checks.message(Bootstrap(table_schema=valid, build_ts=1))
    changed = TableSchema("d", "t", 1, 7, (Column("id", DataType("bigint")),))  # same key, other columns
    checks.message(Bootstrap(table_schema=changed, build_ts=1))
    for _ in range(2):
        with pytest.raises(SchemaRejectedError, match="geometry"):
            checks.message(Bootstrap(table_schema=refused, build_ts=1))
    assert validated == [7, 7, 8, 8]
