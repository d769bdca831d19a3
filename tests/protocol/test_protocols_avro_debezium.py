"""TiCDC Avro and Debezium: the registry fixture through the real client, golden shapes from the specs, and
`decode(encode(x)) == x` for every column type, as far as each wire carries it."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.errors import (
    DependencyError,
    MalformedMessageError,
    SchemaRegistryError,
    UnknownSchemaError,
    UnsupportedTypeError,
    ValueDecodeError,
)
from consumer.protocol.avro_container import zigzag
from consumer.protocol.compression import Compression
from consumer.protocol.debezium.decoder import DEBEZIUM, DebeziumDecoder
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import (
    DDL,
    DML,
    Column,
    DataType,
    DDLType,
    DMLType,
    Index,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.plain import message_object
from consumer.protocol.table import TableCodec
from consumer.protocol.ticdc_avro.decoder import ConfluentAvroDecoder, TicdcAvroProtocol
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions, sanitized
from consumer.protocol.types import ValuePolicy
from consumer.state.resolver import TableScope
from consumer.testing.registry import LocalSchemaRegistry
from consumer.testing.strategies import (
    ChangeView,
    avro_changes,
    avro_options,
    avro_table_schemas,
    debezium_changes,
    debezium_options,
    debezium_table_schemas,
)

COMMIT_TS = 449_811_223_446_634_498  # a TSO of 2024
PROPERTY = settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


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


@pytest.mark.parametrize("answer", [[{"schema": "{}"}], "text", {}, {"schema": 5}], ids=repr)
def test_a_registry_answer_that_is_no_schema_stops_the_run_naming_it(answer: Any) -> None:
    """Known bug of issue 26: a JSON array for `/schemas/ids/N` stopped the run with the client's internal
    `TypeError: pop expected at most 1 argument, got 2`. The registry's fault (a stop, not a dead letter),
    named by the URL asked (without the credentials) and the id."""
    with LocalSchemaRegistry() as server:
        server.answers["/schemas/ids/7"] = answer
        registry = SchemaRegistry(server.url.replace("http://", "http://user:secret@"))
        with pytest.raises(SchemaRegistryError) as caught:
            registry.schema(7)
    assert str(caught.value).startswith(f"the schema registry answered {server.url}/schemas/ids/7 with ")
    assert "not a schema" in str(caught.value) and "secret" not in str(caught.value)


def test_avro_golden_record_shapes(schema_registry: LocalSchemaRegistry) -> None:
    """Spec §3.2: tombstones, the watermark-mode markers and DDL JSON, bad framing."""
    decoder = ConfluentAvroDecoder(SchemaRegistry(schema_registry.url))
    checkpoint = decoder.decode_record(None, b"\x02" + (449_811_300_000_000_000).to_bytes(8, "big"))
    assert checkpoint == Watermark(commit_ts=449_811_300_000_000_000, build_ts=0)
    ddl = decoder.decode_record(
        None, b'\x01{"query":"TRUNCATE TABLE `t`","type":11,"schema":"db","table":"t","commitTs":7}'
    )
    assert (ddl.type.value, ddl.commit_ts, ddl.table_schema.table) == ("TRUNCATE", 7, "t")  # type: ignore[union-attr]
    alter = decoder.decode_record(
        None, b'\x01{"query":"ALTER TABLE `t` ADD `c` int","type":5,"schema":"db","table":"t","commitTs":7}'
    )
    assert alter.type.value == "ALTER" and alter.table_schema.columns == ()  # type: ignore[union-attr]
    scope = TableScope.of(alter)  # type: ignore[arg-type]
    assert scope.covers(("db", "t"), set()) and not scope.covers(("db", "other"), set())  # its table only
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
        AvroOptions(include_before=True),
        AvroOptions(tidb_extension=True, watermark=True),
        None,
    ],
    ids=["default", "strings-checksums", "before-value", "before-value-only", "watermark-mode", "any"],
)
@PROPERTY
@given(data=st.data())
def test_avro_round_trip_every_type(
    schema_registry: LocalSchemaRegistry, options: AvroOptions | None, data: Any
) -> None:
    """`decode(encode(x)) == x` as far as the wire carries it (`avro_view`), through the public
    strategies: one of each change of a table, decoded one by one, as a batch and as change images."""
    registry = SchemaRegistry(schema_registry.url)
    options = options or data.draw(avro_options())
    schema = data.draw(avro_table_schemas(max_columns=6))
    changes = [data.draw(avro_changes(registry, options, schema, kind)) for kind in DMLType]
    decoder = ConfluentAvroDecoder(registry)
    raws = [decoder.decode_record(change.key, change.value) for change in changes]
    assert all(isinstance(raw, RawDML) for raw in raws)
    derived = decoder.described_schema(raws[0].schema_key)  # type: ignore[union-attr]
    assert derived is not None and derived.handle_key() == ("id",)
    codec = TableCodec(derived, protocol=TicdcAvroProtocol(registry))
    assert [ChangeView.of(codec.decode(raw)) for raw in raws] == [c.expected for c in changes]  # type: ignore[arg-type]
    images = codec.decode_changes(raws)  # type: ignore[arg-type]
    assert images.rows.num_rows == (4 if options.include_before else 3)
    batch = codec.decode_batch(raws)  # type: ignore[arg-type]
    assert batch.has_data == [True, True, False]
    assert batch.old.to_pylist()[2]["id"] == changes[2].change.old["id"]  # type: ignore[index]


@pytest.mark.parametrize(
    "options",
    [
        DebeziumOptions(tidb_extension=True),
        DebeziumOptions(),
        DebeziumOptions(disable_schema=True),
        DebeziumOptions(tidb_extension=True, disable_schema=True, output_old_value=False, compression="lz4"),
        DebeziumOptions(tidb_extension=True, compression="snappy"),
        None,
    ],
    ids=["extension", "connect-types", "schema-less", "schema-less-compressed", "snappy", "any"],
)
@PROPERTY
@given(data=st.data())
def test_debezium_round_trip_every_type(options: DebeziumOptions | None, data: Any) -> None:
    """As for Avro, with and without the schema envelope (without it each column holds its JSON value)."""
    options = options or data.draw(debezium_options())
    schema = data.draw(debezium_table_schemas(max_columns=6))
    changes = [data.draw(debezium_changes(options, schema, kind)) for kind in DMLType]
    decoder = DebeziumDecoder("snappy" if options.compression == "snappy" else "auto")  # snappy: configured
    raws = [decoder.decode_record(change.key, change.value) for change in changes]
    derived = decoder.described_schema(raws[0].schema_key)  # type: ignore[union-attr]
    assert derived is not None and derived.handle_key() == ("id",)
    codec = TableCodec(derived, protocol=DEBEZIUM)
    assert [ChangeView.of(codec.decode(raw)) for raw in raws] == [c.expected for c in changes]  # type: ignore[arg-type]
    images = codec.decode_changes(raws)  # type: ignore[arg-type]
    assert images.rows.num_rows == (4 if options.output_old_value else 3)


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


def test_a_ticdc_avro_database_level_ddl_names_its_database() -> None:
    """A watermark-mode DDL of a database (`schema` set, `table` empty) keeps its database, as Debezium's."""
    ddl = DDL(
        type=DDLType.QUERY, sql="CREATE DATABASE `test`", commit_ts=COMMIT_TS, build_ts=0, database="test"
    )
    value = ConfluentAvroEncoder(SchemaRegistry("http://127.0.0.1:9"), AvroOptions()).encode_ddl(ddl, 1)
    decoded = ConfluentAvroDecoder(SchemaRegistry("http://127.0.0.1:9")).decode_record(None, value)
    assert isinstance(decoded, DDL) and decoded.table_schema is None
    assert decoded.database_name() == "test"
    assert decoded == ddl


