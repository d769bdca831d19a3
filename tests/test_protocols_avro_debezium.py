"""TiCDC Avro and Debezium: the registry fixture through the real client, golden shapes from the specs, and
`decode(encode(x)) == x` for every column type, as far as each wire carries it."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from consumer.errors import (
    DependencyError,
    MalformedMessageError,
    UnknownSchemaError,
    UnsupportedTypeError,
    ValueDecodeError,
)
from consumer.protocol.avro_rows import zigzag
from consumer.protocol.compression import Compression
from consumer.protocol.confluent_avro import (
    AvroOptions,
    ConfluentAvroDecoder,
    ConfluentAvroEncoder,
    sanitized,
)
from consumer.protocol.debezium import DebeziumDecoder, DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import DML, Column, DataType, DMLType, Index, RawDML, TableSchema, Watermark
from consumer.protocol.registry import SchemaRegistry
from consumer.protocol.rows import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.testing.registry import LocalSchemaRegistry
from consumer.testing.strategies import rows, table_schemas

COMMIT_TS = 449_811_223_446_634_498  # a TSO of 2024
PROPERTY = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _plain_names(schema: TableSchema) -> TableSchema:
    """Names Avro keeps as they are (it sanitizes the others, spec §4.6)."""
    columns = tuple(
        msgspec.structs.replace(c, name=f"c{i}" if i else "id") for i, c in enumerate(schema.columns)
    )
    return msgspec.structs.replace(schema, database="db", table="t", columns=columns)


def _dml(schema: TableSchema, kind: DMLType, data: Any = None, old: Any = None, ts: int = COMMIT_TS) -> DML:
    return DML(
        type=kind, database=schema.database, table=schema.table, table_id=schema.table_id, commit_ts=ts,
        build_ts=0, schema_version=schema.version, data=data, old=old,
    )  # fmt: skip


def test_registry_fixture_through_the_real_client_with_basic_auth() -> None:
    with LocalSchemaRegistry(credentials=("user", "secret")) as server:
        record = {"type": "record", "name": "t", "fields": [{"name": "a", "type": "int"}]}
        registry = SchemaRegistry(server.url, {"basic.auth.user.info": "user:secret"})
        schema_id = registry.register("topic-value", record)
        assert registry.register("other-value", record) == schema_id  # identical text, one id
        assert (
            SchemaRegistry(server.url.replace("http://", "http://user:secret@")).schema(schema_id) == record
        )
        requests = server.requests
        assert registry.schema(schema_id) == record and server.requests == requests  # cached
        with pytest.raises(UnknownSchemaError):
            registry.schema(999)
        with pytest.raises(DependencyError):
            SchemaRegistry(server.url).schema(schema_id)  # 401 without credentials: the registry's fault
    with pytest.raises(DependencyError):
        SchemaRegistry(server.url).schema(schema_id)  # stopped: unreachable


def test_avro_golden_record_shapes(schema_registry: LocalSchemaRegistry) -> None:
    """Spec §3.2: tombstones, the watermark-mode markers and DDL JSON, bad framing."""
    decoder = ConfluentAvroDecoder(SchemaRegistry(schema_registry.url))
    checkpoint = decoder.decode_record(None, b"\x02" + (449_811_300_000_000_000).to_bytes(8, "big"))
    assert checkpoint == Watermark(commit_ts=449_811_300_000_000_000, build_ts=0)
    ddl = decoder.decode_record(
        None, b'\x01{"query":"TRUNCATE TABLE `t`","type":11,"schema":"db","table":"t","commitTs":7}'
    )
    assert (ddl.type.value, ddl.commit_ts, ddl.table_schema.table) == ("TRUNCATE", 7, "t")  # type: ignore[union-attr]
    for bad in (b"\x07abc", b"\x00\x00", b"\x02short"):
        with pytest.raises(MalformedMessageError):
            decoder.decode_record(None, bad)
    with pytest.raises(MalformedMessageError):
        decoder.decode_record(None, None)
    assert sanitized("1abc") == "_1abc" and sanitized("a-b") == "a_b" and sanitized("测试") == "__"


@pytest.mark.parametrize(
    "options",
    [
        AvroOptions(),
        AvroOptions(tidb_extension=True, checksum=True, decimal="string", bigint_unsigned="string"),
        AvroOptions(tidb_extension=True, include_before=True, bit_bytes="minimal"),
        AvroOptions(tidb_extension=True, watermark=True),
    ],
    ids=["default", "strings-checksums", "before-value", "watermark-mode"],
)
@PROPERTY
@given(data=st.data())
def test_avro_round_trip_every_type(
    schema_registry: LocalSchemaRegistry, options: AvroOptions, data: Any
) -> None:
    schema = _plain_names(data.draw(table_schemas(max_columns=6)))
    # an element ending in `\` before the next one's comma reads as an escaped comma (the wire's ambiguity)
    assume(not any(e.endswith("\\") for c in schema.columns for e in c.data_type.elements))
    registry = SchemaRegistry(schema_registry.url)
    encoder = ConfluentAvroEncoder(registry, options)
    decoder = ConfluentAvroDecoder(registry)
    new, old = data.draw(rows(schema)), data.draw(rows(schema))
    dmls = [
        _dml(schema, DMLType.INSERT, new),
        _dml(schema, DMLType.UPDATE, new, old),
        _dml(schema, DMLType.DELETE, old=old),
    ]
    raws = [decoder.decode_record(*encoder.encode_dml(dml, schema, "tidb_db_t")) for dml in dmls]
    assert all(isinstance(raw, RawDML) for raw in raws)
    derived = decoder.described_schema(raws[0].schema_key)  # type: ignore[union-attr]
    assert derived is not None and derived.handle_key() == ("id",)
    codec = TableCodec(derived, registry=registry)
    decoded = [codec.decode(raw) for raw in raws]  # type: ignore[arg-type]
    assert decoded[0].data == new and decoded[1].data == new
    if options.include_before:
        assert decoded[1].old == old and decoded[2].old == old
    else:
        assert decoded[2].old == {"id": old["id"]}  # a tombstone: the key only
    if options.tidb_extension:
        assert [d.type for d in decoded] == [DMLType.INSERT, DMLType.UPDATE, DMLType.DELETE]
        assert decoded[0].commit_ts == COMMIT_TS
    changes = codec.decode_changes(raws)  # type: ignore[arg-type]
    assert changes.rows.num_rows == (4 if options.include_before else 3)


def _debezium_view(schema: TableSchema, row: dict[str, Any]) -> dict[str, Any]:
    """What Debezium's wire carries of a typed row (spec §6): DECIMAL as float64, years below 100 shifted."""
    out = {}
    for column in schema.columns:
        value, kind = row.get(column.name), column.data_type.mysql_type
        if value is not None and kind == "decimal":
            value = float(value)
        elif value is not None and kind in ("date", "datetime") and value.year < 100:
            value = value.replace(year=value.year + (2000 if value.year < 70 else 1900))
        if value is not None and kind == "datetime" and column.data_type.decimal <= 3:
            value = value.replace(microsecond=value.microsecond // 1000 * 1000)
        out[column.name] = value
    return out


@PROPERTY
@given(data=st.data())
def test_debezium_round_trip_every_type_with_the_extension(data: Any) -> None:
    schema = data.draw(table_schemas(max_columns=6))
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True))
    decoder = DebeziumDecoder()
    new, old = data.draw(rows(schema)), data.draw(rows(schema))
    dmls = [
        _dml(schema, DMLType.INSERT, new),
        _dml(schema, DMLType.UPDATE, new, old),
        _dml(schema, DMLType.DELETE, old=old),
    ]
    raws = [decoder.decode_record(*encoder.encode_dml(dml, schema)) for dml in dmls]
    derived = decoder.described_schema(raws[0].schema_key)  # type: ignore[union-attr]
    assert derived is not None and derived.handle_key() == ("id",)
    codec = TableCodec(derived)
    decoded = [codec.decode(raw) for raw in raws]  # type: ignore[arg-type]
    assert [d.type for d in decoded] == [DMLType.INSERT, DMLType.UPDATE, DMLType.DELETE]
    assert decoded[0].data == _debezium_view(schema, new)
    assert decoded[1].old == _debezium_view(schema, old) and decoded[2].old == _debezium_view(schema, old)


