"""End to end for TiCDC's Avro and Debezium protocols: simulator -> real broker (and the registry fixture,
through confluent-kafka's client on both sides) -> `run --protocol ...` -> Delta, mirror against the
simulator's ground truth."""

from __future__ import annotations

import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lakehouse_checks import lake_contents, merge_processes
from pyspark.sql import SparkSession

from consumer.config import load_config
from consumer.lakehouse.progress import consistent_ts
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import DataType
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.simulate.output import AvroStream, DebeziumStream, produce_to_kafka, write_ground_truth
from consumer.simulate.truth import delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.delta import process_name
from consumer.spark import engine
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.registry import LocalSchemaRegistry

pytestmark = pytest.mark.e2e
FAST_GROUP_ENV = {
    "TICDC_CONSUMER_KAFKA_SESSION_TIMEOUT_MS": "3000",
    "TICDC_CONSUMER_KAFKA_HEARTBEAT_INTERVAL_MS": "300",
    "TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": "1000",
}


def _run(broker: EmbeddedBroker, topic: str, root: Path, *flags: str) -> str:
    command = [
        sys.executable,
        "-m",
        "consumer",
        "run",
        "--source",
        f"kafka://{broker.bootstrap_servers}/{topic}",
        "--group",
        f"{topic}.lake",
        "--sink",
        f"delta:{root}",
        "--until-idle",
        "3",
        *flags,
    ]
    result = subprocess.run(
        command, env={**os.environ, **FAST_GROUP_ENV}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _same_through_spark(
    spark: SparkSession, broker: EmbeddedBroker, topic: str, loop_root: Path, **decode: Any
) -> None:
    """The Spark engine, configured as the loop run was, leaves the same lakehouse: every table's changelog
    and mirror, row for row, and no dead letter; its mirrors were MERGEd on the executors (Python workers,
    other processes than this driver), the loop engine's in its own process."""
    root = loop_root.with_name("spark-lake")
    config = load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{broker.bootstrap_servers}/{topic}", "group": f"{topic}.spark"},
            "sink": {"url": f"delta:{root}"},
            "engine": {"kind": "spark"},
            "budget": {"max_batch_records": 1000},
            "decode": decode,
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    assert stats.dead_letters == 0
    assert stats.rows > 0
    assert lake_contents(root) == lake_contents(loop_root)
    merged_in = merge_processes(root)
    assert merged_in and process_name() not in merged_in
    assert len(set(merge_processes(loop_root))) == 1  # the `run` command's one process


def _workload(**options: Any) -> Workload:
    return Workload(
        WorkloadConfig(**{"rows": 3000, "tables": 3, "partitions": 3, "dispatch": "primary-key", **options})
    )


def _mirror(root: Path, workload: Workload, retyped: Any = None) -> dict[str, Any]:
    """The mirrors, read with the types the consumer derived (`retyped`: DataType -> DataType)."""
    schemas = [table.schema for table in workload.tables]
    if retyped is not None:
        schemas = [
            msgspec.structs.replace(
                schema,
                columns=tuple(
                    msgspec.structs.replace(c, data_type=retyped(c.data_type)) for c in schema.columns
                ),
            )
            for schema in schemas
        ]
    return delta_mirror_state(root, schemas)


def _double_decimals(data_type: DataType) -> DataType:
    return DataType("double") if data_type.mysql_type == "decimal" else data_type


def test_avro_without_watermarks_mirror_is_exact_per_key(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    schema_registry: LocalSchemaRegistry,
    tmp_path: Path,
) -> None:
    """TiCDC's default Avro: no commit ts, INSERT and UPDATE alike, DELETE a tombstone, no DDL records:
    rows resolve on arrival, and the mirror still equals the truth (each key lives on one partition); the
    Spark engine leaves the same lake."""
    topic = kafka_topic(3)
    workload = _workload(ddl=False)
    encoder = ConfluentAvroEncoder(SchemaRegistry(schema_registry.url), AvroOptions())
    produce_to_kafka(workload, AvroStream(encoder, topic), kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    out = _run(
        kafka_broker, topic, tmp_path / "lake", "--protocol", "avro", "--schema-registry", schema_registry.url
    )
    assert "0 dead letters" in out
    assert differences(_mirror(tmp_path / "lake", workload), truth) == []
    assert consistent_ts(tmp_path / "lake") is None  # no watermark: no cross-table consistency point
    _same_through_spark(
        spark, kafka_broker, topic, tmp_path / "lake", protocol="avro", schema_registry=schema_registry.url
    )


def test_avro_watermark_mode_with_every_ddl_orders_by_watermark(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    schema_registry: LocalSchemaRegistry,
    tmp_path: Path,
) -> None:
    topic = kafka_topic(3)
    workload = _workload()
    options = AvroOptions(tidb_extension=True, watermark=True, checksum=True, decimal="string")
    encoder = ConfluentAvroEncoder(SchemaRegistry(schema_registry.url), options)
    produce_to_kafka(workload, AvroStream(encoder, topic), kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    flags = ("--protocol", "avro", "--schema-registry", schema_registry.url, "--ordering", "watermark")
    _run(kafka_broker, topic, tmp_path / "lake", *flags)
    assert differences(_mirror(tmp_path / "lake", workload), truth) == []
    assert consistent_ts(tmp_path / "lake") == workload.last_watermark
    registry = {"protocol": "avro", "schema_registry": schema_registry.url, "ordering": "watermark"}
    _same_through_spark(spark, kafka_broker, topic, tmp_path / "lake", **registry)


@pytest.mark.parametrize("disable_schema", [False, True])
def test_debezium_with_extension_through_every_ddl(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    disable_schema: bool,
) -> None:
    topic = kafka_topic(3)
    workload = _workload(tables=2 if disable_schema else 3)
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True, disable_schema=disable_schema))
    produce_to_kafka(workload, DebeziumStream(encoder), kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    out = _run(kafka_broker, topic, tmp_path / "lake", "--protocol", "debezium", "--ordering", "watermark")
    assert "0 dead letters" in out
    _same_through_spark(
        spark, kafka_broker, topic, tmp_path / "lake", protocol="debezium", ordering="watermark"
    )
    if disable_schema:  # untyped: each column holds its JSON text; the keys and row sets must still match
        mirror = _mirror(tmp_path / "lake", workload, lambda _: DataType("json"))
        assert {name: sorted(rows) for name, rows in mirror.items() if rows} == {
            name: sorted(r["id"] for r in t["rows"]) for name, t in truth["tables"].items() if t["rows"]
        }
        return
    mirror = _mirror(tmp_path / "lake", workload, _double_decimals)
    assert differences(mirror, _as_floats(truth)) == []
    assert consistent_ts(tmp_path / "lake") == workload.last_watermark


def _as_floats(truth: dict[str, Any]) -> dict[str, Any]:
    """Debezium sends DECIMAL as a float64: the truth as the wire carries it."""
    return _mapped(truth, lambda v: float(Decimal(v)))


def _mapped(truth: dict[str, Any], convert: Any) -> dict[str, Any]:
    decimals = {"amount", "c_decimal", "c_wide_decimal"}

    def row(values: dict[str, Any]) -> dict[str, Any]:
        return {k: convert(v) if k in decimals and v is not None else v for k, v in values.items()}

    tables = {name: {**t, "rows": [row(r) for r in t["rows"]]} for name, t in truth["tables"].items()}
    return {**truth, "tables": tables}
