"""`ticdc-consumer demo`: the whole SDK on one machine, from nothing to checked lakehouse tables.

Embedded broker -> simulated TiCDC stream (every column type, DDLs) -> a consumer that joins mid-stream ->
the pipeline into Delta (changelog + mirror) and Parquet -> the mirrors checked against the simulator's
ground truth -> typed rows read back through Spark. Every figure it prints is measured, not assumed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from rich.console import Console
from rich.table import Table

from consumer import app
from consumer.config import RunConfig, SinkConfig, SourceConfig
from consumer.lakehouse.manifest import manifest_files
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import tables
from consumer.pipeline import PipelineStats
from consumer.progress import ProgressReporter
from consumer.protocol.model import TSO_PHYSICAL_SHIFT, TableSchema
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import SimulationReport, produce_to_kafka, write_ground_truth
from consumer.simulate.truth import delta_changelogs, delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.base import Sink
from consumer.sinks.delta import DeltaSink
from consumer.sinks.parquet import ParquetSink
from consumer.sources.base import FixedStarts
from consumer.sources.kafka import KafkaSource
from consumer.spark.readers import read_mirror
from consumer.spark.session import spark_session
from consumer.testing.broker import EmbeddedBroker

TOPIC = "tidb-shop"
LATE_GROUP, LAKEHOUSE_GROUP = "demo-late-joiner", "demo-lakehouse"
IDLE_SECONDS = 3.0
SHOWN_COLUMNS = ("id", "c_bigint_u", "c_decimal", "c_datetime", "c_timestamp", "c_time", "c_set", "c_vector")


@dataclass(frozen=True)
class DemoSettings:
    rows: int = 20_000
    tables: int = 4
    partitions: int = 3
    encoding: str = "json"
    compression: str = "lz4"
    bootstrap_every_rows: int = 2_000


@dataclass
class LateJoin:
    """A consumer that starts every partition half-way: it must hold rows until the next BOOTSTRAP."""

    expected_rows: int  # DML records at or after its start offsets
    delivered_rows: int  # distinct (topic, partition, offset) in its changelog
    held_rows: int  # rows that had to wait for their schema


@dataclass
class DemoReport:
    produced: SimulationReport
    late_join: LateJoin
    lakehouse: PipelineStats
    consume_seconds: float
    changelog_rows: int  # Delta changelog
    parquet_rows: int  # Parquet changelog, counted by Spark
    mirror_differences: list[str]
    consistent_ts: int | None


def run_demo(
    workdir: Path, settings: DemoSettings = DemoSettings(), console: Console | None = None
) -> DemoReport:
    """Run every stage in order and check the result; `workdir` must be new (the sinks would resume from
    offsets an earlier run recorded, which a fresh broker does not have)."""
    console = console or Console()
    workdir.mkdir(parents=True, exist_ok=True)
    with EmbeddedBroker() as broker:
        console.rule(f"[bold]embedded Kafka broker (tansu) at {broker.bootstrap_servers}")
        workload, produced, truth = _produce(broker, settings, workdir, console)
        late_join = _join_mid_stream(broker, produced, workdir / "late-joiner", console)
        spark = spark_session("ticdc-demo")
        spark.sparkContext.setLogLevel("ERROR")
        stats, seconds = _consume_into_lakehouse(broker, workdir, spark, console)
    schemas = [table.schema for table in workload.tables]
    report = DemoReport(
        produced=produced,
        late_join=late_join,
        lakehouse=stats,
        consume_seconds=seconds,
        changelog_rows=sum(rows.num_rows for rows in delta_changelogs(workdir / "delta", ["_offset"])),
        parquet_rows=_parquet_changelog_rows(spark, workdir / "parquet"),
        mirror_differences=differences(delta_mirror_state(workdir / "delta", schemas), truth),
        consistent_ts=consistent_ts(workdir / "delta"),
    )
    _print_summary(report, schemas, workdir, console)
    _show_typed_rows(spark, workdir / "delta", schemas[0].database, schemas[0].table, console)
    return report


def _produce(
    broker: EmbeddedBroker, settings: DemoSettings, workdir: Path, console: Console
) -> tuple[Workload, SimulationReport, dict[str, Any]]:
    config = WorkloadConfig(
        rows=settings.rows,
        tables=settings.tables,
        partitions=settings.partitions,
        dispatch="primary-key",
        bootstrap_every_rows=settings.bootstrap_every_rows,
    )
    workload = Workload(config)
    encoder = MessageEncoder(settings.encoding, settings.compression)  # type: ignore[arg-type]
    started = time.monotonic()
    produced = produce_to_kafka(workload, encoder, broker.bootstrap_servers, TOPIC)
    truth = write_ground_truth(workload, workdir / "ground-truth.json")
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(produced.by_kind.items()))
    console.print(
        f"simulated TiCDC: {produced.records} records ({kinds}) into {TOPIC!r}, {settings.partitions} "
        f"partitions, {settings.encoding}+{settings.compression}, in {time.monotonic() - started:.1f} s; "
        f"ground truth: {workdir / 'ground-truth.json'}"
    )
    return workload, produced, truth


def _join_mid_stream(
    broker: EmbeddedBroker, produced: SimulationReport, root: Path, console: Console
) -> LateJoin:
    """Start each partition right after its last DDL. Starting before a DDL would hold rows of a schema
    version that a DDL replaces before any BOOTSTRAP announces it: no message will ever carry that
    version again (new TiCDC sends no preTableSchema), so those rows would wait for the dead-letter
    timeout instead."""
    console.rule("[bold]a consumer joins mid-stream")
    starts = {(TOPIC, p): produced.offsets[("DDL", p)][-1] + 1 for p in produced.end_offsets}
    config = RunConfig(
        source=SourceConfig(group=LATE_GROUP),
        sink=SinkConfig(url=f"delta:{root}", mode="changelog"),
    )
    pipeline = app.build_pipeline(config)
    source = KafkaSource(
        broker.bootstrap_servers,
        [TOPIC],
        LATE_GROUP,
        config=broker.GROUP_CONFIG,
        listener=FixedStarts(starts, then=pipeline),
    )
    try:
        pipeline.run(source, until_idle=IDLE_SECONDS)
    finally:
        source.close()
        pipeline.close()
    expected = sum(
        sum(offset >= starts[(TOPIC, p)] for offset in produced.offsets.get(("DML", p), []))
        for p in produced.end_offsets
    )
    late_join = LateJoin(expected, _distinct_offsets(root), pipeline.state.stats().held_total)
    where = ", ".join(f"p{p}@{offset}" for (_, p), offset in sorted(starts.items()))
    outcome = (
        "all of them"
        if late_join.delivered_rows == expected
        else f"[red]{expected - late_join.delivered_rows} MISSING[/red]"
    )
    console.print(
        f"started each partition after its last DDL ({where}): {late_join.held_rows} rows waited until a "
        f"BOOTSTRAP told their schema, then delivered {late_join.delivered_rows} of the {expected} DML "
        f"records after those offsets: {outcome}"
    )
    return late_join


def _consume_into_lakehouse(
    broker: EmbeddedBroker, workdir: Path, spark: SparkSession, console: Console
) -> tuple[PipelineStats, float]:
    console.rule("[bold]pipeline: Kafka -> Delta (changelog + mirror) and Parquet (changelog)")
    config = RunConfig(
        source=SourceConfig(
            url=f"kafka://{broker.bootstrap_servers}/{TOPIC}",
            group=LAKEHOUSE_GROUP,
            kafka=broker.GROUP_CONFIG,
        ),
        sink=SinkConfig(url=f"delta:{workdir / 'delta'}", mode="both"),
    )
    sinks: list[Sink] = [DeltaSink(workdir / "delta", mode="both"), ParquetSink(workdir / "parquet")]
    pipeline = app.build_pipeline(config, sinks=sinks)
    source = app.build_source(config, pipeline)
    reporter = ProgressReporter(interactive=console.is_terminal)
    started = time.monotonic()
    try:
        stats = pipeline.run(source, until_idle=IDLE_SECONDS, on_cycle=reporter)
    finally:
        reporter.close()
        source.close()
        pipeline.close()
    return stats, time.monotonic() - started - IDLE_SECONDS


def _distinct_offsets(root: Path) -> int:
    seen: set[tuple[str, int, int]] = set()
    for rows in delta_changelogs(root, ["_topic", "_partition", "_offset"]):
        seen.update(zip(*(rows[c].to_pylist() for c in rows.column_names), strict=True))
    return len(seen)


def _parquet_changelog_rows(spark: SparkSession, root: Path) -> int:
    """Rows of every table's Parquet changelog (dropped tables too), counted by Spark."""
    lake = LakeRoot.of(root)
    listed = (manifest_files(lake, entry.location) for entry in tables(lake))
    return sum(spark.read.parquet(*files).count() for files in listed if files)


