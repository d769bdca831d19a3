"""Row checksums (spec §8.3): the worked vector, the two implementations against each other for every
column type and both encodings, and that any single changed value fails verification."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from consumer.errors import ChecksumMismatchError, RowCorruptedError
from consumer.protocol.model import DML, Checksum, Column, DataType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.simple.checksum import image_checksums, row_checksum, verify_changes, wire_checksum
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.testing.strategies import ALL_MYSQL_TYPES, rows, table_schemas, values

PROPERTY = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LOCATIONS = st.sampled_from(["UTC", "Asia/Shanghai", "America/New_York"])
ENCODINGS = st.sampled_from(["json", "avro"])
WORKED_VECTOR = 327940912  # spec §8.3: the all-types row of §11 at location UTC
TEXT = ("utf8mb4", "utf8mb4_bin")


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _ints(prefix: str, kind: str, length: int, maximum: int) -> list[tuple[str, DataType, Any]]:
    """TiCDC's signed column at its maximum, then four unsigned ones: max, max + 1, 0, NULL."""
    unsigned = DataType(kind, length=length - 1 if kind != "bigint" else 20, unsigned=True)
    return [
        (prefix, DataType(kind, length=length), str(maximum)),
        *(
            (f"{prefix}u{i}", unsigned, value)
            for i, value in enumerate((str(maximum), str(maximum + 1), "0", None), start=1)
        ),
    ]


# TiCDC's all-types test table (`NewLargeEvent4Test`: 55 columns, `tu1` the handle) and its row on the wire.
_TINY = [
    ("t", DataType("tinyint", length=4), "127"),
    ("tu1", DataType("tinyint", length=3, unsigned=True), "127"),
    ("tu2", DataType("tinyint", length=3, unsigned=True), "128"),
    ("tu3", DataType("tinyint", length=3, unsigned=True), "0"),
    ("tu4", DataType("tinyint", length=3, unsigned=True), None),
]
ALL_TYPES_ROW: list[tuple[str, DataType, Any]] = [
    *_TINY,
    *_ints("s", "smallint", 6, 32767),
    *_ints("m", "mediumint", 9, 8388607),
    *_ints("i", "int", 11, 2147483647),
    *_ints("bi", "bigint", 20, 9223372036854775807),
    ("floatT", DataType("float", length=12), "3.14"),
    ("doubleT", DataType("double", length=22), "2.71"),
    ("decimalT", DataType("decimal", length=12, decimal=6), "2333.654321"),
    ("floatTu", DataType("float", length=12, unsigned=True), "3.14"),
    ("doubleTu", DataType("double", length=22, unsigned=True), "2.71"),
    ("decimalTu", DataType("decimal", length=12, decimal=6, unsigned=True), "2333.123456"),
    ("decimalTu2", DataType("decimal", length=5, decimal=4, unsigned=True), "1.7371"),
    ("varcharT", DataType("varchar", *TEXT, length=255), "测试Varchar"),
    ("charT", DataType("char", *TEXT, length=255), "测试String"),
    ("binaryT", DataType("binary", length=255), _b64("测试Binary".encode().ljust(255, b"\0"))),
    ("varbinaryT", DataType("varbinary", length=255), _b64("测试varbinary".encode())),
    ("tinytextT", DataType("tinytext", *TEXT, length=255), "测试Tinytext"),
    ("textT", DataType("text", *TEXT, length=65535), "测试text"),
    ("mediumtextT", DataType("mediumtext", *TEXT, length=16777215), "测试mediumtext"),
    ("longtextT", DataType("longtext", *TEXT, length=4294967295), "测试longtext"),
    ("tinyblobT", DataType("tinyblob", length=255), _b64("测试tinyblob".encode())),
    ("blobT", DataType("blob", length=65535), _b64("测试blob".encode())),
    ("mediumblobT", DataType("mediumblob", length=16777215), _b64("测试mediumblob".encode())),
    ("longblobT", DataType("longblob", length=4294967295), _b64("测试longblob".encode())),
    ("dateT", DataType("date", length=10), "2020-02-20"),
    ("datetimeT", DataType("datetime", length=19), "2020-02-20 02:20:20"),
    ("timestampT", DataType("timestamp", length=19), {"location": "UTC", "value": "2020-02-20 10:20:20"}),
    (
        "timestampT2",
        DataType("timestamp", length=26, decimal=6),
        {"location": "UTC", "value": "2024-03-11 08:51:01.461270"},
    ),
    ("timeT", DataType("time", length=10), "02:20:20"),
    ("yearT", DataType("year", length=4, unsigned=True, zerofill=True), "2020"),
    ("enumT", DataType("enum", *TEXT, length=1, elements=("a", "b", "c")), "1"),
    ("setT", DataType("set", *TEXT, length=5, elements=("a", "b", "c")), "2"),
    ("bitT", DataType("bit", length=10, unsigned=True), "65"),
    ("vectorT", DataType("vector", length=5), "[1,2,3,4,5]"),
    ("jsonT", DataType("json", length=4294967295), '{"key1": "value1"}'),
]
ALL_TYPES = TableSchema(
    database="test",
    table="t",
    table_id=1,
    version=1,
    columns=tuple(Column(name, data_type, nullable=name != "tu1") for name, data_type, _ in ALL_TYPES_ROW),
    indexes=(Index("primary", True, True, False, ("tu1",)),),
)
ALL_TYPES_DATA = {name: value for name, _, value in ALL_TYPES_ROW}


