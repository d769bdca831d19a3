"""Examples of encode/decode through the public codec, both encodings, every compression."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal

import pytest

from consumer.protocol.model import (
    DDL,
    DML,
    Bootstrap,
    Column,
    DataType,
    DDLType,
    DMLType,
    Index,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec


def _col(name: str, mysql_type: str, **kw: object) -> Column:
    return Column(name=name, data_type=DataType(mysql_type=mysql_type, **kw))  # type: ignore[arg-type]


SCHEMA = TableSchema(
    database="test",
    table="t",
    table_id=10,
    version=100,
    columns=(
        _col("id", "int", length=11),
        _col("name", "varchar", charset="utf8mb4", collate="utf8mb4_bin", length=255),
        _col("ts", "timestamp", length=19),
        _col("b", "bit", length=10, unsigned=True),
        _col("d", "decimal", length=12, decimal=6, unsigned=False),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)

DML_UPDATE = DML(
    type=DMLType.UPDATE,
    database="test",
    table="t",
    table_id=10,
    commit_ts=446266400629063682,
    build_ts=1735689600000,
    schema_version=100,
    data={
        "id": 1,
        "name": "a<b>&é",
        "ts": dt.datetime(2020, 1, 2, tzinfo=dt.UTC),
        "b": 682,
        "d": Decimal("1.5"),
    },
    old={"id": 1, "name": None},
)


@pytest.mark.parametrize("encoding", ["json", "avro"])
@pytest.mark.parametrize("compression", ["none", "snappy", "lz4"])
@pytest.mark.parametrize(
    "message",
    [
        Watermark(commit_ts=5, build_ts=6),
        Bootstrap(table_schema=SCHEMA, build_ts=7),
        DDL(type=DDLType.CREATE, sql="CREATE TABLE t (id int)", commit_ts=9, build_ts=1, table_schema=SCHEMA),
        DDL(type=DDLType.QUERY, sql="DROP DATABASE test", commit_ts=10, build_ts=1),
        DML_UPDATE,
    ],
    ids=lambda m: type(m).__name__,
)
def test_round_trip(encoding: str, compression: str, message: object) -> None:
    value = MessageEncoder(encoding, compression).encode(message, SCHEMA)  # type: ignore[arg-type]
    decoded = MessageDecoder().decode(value)
    if isinstance(decoded, RawDML):
        assert decoded.schema_key == ("test", "t", 100)
        decoded = TableCodec(SCHEMA).decode(decoded)
    assert decoded == message


def test_json_dml_bytes_are_go_encoding_json() -> None:
    value = MessageEncoder("json").encode(DML_UPDATE, SCHEMA)
    assert value == (
        b'{"version":1,"database":"test","table":"t","tableID":10,"type":"UPDATE",'
        b'"commitTs":446266400629063682,"buildTs":1735689600000,"schemaVersion":100,'
        b'"data":{"b":"682","d":"1.500000","id":"1","name":"a\\u003cb\\u003e\\u0026\xc3\xa9",'
        b'"ts":{"location":"UTC","value":"2020-01-02 00:00:00"}},"old":{"id":"1","name":null}}'
    )


def test_decimal_keeps_column_scale() -> None:
    decoded = TableCodec(SCHEMA).decode(MessageDecoder().decode(MessageEncoder().encode(DML_UPDATE, SCHEMA)))
    assert str(decoded.data["d"]) == "1.500000"


@pytest.mark.parametrize(("encoding", "plain_size"), [("json", ord("{")), ("avro", 0x16)])
def test_auto_detection_reads_snappy_blocks_that_start_like_plain_messages(
    encoding: str, plain_size: int
) -> None:
    """A raw snappy block opens with its uncompressed size: 123 reads as `{`, 22 as Avro's first byte."""
    message = next(
        m
        for m in (DDL(type=DDLType.QUERY, sql="x" * size, commit_ts=9, build_ts=1) for size in range(200))
        if len(MessageEncoder(encoding, "none").encode(m)) == plain_size  # type: ignore[arg-type]
    )
    value = MessageEncoder(encoding, "snappy").encode(message)  # type: ignore[arg-type]
    assert value[0] == plain_size
    assert MessageDecoder().decode(value) == message


@pytest.mark.parametrize("encoding", ["json", "avro"])
def test_negative_zero_keeps_its_sign_in_float_and_double(encoding: str) -> None:
    """JSON carries it as "-0", which a lax number parser reads as the integer 0 (hypothesis found it)."""
    schema = TableSchema(
        database="test",
        table="z",
        table_id=11,
        version=1,
        columns=(_col("id", "int", length=11), _col("f", "float", length=12), _col("g", "double", length=22)),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )
    dml = DML(
        type=DMLType.INSERT,
        database="test",
        table="z",
        table_id=11,
        commit_ts=5,
        build_ts=0,
        schema_version=1,
        data={"id": 1, "f": -0.0, "g": -0.0},
    )
    raw = MessageDecoder().decode(MessageEncoder(encoding).encode(dml, schema))  # type: ignore[arg-type]
    assert isinstance(raw, RawDML)
    codec = TableCodec(schema)
    row = codec.decode(raw).data
    batch = codec.decode_batch([raw]).data.to_pylist()[0]
    assert row is not None
    for values in (row, batch):
        assert [math.copysign(1.0, values[name]) for name in ("f", "g")] == [-1.0, -1.0]