def _print_summary(report: DemoReport, schemas: list[TableSchema], workdir: Path, console: Console) -> None:
    console.rule("[bold]result")
    stats = report.lakehouse
    table = Table("upstream table", "changelog rows applied")
    for name, rows in sorted(stats.rows_by_table.items()):
        table.add_row(name, str(rows))
    console.print(table)
    rate = stats.rows / report.consume_seconds if report.consume_seconds > 0 else 0.0
    console.print(
        f"{stats.records} records -> {stats.rows} changelog rows in {report.consume_seconds:.1f} s end to "
        f"end: group join, Delta changelog + mirror commits, a Spark job per Parquet batch ({rate:,.0f} "
        f"rows/s; benchmarks/lakehouse.py measures throughput), {stats.ddls} DDLs, "
        f"{stats.dead_letters} dead letters"
    )
    console.print(
        f"Delta changelog: {report.changelog_rows} rows; Parquet changelog (read by Spark): "
        f"{report.parquet_rows} rows"
    )
    verdict = (
        "[green]equal to the simulator's ground truth[/green]"
        if not report.mirror_differences
        else f"[red]DIFFERENT from the ground truth: {report.mirror_differences}[/red]"
    )
    console.print(f"Delta mirrors of {len(schemas)} tables: {verdict}")
    if report.consistent_ts is not None:
        physical = time.gmtime((report.consistent_ts >> TSO_PHYSICAL_SHIFT) / 1000)
        console.print(
            f"the lakehouse equals TiDB as of TSO {report.consistent_ts} "
            f"({time.strftime('%Y-%m-%d %H:%M:%S UTC', physical)})"
        )
    console.print(f"outputs under {workdir}: delta/, parquet/, late-joiner/, ground-truth.json")


def _show_typed_rows(spark: SparkSession, root: Path, database: str, table: str, console: Console) -> None:
    console.rule(f"[bold]typed rows through Spark: read_mirror(spark, root, {database!r}, {table!r})")
    frame = read_mirror(spark, root, database, table)
    shown = frame.select(*(c for c in SHOWN_COLUMNS if c in frame.columns)).orderBy("id")
    console.print(", ".join(f"{f.name}: {f.dataType.simpleString()}" for f in shown.schema))
    for row in shown.limit(2).collect():
        console.print({name: value for name, value in row.asDict().items()})