def _update_json(data: dict[str, Any], checksum: Checksum) -> RawDML:
    message = {
        "version": 1,
        "database": "test",
        "table": "t",
        "tableID": 1,
        "type": "UPDATE",
        "commitTs": 5,
        "buildTs": 1,
        "schemaVersion": 1,
        "checksum": msgspec.to_builtins(checksum),
        "data": data,
        "old": data,
    }
    raw = MessageDecoder().decode(json.dumps(message, ensure_ascii=False).encode())
    assert isinstance(raw, RawDML)
    return raw


def test_the_worked_vector_of_the_spec() -> None:
    assert len(ALL_TYPES.columns) == 55
    assert wire_checksum(ALL_TYPES.columns, ALL_TYPES_DATA) == WORKED_VECTOR
    raw = _update_json(ALL_TYPES_DATA, Checksum(1, False, WORKED_VECTOR, WORKED_VECTOR))
    codec = TableCodec(ALL_TYPES)
    images = codec.decode_changes([raw])
    assert image_checksums(codec.columns, images.rows) == [WORKED_VECTOR, WORKED_VECTOR]
    assert verify_changes(codec, images, [raw]) == (2, {})


def test_the_worked_vector_through_avro_and_another_zone() -> None:
    typed = TableCodec(ALL_TYPES).decode(_update_json(ALL_TYPES_DATA, Checksum(1, False, 0, 0)))
    for encoding, zone in (("avro", "UTC"), ("json", "Asia/Shanghai"), ("avro", "America/New_York")):
        encoder = MessageEncoder(encoding, policy=ValuePolicy(timestamp_location=zone))  # type: ignore[arg-type]
        codec = encoder.table_codec(ALL_TYPES)
        assert row_checksum(codec, typed.data) == WORKED_VECTOR  # zones are converted back to UTC
        dml = msgspec.structs.replace(typed, checksum=Checksum(1, False, WORKED_VECTOR, WORKED_VECTOR))
        raw = MessageDecoder().decode(encoder.encode(dml, ALL_TYPES))
        assert isinstance(raw, RawDML)
        images = codec.decode_changes([raw])
        assert image_checksums(codec.columns, images.rows) == [WORKED_VECTOR] * 2
        assert verify_changes(codec, images, [raw]) == (2, {})


def test_a_changed_value_of_the_worked_vector_is_rejected_naming_the_image() -> None:
    data = ALL_TYPES_DATA | {"decimalT": "2333.654322"}
    codec = TableCodec(ALL_TYPES)
    raw = _update_json(data, Checksum(1, False, WORKED_VECTOR, WORKED_VECTOR))
    verified, rejected = verify_changes(codec, codec.decode_changes([raw]), [raw])
    assert verified == 0
    assert isinstance(rejected[0], ChecksumMismatchError)
    assert rejected[0].code == "checksum-mismatch"
    assert f"new image: TiCDC sent current={WORKED_VECTOR}" in rejected[0].reason
    assert f"hash to {wire_checksum(ALL_TYPES.columns, data)}" in rejected[0].reason


def test_corrupted_rows_are_rejected_without_hashing() -> None:
    codec = TableCodec(ALL_TYPES)
    raw = _update_json(ALL_TYPES_DATA, Checksum(0, True, WORKED_VECTOR, WORKED_VECTOR))
    verified, rejected = verify_changes(codec, codec.decode_changes([raw]), [raw])
    assert verified == 0
    assert isinstance(rejected[0], RowCorruptedError) and rejected[0].code == "checksum-corrupted"
    assert "corrupted" in rejected[0].reason and str(WORKED_VECTOR) in rejected[0].reason