def test_debezium_golden_watermark_and_ddl() -> None:
    decoder = DebeziumDecoder()
    watermark = b'{"payload":{"source":{"db":"","table":"","commit_ts":42},"op":"m","ts_ms":1},"schema":{}}'
    assert decoder.decode_record(None, watermark) == Watermark(commit_ts=42, build_ts=0)
    rename = {
        "payload": {
            "source": {"db": "test", "table": "table2", "commit_ts": 9},
            "ddl": "RENAME TABLE test.table1 to test.table2",
            "tableChanges": [{"type": "ALTER", "id": '"test"."table1","test"."table2"', "table": {
                "primaryKeyColumnNames": ["id"],
                "columns": [{"name": "id", "typeName": "INT", "optional": False}],
            }}],
        }
    }  # fmt: skip
    ddl = decoder.decode_record(None, json.dumps(rename).encode())
    assert ddl.type.value == "RENAME"  # type: ignore[union-attr]
    assert (ddl.pre_table_schema.table, ddl.table_schema.table) == ("table1", "table2")  # type: ignore[union-attr]
    with pytest.raises(MalformedMessageError):
        decoder.decode_record(None, b'{"payload":{"op":"x"}}')


# -- found by fuzzing (consumer.testing.protocol_fuzz) and the known bugs of issue 14 -------------------
def _schema(*columns: Column) -> TableSchema:
    key = Column("id", DataType("bigint", length=20), nullable=False)
    return TableSchema("db", "t", 1, 1, (key, *columns), (Index("primary", True, True, False, ("id",)),))


