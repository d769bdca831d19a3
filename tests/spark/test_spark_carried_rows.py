"""Rows a Spark run left unapplied (waiting for a WATERMARK) are carried beside the checkpoint: a later run
with nothing new to read reports them again, never exit 0 over them, and applies them once they can be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from consumer.config import RunConfig, load_config
from consumer.lakehouse.tables import read_changelog
from consumer.protocol.limits import tso_of
from consumer.protocol.model import Bootstrap, Column, DataType, DMLType, Index, TableSchema, Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.spark import engine
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.messages import table_dml

TS = tso_of(1_767_225_600)  # 2026-01-01
ROWS = 20
SCHEMA = TableSchema(
    "shop",
    "carried",
    7,
    TS - 100,
    (Column("id", DataType("int", length=11), nullable=False),),
    (Index("primary", True, True, False, ("id",)),),
)


def _config(broker: EmbeddedBroker, topic: str, root: Path) -> RunConfig:
    return load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{broker.bootstrap_servers}/{topic}", "group": f"{topic}.g"},
            "sink": {"url": f"delta:{root / 'lake'}"},
            "engine": {"kind": "spark", "checkpoint": str(root / "checkpoint")},
        },
    )


def _waiting(stats: Any) -> int:
    return sum(u.waiting_rows for u in stats.unapplied)


def test_a_run_with_nothing_new_reports_the_rows_an_earlier_run_left_waiting(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(2)
    encoder = MessageEncoder()
    rows = [
        encoder.encode(table_dml(SCHEMA, DMLType.INSERT, {"id": n}, commit_ts=TS + n), SCHEMA)
        for n in range(1, ROWS + 1)
    ]
    bootstrap = encoder.encode(Bootstrap(table_schema=SCHEMA, build_ts=1))
    ahead = encoder.encode(Watermark(commit_ts=TS + 1000, build_ts=1))
    kafka_broker.produce(topic, [(0, None, ahead), (1, None, bootstrap), *((1, None, row) for row in rows)])
    config = _config(kafka_broker, topic, tmp_path)

    first = engine.run(config, until_idle=1.0, spark=spark)
    assert _waiting(first) == ROWS  # partition 1 has no WATERMARK yet
    again = engine.run(config, until_idle=1.0, spark=spark)
    assert again.rows == 0 and _waiting(again) == ROWS  # carried, not forgotten: `run` exits 3 again
    assert read_changelog(tmp_path / "lake", "shop", "carried") is None

    kafka_broker.produce(topic, [(1, None, ahead)])
    last = engine.run(config, until_idle=1.0, spark=spark)
    assert last.unapplied == [] and last.rows == ROWS
    changelog = read_changelog(tmp_path / "lake", "shop", "carried", ["id"])
    assert changelog is not None and sorted(changelog["id"].to_pylist()) == list(range(1, ROWS + 1))
