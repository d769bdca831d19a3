"""What a Spark task must leave to the driver rather than fail the job on: rows of a schema version its
cache holds but `TableCodec` refuses (a valid version served, by table id and version, to a DML naming a
table no TiDB may have; a recorded schema the run's `decode.unknown_types` now refuses; any schema of
`hostile_schemas`), and rows that fail checksum verification. The driver applies the error policy to them,
so the Spark engine ends with the loop engine's dead letters and lake."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from lakehouse_checks import changelog_duplicates, lake_contents, run_to_end, spark_config

from consumer.config import RunConfig
from consumer.errors import ConsumerError
from consumer.lakehouse.tables import read_mirror, table_uri
from consumer.protocol.limits import tso_of
from consumer.protocol.model import (
    DML,
    Bootstrap,
    Checksum,
    Column,
    DataType,
    DMLType,
    Index,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.simulate.output import produce_to_kafka, write_ground_truth
from consumer.simulate.truth import delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.capture import read_capture
from consumer.sources.kafka import capture_topic
from consumer.sources.record import SourceRecord
from consumer.spark import engine
from consumer.spark.segments import Segment, encode_range
from consumer.state.schema_cache import SchemaCache
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.hostile import hostile_schemas
from consumer.testing.messages import table_dml

TS = tso_of(time.time())
TEXT = DataType("varchar", "utf8mb4", "utf8mb4_bin", length=40)
KEY = Column("id", DataType("bigint", length=20), nullable=False)
SCHEMA = TableSchema(
    "shop", "orders", 7, 3, (KEY, Column("note", TEXT)), (Index("primary", True, True, False, ("id",)),)
)
BAD = msgspec.structs.replace(SCHEMA, table="bad", table_id=8)
REFUSED_SCHEMAS = {
    "duplicate-column": msgspec.structs.replace(BAD, columns=(KEY, Column("a", TEXT), Column("A", TEXT))),
    "empty-column-name": msgspec.structs.replace(BAD, columns=(KEY, Column("", TEXT))),
    "decimal-precision-2^31": msgspec.structs.replace(
        BAD, columns=(KEY, Column("d", DataType("decimal", length=2**31, decimal=2)))
    ),
    "key-column-missing": msgspec.structs.replace(
        BAD, indexes=(Index("primary", True, True, False, ("missing",)),)
    ),
    "table-name-of-300-characters": msgspec.structs.replace(BAD, table="x" * 300),
}
# Names no table may have, on a DML naming a valid version's table id and version (what RENAME keeps).
HOSTILE_TABLE_NAMES = ("x" * 300, "", "nul\x00in", "trailing ")
ENCODER = MessageEncoder()


def _row(
    schema: TableSchema, row_id: int, *, table: str | None = None, checksum: Checksum | None = None
) -> bytes:
    """A JSON DML written by hand (the encoder refuses hostile schemas), maybe under another table name."""
    document: dict[str, Any] = {
        "version": 1,
        "database": schema.database,
        "table": schema.table if table is None else table,
        "tableID": schema.table_id,
        "type": "INSERT",
        "commitTs": TS + row_id,
        "buildTs": 0,
        "schemaVersion": schema.version,
        "data": {"id": str(row_id), "note": f"n{row_id}"},
    }
    if checksum is not None:
        document["checksum"] = msgspec.to_builtins(checksum)
    return json.dumps(document).encode()


def _segment(
    values: list[bytes], schemas: SchemaCache | None = None, policy: ValuePolicy | None = None
) -> Segment:
    records = [SourceRecord("t", 0, offset, value=value) for offset, value in enumerate(values)]
    policy = policy or ValuePolicy()
    segment = encode_range(
        "t", 0, 0, len(records), records, schemas or SchemaCache(), MessageDecoder(policy=policy), policy
    )
    return Segment.from_row(segment.to_row())  # through the wire form the driver reads


def _typed(segment: Segment) -> list[int]:
    return sorted({o for table in segment.changes.values() for o in table["_offset"].to_pylist()})


def _kept(segment: Segment) -> list[int]:
    """The offsets the task left to the driver, with their values."""
    return [location.offset for location, _, _, _ in segment.decoded(MessageDecoder())]


def _recorded(schema: TableSchema) -> SchemaCache:
    """A task's cache as restored from the engine's recorded schemas, `schema` among them."""
    cache = SchemaCache()
    cache.add(schema)
    return SchemaCache.restore(cache.snapshot())


@pytest.mark.parametrize("case", sorted(REFUSED_SCHEMAS))
def test_a_task_leaves_the_rows_of_a_recorded_schema_its_codec_refuses_to_the_driver(case: str) -> None:
    schema = REFUSED_SCHEMAS[case]
    with pytest.raises(ConsumerError):
        TableCodec(schema)
    values = [ENCODER.encode(Bootstrap(table_schema=SCHEMA, build_ts=0)), _row(SCHEMA, 1), _row(schema, 2)]
    segment = _segment([*values, _row(SCHEMA, 3)], _recorded(schema))
    assert _typed(segment) == [1, 3]
    assert _kept(segment) == [0, 2]
    assert list(segment.changes) == [SCHEMA.key]


@pytest.mark.parametrize("name", HOSTILE_TABLE_NAMES)
def test_a_valid_version_served_under_a_name_no_table_may_have_is_left_to_the_driver(name: str) -> None:
    """`SchemaCache.lookup` serves a DML the version its table id and version name (as after a RENAME):
    renamed to a name TiDB never allows, `TableCodec` refuses that schema."""
    bootstrap = ENCODER.encode(Bootstrap(table_schema=SCHEMA, build_ts=0))
    segment = _segment([bootstrap, _row(SCHEMA, 1), _row(SCHEMA, 2, table=name), _row(SCHEMA, 3)])
    assert _typed(segment) == [1, 3]
    assert _kept(segment) == [0, 2]


def test_a_recorded_schema_the_runs_unknown_types_policy_refuses_is_left_to_the_driver() -> None:
    """Recorded under `decode.unknown_types = lossless`, run under "error"."""
    shape = msgspec.structs.replace(BAD, columns=(KEY, Column("note", DataType("geometry"))))
    segment = _segment([_row(shape, 1), _row(shape, 2)], _recorded(shape), ValuePolicy(unknown_types="error"))
    assert (_typed(segment), _kept(segment)) == ([], [0, 1])
    lossless = _segment([_row(shape, 1), _row(shape, 2)], _recorded(shape))
    assert (_typed(lossless), _kept(lossless)) == ([0, 1], [])


def test_rows_that_fail_checksum_verification_are_left_to_the_driver_and_the_rest_typed() -> None:
    wrong = Checksum(version=1, corrupted=False, current=12345, previous=0)
    corrupted = Checksum(version=1, corrupted=True, current=0, previous=0)
    bootstrap = ENCODER.encode(Bootstrap(table_schema=SCHEMA, build_ts=0))
    rows = [_row(SCHEMA, 1), _row(SCHEMA, 2, checksum=wrong), _row(SCHEMA, 3, checksum=corrupted)]
    segment = _segment([bootstrap, *rows, _row(SCHEMA, 4)])
    assert _typed(segment) == [1, 4]
    assert _kept(segment) == [0, 2, 3]


@settings(max_examples=150)
@given(hostile_schemas())
def test_a_task_never_raises_on_a_hostile_schema_in_its_cache(schema: TableSchema) -> None:
    """Whatever schema the cache holds, a row of it is typed by the task or left to the driver, never
    raised; typed only if `TableCodec` takes the schema."""
    cache = SchemaCache()
    cache.add(schema)
    segment = _segment([_row(schema, 1), _row(SCHEMA, 2)], cache)
    assert sorted([*_typed(segment), *_kept(segment)]) == [0, 1]
    try:
        TableCodec(schema)
    except ConsumerError:
        assert 0 in _kept(segment)


# -- both engines -----------------------------------------------------------------------------------------
# A valid table whose column names are the changelog's metadata names (stored with one more underscore).
META = TableSchema(
    "shop",
    "meta",
    9001,
    5,
    (KEY, Column("_commit_ts", TEXT), Column("_OFFSET", DataType("int", length=11))),
    (Index("primary", True, True, False, ("id",)),),
)
FRESH_ID = 1_000_000  # above every id the workload gives


def _dml(schema: TableSchema, data: dict[str, Any], commit_ts: int, checksum: Checksum | None = None) -> DML:
    return table_dml(schema, DMLType.INSERT, data, commit_ts=commit_ts, checksum=checksum)


def _hostile_tail(workload: Workload) -> tuple[list[tuple[int, bytes]], list[tuple[bytes, str]]]:
    """After the workload: BOOTSTRAPs of refused schemas and a row of each, a valid table's row under a
    300-character table name and one with a wrong checksum (each after a BOOTSTRAP of that table, so the
    task knows it), the metadata-named table's BOOTSTRAP and rows, a WATERMARK on each partition. The
    (partition, value)s, and the values that must be dead-lettered with their reason codes."""
    ts = workload.last_watermark
    table = workload.tables[1]
    row = dict(next(iter(table.rows.values())))
    valid_bootstrap = ENCODER.encode(Bootstrap(table_schema=table.schema, build_ts=0))
    aliased = json.loads(ENCODER.encode(_dml(table.schema, row | {"id": FRESH_ID}, ts + 1), table.schema))
    aliased["table"] = "x" * 300
    alias = json.dumps(aliased).encode()
    wrong = Checksum(version=1, corrupted=False, current=12345, previous=0)
    mismatch = ENCODER.encode(_dml(table.schema, row | {"id": FRESH_ID + 1}, ts + 2, wrong), table.schema)
    letters: list[tuple[bytes, str]] = [(alias, "schema-rejected"), (mismatch, "checksum-mismatch")]
    tail = [(1, valid_bootstrap), (1, alias), (0, valid_bootstrap), (0, mismatch)]
    for index, name in enumerate(("duplicate-column", "empty-column-name", "decimal-precision-2^31")):
        schema = msgspec.structs.replace(REFUSED_SCHEMAS[name], table=f"bad{index}", table_id=100 + index)
        bootstrap = ENCODER.encode(Bootstrap(table_schema=schema, build_ts=0))
        bad_row = json.loads(_row(schema, index)) | {"commitTs": ts + 3}
        rejected = json.dumps(bad_row).encode()
        tail += [(index % 2, bootstrap), (index % 2, rejected)]
        letters += [(bootstrap, "schema-rejected"), (rejected, "schema-rejected")]
    tail.append((1, ENCODER.encode(Bootstrap(table_schema=META, build_ts=0))))
    for key in (1, 2, 3):
        data = {"id": key, "_commit_ts": f"not {key}", "_OFFSET": -key}
        tail.append((1, ENCODER.encode(_dml(META, data, ts + 3 + key), META)))
    final = ENCODER.encode(Watermark(commit_ts=ts + 10, build_ts=0))
    return [*tail, (0, final), (1, final)], letters


def _spark_config(broker: EmbeddedBroker, topic: str, root: Path, checkpoint: Path) -> RunConfig:
    return spark_config(broker, topic, f"{topic}.spark", root, checkpoint, {"max_batch_records": 300})


def _dead_letters(root: Path) -> list[tuple[int, int, str, str]]:
    path = root / "_dead_letters.jsonl"
    letters = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return sorted((d["partition"], d["offset"], d["reason_code"], d["reason"]) for d in letters)


@pytest.mark.slow
def test_hostile_schemas_end_in_the_same_dead_letters_and_lake_through_both_engines(
    spark: Any, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(2)
    workload = Workload(WorkloadConfig(rows=600, tables=2, partitions=2, ddl=False, dispatch="primary-key"))
    produce_to_kafka(workload, ENCODER, kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    tail, letters = _hostile_tail(workload)
    kafka_broker.produce(topic, [(partition, None, value) for partition, value in tail])
    capture_topic(kafka_broker.bootstrap_servers, topic, tmp_path / "all.jsonl", idle_seconds=1.0)
    located = {r.value: (r.partition, r.offset) for r in read_capture(tmp_path / "all.jsonl")}
    expected = sorted((*located[value], code) for value, code in letters)

    lake = tmp_path / "spark"
    config = _spark_config(kafka_broker, topic, lake, tmp_path / "checkpoint")
    stats = engine.run(config, until_idle=2.0, spark=spark)
    loop = tmp_path / "loop"
    code, log = run_to_end(kafka_broker, topic, f"{topic}.loop", f"delta:{loop}", tmp_path / "log")
    assert code == 0, log.read_text()[-3000:]

    spark_letters, loop_letters = _dead_letters(lake), _dead_letters(loop)
    assert [letter[:3] for letter in loop_letters] == expected
    assert spark_letters == loop_letters  # reasons too
    assert stats.dead_letters == len(expected)
    assert lake_contents(lake) == lake_contents(loop)
    assert differences(delta_mirror_state(lake, (t.schema for t in workload.tables)), truth) == []
    assert changelog_duplicates(lake) == 0
    mirror = read_mirror(lake, "shop", "meta", ["id", "__commit_ts", "__OFFSET"])
    assert mirror is not None
    assert sorted(mirror.to_pylist(), key=lambda row: row["id"]) == [
        {"id": key, "__commit_ts": f"not {key}", "__OFFSET": -key} for key in (1, 2, 3)
    ]
    assert table_uri(lake, "shop", "bad0") is None