def test_a_zero_date_nulled_by_the_value_policy_still_verifies_on_its_wire_value() -> None:
    schema = TableSchema(
        "d",
        "z",
        1,
        1,
        (Column("id", DataType("int", length=11), nullable=False), Column("d", DataType("date"))),
    )
    data = {"id": "1", "d": "0000-00-00"}
    expected = wire_checksum(schema.columns, data)
    message = {
        "version": 1,
        "database": "d",
        "table": "z",
        "tableID": 1,
        "type": "INSERT",
        "commitTs": 5,
        "buildTs": 1,
        "schemaVersion": 1,
        "checksum": {"version": 1, "corrupted": False, "current": expected, "previous": 0},
        "data": data,
    }
    raw = MessageDecoder().decode(json.dumps(message).encode())
    codec = TableCodec(schema)
    images = codec.decode_changes([raw])  # type: ignore[list-item]
    assert images.rows.column("d").to_pylist() == [None]
    assert verify_changes(codec, images, [raw]) == (1, {})  # type: ignore[list-item]


# -- properties: random rows of every column type, both encodings ----------------------------------------
def _checksummed(codec: TableCodec, kind: DMLType, data: Any, old: Any) -> DML:
    return DML(
        type=kind,
        database=codec.schema.database,
        table=codec.schema.table,
        table_id=codec.schema.table_id,
        commit_ts=7,
        build_ts=1,
        schema_version=codec.schema.version,
        data=data,
        old=old,
        checksum=Checksum(1, False, row_checksum(codec, data), row_checksum(codec, old)),
    )


@st.composite
def _checksummed_dmls(
    draw: st.DrawFn, mysql_type: str | None = None
) -> tuple[MessageEncoder, TableSchema, DML]:
    types = (mysql_type,) if mysql_type else ALL_MYSQL_TYPES
    schema = draw(table_schemas(min_columns=1, max_columns=6, mysql_types=types))
    encoder = MessageEncoder(draw(ENCODINGS), policy=ValuePolicy(timestamp_location=draw(LOCATIONS)))
    kind = draw(st.sampled_from(DMLType))
    data = draw(rows(schema)) if kind != DMLType.DELETE else None
    old = draw(rows(schema)) if kind != DMLType.INSERT else None
    return encoder, schema, _checksummed(encoder.table_codec(schema), kind, data, old)


def _verify(encoder: MessageEncoder, schema: TableSchema, dml: DML) -> tuple[int, dict[int, Any]]:
    raw = MessageDecoder().decode(encoder.encode(dml, schema))
    assert isinstance(raw, RawDML)
    codec = TableCodec(schema)
    return verify_changes(codec, codec.decode_changes([raw]), [raw])


def _fast_path(encoder: MessageEncoder, schema: TableSchema, dml: DML) -> list[int]:
    """The typed columnar checksums of the DML's images, in change order (old image first)."""
    raw = MessageDecoder().decode(encoder.encode(dml, schema))
    codec = TableCodec(schema)
    return image_checksums(codec.columns, codec.decode_changes([raw]).rows)  # type: ignore[list-item]


@pytest.mark.parametrize("mysql_type", ALL_MYSQL_TYPES)
@PROPERTY
@given(data=st.data())
def test_an_encoded_checksum_verifies_for_every_column_type(mysql_type: str, data: st.DataObject) -> None:
    encoder, schema, dml = data.draw(_checksummed_dmls(mysql_type))
    assert dml.checksum is not None
    images = (dml.data is not None and dml.checksum.current != 0) + (
        dml.old is not None and dml.checksum.previous != 0
    )
    assert _verify(encoder, schema, dml) == (images, {})
    expected = [
        c for c, image in ((dml.checksum.previous, dml.old), (dml.checksum.current, dml.data)) if image
    ]
    assert _fast_path(encoder, schema, dml) == expected  # the columnar path alone, no settling


@PROPERTY
@given(_checksummed_dmls(), st.data())
def test_any_single_changed_value_fails_verification(
    drawn: tuple[MessageEncoder, TableSchema, DML], data: st.DataObject
) -> None:
    encoder, schema, dml = drawn
    codec = encoder.table_codec(schema)
    image = data.draw(st.sampled_from([name for name in ("data", "old") if getattr(dml, name) is not None]))
    row = dict(getattr(dml, image))
    column = data.draw(st.sampled_from(schema.columns))
    changed = data.draw(values(column))
    wire = codec.columns[schema.columns.index(column)].to_json
    assume(wire(changed) != wire(row[column.name]))
    tampered = msgspec.structs.replace(dml, **{image: row | {column.name: changed}})
    _, rejected = _verify(encoder, schema, tampered)
    assert isinstance(rejected.get(0), ChecksumMismatchError)
    assert f"on the {'new' if image == 'data' else 'old'} image" in rejected[0].reason