def test_a_debezium_database_level_ddl_names_its_database() -> None:
    """Known bug of issue 26: `CREATE DATABASE test` (spec §8: `source.db` and `databaseName` name the
    database, `tableChanges` is empty) decoded with database null, in the decode output and the DDL log."""
    create = {
        "payload": {
            "source": {"db": "test", "table": "", "commit_ts": COMMIT_TS},
            "ts_ms": 1, "databaseName": "test", "schemaName": None, "ddl": "CREATE DATABASE `test`",
            "tableChanges": [],
        }
    }  # fmt: skip
    ddl = DebeziumDecoder().decode_record(b'{"payload":{"databaseName":"test"}}', json.dumps(create).encode())
    assert isinstance(ddl, DDL) and ddl.table_schema is None  # a barrier for every table
    assert (ddl.type, ddl.database_name()) == (DDLType.QUERY, "test")
    assert message_object(ddl)["database"] == "test" and message_object(ddl)["table"] is None
    key, value = DebeziumEncoder().encode_ddl(ddl)
    assert DebeziumDecoder().decode_record(key, value) == ddl  # the encoder writes it back


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
    codec = TableCodec(decoder.described_schema(raws[0].schema_key), protocol=TicdcAvroProtocol(registry))  # type: ignore[arg-type, union-attr]
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
    assert codec.stats.unrepresentable == 2


