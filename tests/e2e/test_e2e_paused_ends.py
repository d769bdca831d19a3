"""A stream that goes quiet while a partition is paused (rows held for a schema fill the pending budget, and
the schema's BOOTSTRAP comes after them on that partition): `run --until-idle` exits 3 naming the
partition and the offsets left unread, in either engine, never 0 (issue 41)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from pyspark.sql import SparkSession

from consumer import app
from consumer.cli import EXIT_UNAPPLIED, main
from consumer.config import load_config
from consumer.pipeline import PipelineStats
from consumer.protocol.limits import tso_of
from consumer.protocol.model import Bootstrap, Column, DataType, DMLType, Index, TableSchema, Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.spark import engine
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.messages import table_dml

TS = tso_of(1_767_225_600)  # 2026-01-01
HELD_ROWS = 300
BUDGET = {"pending_bytes": 2048, "max_batch_records": 50}
FAST_GROUP_ENV = {
    "TICDC_CONSUMER_KAFKA_SESSION_TIMEOUT_MS": "3000",
    "TICDC_CONSUMER_KAFKA_HEARTBEAT_INTERVAL_MS": "300",
    "TICDC_CONSUMER_PARALLELISM_DECODE_WORKERS": "0",
    "TICDC_CONSUMER_BUDGET_PENDING_BYTES": str(BUDGET["pending_bytes"]),
    "TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": str(BUDGET["max_batch_records"]),
}


def _schema() -> TableSchema:
    columns = (
        Column("id", DataType("int", length=11), nullable=False),
        Column("name", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=64)),
    )
    return TableSchema("shop", "late", 7, TS - 100, columns, (Index("primary", True, True, False, ("id",)),))


def _produce_held_stream(broker: EmbeddedBroker, topic: str) -> None:
    """Partition 0: a WATERMARK. Partition 1: `HELD_ROWS` rows, then their table's BOOTSTRAP, then a
    WATERMARK: the rows wait for the schema, fill the budget, and the partition is paused before the
    BOOTSTRAP is read."""
    schema, encoder = _schema(), MessageEncoder()
    rows = [
        encoder.encode(table_dml(schema, DMLType.INSERT, _row(n), commit_ts=TS + n), schema)
        for n in range(1, HELD_ROWS + 1)
    ]
    mark = encoder.encode(Watermark(commit_ts=TS + HELD_ROWS + 1, build_ts=1))
    tail = [encoder.encode(Bootstrap(table_schema=schema, build_ts=1)), mark]
    broker.produce(topic, [(0, None, mark), *((1, None, value) for value in [*rows, *tail])])


def _row(number: int) -> dict[str, Any]:
    return {"id": number, "name": "x" * 40}


def _assert_paused_partition_named(ends: list[Any], topic: str) -> None:
    """Partition 0 read to its end; partition 1 paused with offsets left, up to its end."""
    assert [(end.partition, end.unread > 0, end.paused) for end in ends] == [
        (0, False, False),
        (1, True, True),
    ]
    assert ends[1].end == HELD_ROWS + 2 and 0 < ends[1].read < HELD_ROWS


def _run(args: list[str], env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, ["run", *args], env=env, catch_exceptions=False)


def test_the_loop_engine_exits_3_naming_the_paused_partition_and_what_it_left_unread(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(2)
    _produce_held_stream(kafka_broker, topic)
    source = f"kafka://{kafka_broker.bootstrap_servers}/{topic}"
    args = ["--source", source, "--group", f"{topic}.loop", "--sink", f"jsonl:{tmp_path / 'out'}"]
    result = _run([*args, "--until-idle", "1"], FAST_GROUP_ENV)
    assert result.exit_code == EXIT_UNAPPLIED, result.output
    assert f"{topic}[1]: read to " in result.output
    assert f"of end offset {HELD_ROWS + 2}: offsets " in result.output
    assert "paused: its rows wait for a schema or the watermark" in result.output
    assert "wait for a schema (shop.late version" in result.output


@pytest.mark.slow
def test_the_spark_engine_exits_3_naming_the_paused_partition_and_what_it_left_unread(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The query plans no batch past a paused partition's position, so it goes idle there: its totals name
    the partition, and `run` exits 3 on them (the run in this process's Spark session; `run` would start
    one of its own)."""
    topic = kafka_topic(2)
    _produce_held_stream(kafka_broker, topic)
    source = f"kafka://{kafka_broker.bootstrap_servers}/{topic}"
    sink = f"jsonl:{tmp_path / 'out'}"
    config = load_config(
        environ={},
        overrides={
            "source": {"url": source, "group": f"{topic}.spark"},
            "sink": {"url": sink},
            "engine": {"kind": "spark", "checkpoint": str(tmp_path / "checkpoint")},
            "budget": BUDGET,
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    _assert_paused_partition_named(stats.ends, topic)
    assert [(u.partition, u.held_rows > 0) for u in stats.unapplied] == [((topic, 1), True)]

    def ran(*_: Any, **__: Any) -> PipelineStats:
        return stats

    monkeypatch.setattr(app, "run", ran)
    args = ["--source", source, "--sink", sink, "--engine", "spark", "--until-idle", "1"]
    result = _run([*args, "--checkpoint", str(tmp_path / "checkpoint")])
    assert result.exit_code == EXIT_UNAPPLIED, result.output
    assert f"{topic}[1]: read to {stats.ends[1].read} of end offset {HELD_ROWS + 2}" in result.output