def _int_field(name: str, avro: Any = "int", **extra: Any) -> dict[str, Any]:
    return {"name": name, "type": {"type": avro, "connect.parameters": {"tidb_type": "INT"}}, **extra}


_HOSTILE_WRITERS = {
    "array column": [_int_field("a", {"type": "array", "items": "long"})],
    "map column": [_int_field("a", {"type": "map", "values": "long"})],
    "recursion": [{"name": "a", "type": "t"}],
    "decimal scale beyond precision": [{"name": "a", "type": {
        "type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 12,
        "connect.parameters": {"tidb_type": "DECIMAL"},
    }}],
    "decimal wider than TiDB's": [{"name": "a", "type": {
        "type": "bytes", "logicalType": "decimal", "precision": 100, "scale": 2,
        "connect.parameters": {"tidb_type": "DECIMAL"},
    }}],
    "BIT length not a number": [{"name": "a", "type": {
        "type": "bytes", "connect.parameters": {"tidb_type": "BIT", "length": "x"},
    }}],
    "INT carried as a string": [_int_field("a", "string")],
    "duplicate field": [_int_field("a"), _int_field("a")],
    "default of another type": [_int_field("a", default="x")],
    "commit ts as a string": [
        _int_field("a"),
        {"name": "_tidb_op", "type": "string"},
        {"name": "_tidb_commit_ts", "type": "string"},
        {"name": "_tidb_commit_physical_time", "type": "long"},
    ],
    "extension fields out of order": [
        _int_field("a"),
        {"name": "_tidb_commit_ts", "type": "long"},
        {"name": "_tidb_op", "type": "string"},
        {"name": "_tidb_commit_physical_time", "type": "long"},
    ],
}  # fmt: skip