@pytest.mark.parametrize("compression", ["lz4", "snappy"])
def test_debezium_compressed_keys_decode_as_their_values(compression: Compression) -> None:
    """TiCDC compresses the key as well as the value (spec §2): the key names the key columns."""
    schema = _schema(Column("a", DataType("int"), nullable=True))
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True, compression=compression))
    decoder = DebeziumDecoder(compression)
    raw = decoder.decode_record(*encoder.encode_dml(_dml(schema, DMLType.INSERT, {"id": 1, "a": 2}), schema))
    derived = decoder.described_schema(raw.schema_key)  # type: ignore[union-attr]
    assert derived is not None and derived.handle_key() == ("id",)
    assert TableCodec(derived, protocol=DEBEZIUM).decode(raw).data == {"id": 1, "a": 2}  # type: ignore[arg-type]


def _debezium_insert(compression: Compression = "none") -> tuple[bytes, bytes]:
    schema = _schema(Column("a", DataType("int"), nullable=True))
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True, compression=compression))
    key, value = encoder.encode_dml(_dml(schema, DMLType.INSERT, {"id": 1, "a": 2}), schema)
    assert key is not None and value is not None
    return key, value


@pytest.mark.parametrize(
    ("part", "bad", "words"),
    [
        ("value", b"\xff\xfe not JSON", "needs compression = snappy"),  # was compression-bomb
        ("value", b'[{"payload": {}}]', "JSON: expected an object, got an array"),  # was compression-invalid
        ("key", b"not JSON", "invalid Debezium key"),  # was compression-invalid
    ],
    ids=["invalid-utf8", "json-array", "non-json-key"],
)
def test_debezium_bytes_that_are_no_json_document_are_malformed_not_a_guessed_snappy(
    part: str, bad: bytes, words: str
) -> None:
    """Known bug of issue 26: under compression `auto` every value not starting with `{` was taken for a
    snappy block, so invalid UTF-8 was a `compression-bomb` and an array or a bad key `compression-invalid`.
    TiCDC compresses Debezium records only when configured, and a snappy block carries no mark: `auto`
    recognises LZ4 alone, and the rest is JSON or malformed."""
    key, value = _debezium_insert()
    record = (bad, value) if part == "key" else (key, bad)
    with pytest.raises(MalformedMessageError, match=re.escape(words)) as caught:
        DebeziumDecoder().decode_record(*record)
    assert caught.value.code == "malformed-message"


def test_debezium_auto_compression_recognises_lz4_and_leaves_snappy_to_the_setting() -> None:
    assert isinstance(DebeziumDecoder().decode_record(*_debezium_insert("lz4")), RawDML)
    key, value = _debezium_insert("snappy")
    assert isinstance(DebeziumDecoder("snappy").decode_record(key, value), RawDML)
    with pytest.raises(MalformedMessageError, match="needs compression = snappy"):
        DebeziumDecoder().decode_record(key, value)


