"""Golden values from the spec (§4.1, §4.4, §5.2, §5.3): exact bytes and exact typed values."""

from __future__ import annotations

import datetime as dt
import json
from decimal import Decimal

from consumer.protocol.model import DML, Bootstrap, Column, DataType, DMLType, RawDML, TableSchema, Watermark
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec


def _table(*columns: Column) -> TableSchema:
    return TableSchema(database="test", table="t", table_id=1, version=9, columns=columns)


def _json_row(schema: TableSchema, data: dict) -> dict:
    value = json.dumps(
        {
            "version": 1,
            "database": "test",
            "table": "t",
            "tableID": 1,
            "type": "INSERT",
            "commitTs": 2,
            "buildTs": 3,
            "schemaVersion": 9,
            "data": data,
        }
    ).encode()
    raw = MessageDecoder().decode(value)
    assert isinstance(raw, RawDML)
    return TableCodec(schema).decode(raw).data  # type: ignore[return-value]


def test_watermark_avro_bytes_match_spec_5_3() -> None:
    message = Watermark(commit_ts=446266400629063682, build_ts=1735689600000)
    expected = bytes.fromhex("16 00 00 02 84 80 80 cb a9 bb ba b1 0c 80 f0 cb f2 83 65")
    assert MessageEncoder("avro").encode(message) == expected
    assert MessageDecoder().decode(expected) == message


def test_avro_dml_value_layouts_match_spec_5_3() -> None:
    schema = _table(
        Column("age", DataType("int", length=11)),
        Column("name", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=255)),
        Column("score", DataType("float", length=12)),
        Column("big", DataType("bigint", length=20, unsigned=True)),
    )
    dml = DML(
        type=DMLType.INSERT,
        database="test",
        table="t",
        table_id=1,
        commit_ts=2,
        build_ts=3,
        schema_version=9,
        data={"age": 25, "name": "John Doe", "score": 90.5, "big": 2**63},
    )
    value = MessageEncoder("avro").encode(dml, schema)
    assert value.startswith(bytes.fromhex("16 06 06"))
    for fragment in ("02 32", "08 10 4a6f686e20446f65", "04 0000b542", "0e ff ff ff ff ff ff ff ff ff 01"):
        assert bytes.fromhex(fragment) in value
    raw = MessageDecoder().decode(value)
    assert TableCodec(schema).decode(raw).data == dml.data  # type: ignore[arg-type]


def test_json_value_examples_of_spec_4_1() -> None:
    schema = _table(
        Column("ti", DataType("tinyint", length=4)),
        Column("ub", DataType("bigint", length=20, unsigned=True)),
        Column("f", DataType("float", length=12)),
        Column("f_old", DataType("float", length=12)),
        Column("d", DataType("double", length=22)),
        Column("dec", DataType("decimal", length=12, decimal=6)),
        Column("e", DataType("enum", "utf8mb4", "utf8mb4_bin", elements=("a", "b", "c"))),
        Column("s", DataType("set", "utf8mb4", "utf8mb4_bin", elements=("a", "b", "c"))),
        Column("b", DataType("bit", length=10, unsigned=True)),
        Column("j", DataType("json")),
        Column("v", DataType("vector", length=3)),
        Column("tm", DataType("time", length=10)),
        Column("ts", DataType("timestamp", length=19)),
        Column("y", DataType("year", length=4, unsigned=True, zerofill=True)),
        Column("bin", DataType("binary", length=3)),
    )
    row = _json_row(
        schema,
        {
            "ti": "-128",
            "ub": "18446744073709551615",
            "f": "100000000000000000000",
            "f_old": "1.234567e+06",
            "d": "2.71",
            "dec": "1.500000",
            "e": "1",
            "s": "5",
            "b": "682",
            "j": '{"key1": "value1"}',
            "v": "[1,2,3]",
            "tm": "-838:59:59",
            "ts": {"location": "Asia/Shanghai", "value": "2026-01-01 08:00:00"},
            "y": "0",
            "bin": "YQAA",
        },
    )
    assert row == {
        "ti": -128,
        "ub": 18446744073709551615,
        "f": 100000002004087734272.0,
        "f_old": 1234567.0,
        "d": 2.71,
        "dec": Decimal("1.500000"),
        "e": "a",
        "s": "a,c",
        "b": 682,
        "j": {"key1": "value1"},
        "v": [1.0, 2.0, 3.0],
        "tm": -dt.timedelta(hours=838, minutes=59, seconds=59),
        "ts": dt.datetime(2026, 1, 1, 0, 0, tzinfo=dt.UTC),
        "y": 0,
        "bin": b"a\x00\x00",
    }


def test_bit_default_is_a_json_number_and_raw_avro_bytes() -> None:
    schema = _table(Column("b", DataType("bit", length=10, unsigned=True), default=682))
    message = Bootstrap(table_schema=schema, build_ts=1)
    assert b'"default":682' in MessageEncoder("json").encode(message)
    avro = MessageEncoder("avro").encode(message)
    assert b"\x04\x02\xaa" in avro  # union branch string, length 2, bytes 02 AA (invalid UTF-8)
    assert MessageDecoder().decode(avro) == message


def test_tiflow_avro_bit_long_branch_is_accepted() -> None:
    schema = _table(Column("b", DataType("bit", length=64, unsigned=True)))
    dml = DML(
        type=DMLType.INSERT,
        database="test",
        table="t",
        table_id=1,
        commit_ts=2,
        build_ts=3,
        schema_version=9,
        data={"b": 2**64 - 1},
    )
    for variant in ("ticdc", "tiflow"):
        value = MessageEncoder("avro", variant=variant).encode(dml, schema)
        raw = MessageDecoder().decode(value)
        assert TableCodec(schema).decode(raw).data == {"b": 2**64 - 1}  # type: ignore[arg-type]


def test_regressions_null_unsigned_bigint_in_avro_and_bit63_upper_bound() -> None:
    schema = _table(
        Column("u", DataType("bigint", length=20, unsigned=True)),
        Column("b", DataType("bit", length=63, unsigned=True)),
    )
    row = {"u": None, "b": 2**63 - 1}
    for encoding in ("json", "avro"):
        dml = DML(
            type=DMLType.INSERT,
            database="test",
            table="t",
            table_id=1,
            commit_ts=2,
            build_ts=3,
            schema_version=9,
            data=row,
        )
        raw = MessageDecoder().decode(MessageEncoder(encoding).encode(dml, schema))
        assert TableCodec(schema).decode(raw).data == row  # type: ignore[arg-type]
