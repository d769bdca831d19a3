"""Re-sent changes end to end: a simulated changefeed whose TiCDC restarted (each restart sends again, at
later offsets, what followed its checkpoint) through the embedded broker, every protocol, into Delta: the
lake holds each change once, and its mirrors hold the simulator's ground truth's rows."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from confluent_kafka import Producer
from lakehouse_checks import run_to_end
from pyspark.sql import SparkSession

from consumer.config import load_config
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import DML
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.simulate.output import (
    AvroStream,
    DebeziumStream,
    KafkaPair,
    StreamWriter,
    encoded,
    ensure_topic,
    write_ground_truth,
)
from consumer.simulate.truth import changelog_images, delta_changelogs
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig
from consumer.spark import engine
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.registry import LocalSchemaRegistry

pytestmark = pytest.mark.e2e


def _config(**options: Any) -> WorkloadConfig:
    return WorkloadConfig(
        **{"rows": 2400, "tables": 3, "partitions": 3, "dispatch": "primary-key", "resends": 3, **options}
    )


def _writer(protocol: str, topic: str, registry: LocalSchemaRegistry) -> StreamWriter:
    """TiCDC Avro and Debezium with the TiDB extension: their records carry the commit ts (without it,
    copies cannot be told from new changes: docs/resends.md)."""
    if protocol == "avro":
        options = AvroOptions(tidb_extension=True, watermark=True)  # DDL records come with watermarks
        return AvroStream(ConfluentAvroEncoder(SchemaRegistry(registry.url), options), topic)
    if protocol == "debezium":
        return DebeziumStream(DebeziumEncoder(DebeziumOptions(tidb_extension=True)))
    return MessageEncoder("json")


def _flags(protocol: str, registry: LocalSchemaRegistry) -> list[str]:
    if protocol == "avro":
        return ["--protocol", "avro", "--schema-registry", registry.url]
    return ["--protocol", protocol]


def _produce(broker: EmbeddedBroker, topic: str, records: Iterable[tuple[StreamRecord, KafkaPair]]) -> int:
    """Produce the records in order, each to its partition; how many."""
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 5, "acks": "all"})
    count = 0
    for record, (key, value) in records:
        producer.produce(topic, value=value, key=key, partition=record.partition)
        count += 1
    assert producer.flush(30) == 0
    return count


def _key_sets(root: Path, workload: Workload) -> dict[str, set[Any]]:
    """Each live table's keys in its mirror (read through the catalog)."""
    from consumer.lakehouse.tables import read_mirror

    found = {}
    for table in workload.tables:
        if not table.dropped:
            schema = table.schema
            mirror = read_mirror(root, schema.database, schema.table, ["id"])
            found[f"{schema.database}.{schema.table}"] = (
                set() if mirror is None else set(mirror["id"].to_pylist())
            )
    return found


def _truth_keys(truth: dict[str, Any]) -> dict[str, set[Any]]:
    return {
        name: {row["id"] for row in table["rows"]}
        for name, table in truth["tables"].items()
        if not table["dropped"]
    }


def _changes_once(root: Path, config: WorkloadConfig, protocol: str) -> None:
    """Every change image once: as many as the stream sent once makes (TiCDC Avro sends an UPDATE's new
    image alone), none twice (by commit ts, key and kind: copies take other offsets)."""
    changelogs = delta_changelogs(root, ["_commit_ts", "id", "_change_type"])
    images = changelog_images(config) if protocol != "avro" else _dmls(config)
    assert sum(rows.num_rows for rows in changelogs) == images
    for rows in changelogs:
        grouped = rows.group_by(rows.column_names).aggregate([([], "count_all")])
        assert pc.max(grouped["count_all"]).as_py() in (None, 1)


def _dmls(config: WorkloadConfig) -> int:
    return sum(isinstance(r.message, DML) and not r.resent for r in Workload(config).records())


def _check(root: Path, workload: Workload, tmp_path: Path, protocol: str = "simple") -> None:
    truth = _truth_keys(write_ground_truth(workload, tmp_path / "truth.json"))
    have = _key_sets(root, workload)
    wrong = {
        name: (sorted(truth[name] - keys)[:5], sorted(keys - truth[name])[:5]) for name, keys in have.items()
    }
    assert {name: diff for name, diff in wrong.items() if diff != ([], [])} == {}  # (missing, extra)
    _changes_once(root, workload.config, protocol)


@pytest.mark.parametrize(
    ("protocol", "members"), [("simple", 1), ("simple", 2), ("avro", 2), ("debezium", 2)]
)
def test_the_loop_engine_applies_each_re_sent_change_once(
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    schema_registry: LocalSchemaRegistry,
    tmp_path: Path,
    protocol: str,
    members: int,
) -> None:
    topic = kafka_topic(3)
    workload = Workload(_config())
    _produce(kafka_broker, topic, encoded(workload, _writer(protocol, topic, schema_registry)))
    root = tmp_path / "lake"
    options = _flags(protocol, schema_registry)
    code, log = run_to_end(
        kafka_broker, topic, f"{topic}.g", f"delta:{root}", tmp_path / "run", members, options
    )
    assert code == 0, log.read_text()[-3000:]
    _check(root, workload, tmp_path, protocol)
    if members == 1:
        resent = int(log.read_text().split(" re-sent (skipped)")[0].rsplit(" ", 1)[-1])
        assert resent > 0


def test_a_member_restarting_in_the_middle_of_a_re_sent_range_applies_each_change_once(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, schema_registry: LocalSchemaRegistry, tmp_path: Path
) -> None:
    """The first run reads the stream up to the middle of a restart's copies and stops; the second reads
    the rest: the copies left are recognised from what the lake holds."""
    topic = kafka_topic(3)
    ensure_topic(kafka_broker.bootstrap_servers, topic, 3)
    workload = Workload(_config(resends=1))
    records = list(encoded(workload, MessageEncoder("json")))
    copies = [index for index, (record, _) in enumerate(records) if record.resent]
    middle = copies[len(copies) // 2]
    root, group = tmp_path / "lake", f"{topic}.g"
    _produce(kafka_broker, topic, records[:middle])
    first, _ = run_to_end(kafka_broker, topic, group, f"delta:{root}", tmp_path / "first")
    assert first in (0, 3)  # rows after the last WATERMARK wait for the next one
    _produce(kafka_broker, topic, records[middle:])
    second, log = run_to_end(kafka_broker, topic, group, f"delta:{root}", tmp_path / "second")
    assert second == 0, log.read_text()[-3000:]
    _check(root, workload, tmp_path)


@pytest.mark.parametrize("protocol", ["simple", "avro", "debezium"])
def test_the_spark_engine_applies_each_re_sent_change_once(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    schema_registry: LocalSchemaRegistry,
    tmp_path: Path,
    protocol: str,
) -> None:
    topic = kafka_topic(3)
    workload = Workload(_config())
    _produce(kafka_broker, topic, encoded(workload, _writer(protocol, topic, schema_registry)))
    root = tmp_path / "lake"
    decode: dict[str, Any] = {"protocol": protocol}
    if protocol == "avro":
        decode["schema_registry"] = schema_registry.url
    config = load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{kafka_broker.bootstrap_servers}/{topic}", "group": f"{topic}.spark"},
            "sink": {"url": f"delta:{root}"},
            "engine": {"kind": "spark"},
            "budget": {"max_batch_records": 1000},
            "decode": decode,
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    assert stats.resent > 0 and stats.dead_letters == 0
    _check(root, workload, tmp_path, protocol)