@pytest.mark.parametrize("disable_schema", [False, True])
def test_a_debezium_table_of_json_columns_only_keeps_its_documents(disable_schema: bool) -> None:
    """Known bug of issue 14: a typed table whose every column is JSON (legal without a primary key) was taken
    for a schema-less one, so each document arrived as the string of its wire text."""
    schema = TableSchema("db", "t", 1, 1, (Column("j", DataType("json"), nullable=True),), ())
    document = {"a": [1, "x"], "b": None}
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True, disable_schema=disable_schema))
    decoder = DebeziumDecoder()
    raw = decoder.decode_record(*encoder.encode_dml(_dml(schema, DMLType.INSERT, {"j": document}), schema))
    codec = TableCodec(decoder.described_schema(raw.schema_key), protocol=DEBEZIUM)  # type: ignore[arg-type, union-attr]
    stored = codec.decode_changes([raw]).rows.column("j").to_pylist()  # type: ignore[list-item]
    if disable_schema:  # the wire's JSON: a JSON column's value is its document as a string
        assert json.loads(stored[0]) == json.dumps(document, separators=(", ", ": "), sort_keys=True)
    else:
        assert codec.decode(raw).data == {"j": document}  # type: ignore[arg-type]
        assert json.loads(stored[0]) == document


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
    codec = TableCodec(decoder.described_schema(raws[0].schema_key), protocol=DEBEZIUM)  # type: ignore[arg-type, union-attr]
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
    bad = value.replace(b'"db":"db"', b'"db":"d\xff"')
    at = bad.index(b"\xff") - bad.index(b'"payload":') - len(b'"payload":')  # offsets are the payload's
    with pytest.raises(MalformedMessageError) as caught:
        decoder.decode_record(key, bad)
    assert str(caught.value) == f"invalid Debezium payload: invalid UTF-8 at byte {at} (0xff), in `source.db`"
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
        TableCodec(untyped.described_schema(raw.schema_key), protocol=DEBEZIUM).decode(bad)  # type: ignore[arg-type, union-attr]
    assert caught.value.column == "a"


@pytest.mark.parametrize("protocol", ["avro", "debezium"])
def test_an_enum_element_ending_in_a_backslash_before_another_is_not_on_the_wire(
    schema_registry: LocalSchemaRegistry, protocol: str
) -> None:
    """ENUM (and Avro SET) elements travel joined by `,`, a comma inside one escaped as `\\,`, a backslash
    not escaped (both specs): ('x\\', 'y') is sent as `x\\,y`, exactly as ('x,y') is. The decoder reads the
    latter, so such a column's values are refused (value-decode, naming the column), never mislabelled. A
    last element ending in `\\`, and Debezium's unescaped SET, are carried."""
    registry = SchemaRegistry(schema_registry.url)
    schema = _schema(
        Column("e", DataType("enum", elements=("x\\", "y")), nullable=True),
        Column("last", DataType("enum", elements=("y", "x\\")), nullable=True),
    )
    if protocol == "debezium":
        schema = _schema(
            *schema.columns[1:], Column("s", DataType("set", elements=("x\\", "y")), nullable=True)
        )
    decoder: Any = ConfluentAvroDecoder(registry) if protocol == "avro" else DebeziumDecoder()

    def decoded(row: dict[str, Any]) -> dict[str, Any] | None:
        names = {c.name for c in schema.columns}
        dml = _dml(schema, DMLType.INSERT, {"id": 1, **{k: v for k, v in row.items() if k in names}})
        pair = (
            ConfluentAvroEncoder(registry, AvroOptions()).encode_dml(dml, schema, "tidb_db_t")
            if protocol == "avro"
            else DebeziumEncoder(DebeziumOptions(tidb_extension=True)).encode_dml(dml, schema)
        )
        raw = decoder.decode_record(*pair)
        derived = decoder.described_schema(raw.schema_key)
        assert dict((c.name, c.data_type.elements) for c in derived.columns)["e"] == ("x,y",)
        return TableCodec(derived, protocol=decoder.protocol).decode(raw).data

    carried = {"id": 1, "e": None, "last": "x\\", "s": "x\\,y"}
    assert decoded(carried) == {k: v for k, v in carried.items() if protocol == "debezium" or k != "s"}
    for label in ("x\\", "y"):
        with pytest.raises(ValueDecodeError) as caught:
            decoded({"e": label, "last": "y", "s": ""})
        assert caught.value.column == "e"