@pytest.mark.parametrize("fields", _HOSTILE_WRITERS.values(), ids=_HOSTILE_WRITERS.keys())
def test_writer_schemas_not_of_ticdc_shape_never_reach_the_native_reader(
    schema_registry: LocalSchemaRegistry, fields: list[Any]
) -> None:
    """Only records of TiCDC's column and extension fields are handed to polars-avro: anything else is a
    typed error of the record, before any datum is read."""
    registry = SchemaRegistry(schema_registry.url)
    writer = {"type": "record", "name": "t", "namespace": "default.db", "fields": fields}
    schema_id = registry.register("hostile-value", writer)
    with pytest.raises((MalformedMessageError, UnsupportedTypeError)):
        ConfluentAvroDecoder(registry).decode_record(None, b"\x00" + schema_id.to_bytes(4, "big") + b"\x02")


def test_an_avro_int_beyond_32_bits_is_a_value_error_naming_its_row(
    schema_registry: LocalSchemaRegistry,
) -> None:
    """fastavro (the checker behind the native reader) reads an `int` of any width: the batch names it."""
    registry = SchemaRegistry(schema_registry.url)
    writer = {"type": "record", "name": "t", "namespace": "default.db", "fields": [_int_field("a")]}
    frame = b"\x00" + registry.register("int-value", writer).to_bytes(4, "big")
    decoder = ConfluentAvroDecoder(registry)
    raws = [decoder.decode_record(None, frame + zigzag(value)) for value in (7, 1 << 40)]
    codec = TableCodec(decoder.described_schema(raws[0].schema_key), registry=registry)  # type: ignore[arg-type, union-attr]
    assert codec.decode(raws[0]).data == {"a": 7}  # type: ignore[arg-type]
    with pytest.raises(ValueDecodeError) as caught:
        codec.decode_batch(raws)  # type: ignore[arg-type]
    assert caught.value.row == 1


def test_dates_python_cannot_hold_follow_the_unrepresentable_policy() -> None:
    """Arrow parses year 0000 (and a zone can move 9999-12-31 past it): such a value is a zero date to the
    policy (NULL, counted), never an overflow while the rows are read."""
    schema = _schema(
        Column("ts", DataType("timestamp"), nullable=True), Column("dt", DataType("datetime"), nullable=True)
    )
    policy = ValuePolicy()
    codec = TableCodec(schema, policy)
    body = {"id": "1", "ts": {"location": "UTC", "value": "0000-01-01 00:00:00"}, "dt": "0000-03-04 00:00:00"}
    raw = RawDML(
        type=DMLType.INSERT, database="db", table="t", table_id=1, commit_ts=COMMIT_TS, build_ts=0,
        schema_version=1, payload=json.dumps({"data": body}).encode(), encoding="json",
    )  # fmt: skip
    assert codec.decode(raw).data == {"id": 1, "ts": None, "dt": None}
    assert policy.stats.unrepresentable == 2


@pytest.mark.parametrize("compression", ["lz4", "snappy"])
def test_debezium_compressed_keys_decode_as_their_values(compression: Compression) -> None:
    """TiCDC compresses the key as well as the value (spec §2): the key names the key columns."""
    schema = _schema(Column("a", DataType("int"), nullable=True))
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True, compression=compression))
    decoder = DebeziumDecoder(compression)
    raw = decoder.decode_record(*encoder.encode_dml(_dml(schema, DMLType.INSERT, {"id": 1, "a": 2}), schema))
    derived = decoder.described_schema(raw.schema_key)  # type: ignore[union-attr]
    assert derived is not None and derived.handle_key() == ("id",)
    assert TableCodec(derived).decode(raw).data == {"id": 1, "a": 2}  # type: ignore[arg-type]


@pytest.mark.parametrize("disable_schema", [False, True])
@pytest.mark.parametrize("name", ["\\", 'q"uote', "a\\b"])
def test_debezium_columns_whose_names_msgspec_cannot_rename(name: str, disable_schema: bool) -> None:
    """Known bug of issue 14: a BIT(2) column named `\\` failed with 'AA==' (its rows took a dict path that
    skipped the base64 decoding); without the schema, such rows gave zero-filled garbage or 'negative count'
    (`bytes()` of an int)."""
    schema = _schema(
        Column(name, DataType("bit", length=2, unsigned=True), nullable=True),
        Column(name + "2", DataType("bigint"), nullable=True),
    )
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True, disable_schema=disable_schema))
    decoder = DebeziumDecoder()
    new, old = {"id": 1, name: 0, name + "2": -5}, {"id": 1, name: 3, name + "2": None}
    dmls = [_dml(schema, DMLType.INSERT, new), _dml(schema, DMLType.UPDATE, new, old)]
    raws = [decoder.decode_record(*encoder.encode_dml(dml, schema)) for dml in dmls]
    codec = TableCodec(decoder.described_schema(raws[0].schema_key))  # type: ignore[arg-type, union-attr]
    decoded = [codec.decode(raw) for raw in raws]  # type: ignore[arg-type]
    if disable_schema:  # each column's JSON value: BIT(2) as base64 of its little-endian bytes
        assert decoded[1].data == {"id": 1, name: "AA==", name + "2": -5}
        assert decoded[1].old == {"id": 1, name: "Aw==", name + "2": None}
    else:
        assert decoded[0].data == new and decoded[1].old == old
    assert codec.decode_changes(raws).rows.num_rows == 3  # type: ignore[arg-type]


def test_debezium_hostile_shapes_are_typed_errors() -> None:
    decoder = DebeziumDecoder()
    schema = _schema(Column("a", DataType("bit", length=2, unsigned=True), nullable=True))
    key, value = DebeziumEncoder(DebeziumOptions(tidb_extension=True)).encode_dml(
        _dml(schema, DMLType.INSERT, {"id": 1, "a": 1}), schema
    )
    document = json.loads(value)
    before, after = document["schema"]["fields"][:2]
    before["fields"][1]["parameters"] = after["fields"][1]["parameters"] = {"length": "x"}
    with pytest.raises(MalformedMessageError, match="length"):
        decoder.decode_record(key, json.dumps(document).encode())
    before["fields"] = after["fields"] = [True]
    with pytest.raises(MalformedMessageError):
        decoder.decode_record(key, json.dumps(document).encode())
    with pytest.raises(MalformedMessageError):  # invalid UTF-8 inside a string
        decoder.decode_record(key, value.replace(b'"db":"db"', b'"db":"d\xff"'))
    change = {"type": "CREATE", "id": '"db"."t"', "table": {"columns": [False]}}
    source = {"db": "db", "table": "t", "commit_ts": COMMIT_TS}
    ddl = {"payload": {"source": source, "ddl": "CREATE TABLE t", "tableChanges": [change]}}
    with pytest.raises(MalformedMessageError):
        decoder.decode_record(None, json.dumps(ddl).encode())
    untyped = DebeziumDecoder()
    raw = untyped.decode_record(
        *DebeziumEncoder(DebeziumOptions(disable_schema=True)).encode_dml(
            _dml(schema, DMLType.INSERT, {"id": 1, "a": 1}), schema
        )
    )
    assert b'"a":"AQ=="' in raw.payload  # type: ignore[union-attr]
    bad = msgspec.structs.replace(raw, payload=raw.payload.replace(b'"a":"AQ=="', b'"a":"\xff"'))  # type: ignore[type-var, union-attr]
    with pytest.raises(ValueDecodeError) as caught:
        TableCodec(untyped.described_schema(raw.schema_key)).decode(bad)  # type: ignore[arg-type, union-attr]
    assert caught.value.column == "a"
