"""Rows never pass through the Spark engine's driver: tasks spool the rows they type beside the checkpoint
and send the driver their index only; executor tasks write the changelog files the driver commits."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from lakehouse_checks import changelog_duplicates, changelog_rows, lake_contents, spark_config
from pyspark.sql import DataFrame, SparkSession
from resent_streams import parquet_lake

from consumer import app
from consumer.batches.spool import SpooledRows
from consumer.config import RunConfig, load_config
from consumer.protocol.model import RawDML
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka, write_ground_truth
from consumer.simulate.truth import changelog_images, delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.delta import AppendJob, AppendResult, DeltaSink, HistoryJob
from consumer.sinks.parquet import ParquetFiles, ParquetJob
from consumer.spark import engine
from consumer.spark.merges import ExecutorAppends, ExecutorHistories, ExecutorParquet
from consumer.spark.segments import INDEX_SCHEMA
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.s3 import LocalS3Server

pytestmark = [pytest.mark.spark, pytest.mark.e2e]


def _config(broker: EmbeddedBroker, topic: str, root: Path, checkpoint: Path) -> RunConfig:
    return spark_config(broker, topic, f"{topic}.spool", root, checkpoint, {"max_batch_records": 1500})


def test_no_row_reaches_the_driver(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What the foreachBatch function receives is the records tasks could not type (WATERMARKs, BOOTSTRAPs,
    DDLs, and in the first batch rows of tables whose BOOTSTRAP another partition's task read: the driver
    types those; later tasks know every schema, from the engine's record and the batch being applied) and
    each typed version's index: four int64 columns per DML, far below
    a row's size. The driver never reads a spooled row (that raises here: tasks run in other processes) and
    appends no changelog rows but those it typed; the lake is exact, and spool files of applied rows are
    gone. A batch's tables' changelog files are written by one Spark job."""
    topic = kafka_topic(3)
    workload = Workload(WorkloadConfig(rows=3000, tables=3, partitions=3, dispatch="primary-key"))
    produce_to_kafka(workload, MessageEncoder("json", "none"), kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    received: dict[int, list[dict[str, Any]]] = {}
    appended_here: list[int] = []
    collect, append = engine._collected, DeltaSink._append_changelog

    def collected(frame: DataFrame, batch_id: int) -> list[dict[str, Any]]:
        received[batch_id] = collect(frame, batch_id)
        return received[batch_id]

    def refused(*args: object) -> None:
        raise AssertionError("a spooled row was read on the driver")

    def appending(sink: DeltaSink, uri: str, changelog: pa.Table, context: Any) -> None:
        appended_here.append(changelog.num_rows)
        append(sink, uri, changelog, context)

    jobs: list[int] = []
    run_jobs = ExecutorAppends.__call__

    def appends(runner: ExecutorAppends, batch: Sequence[AppendJob]) -> list[AppendResult]:
        jobs.append(len(batch))
        return run_jobs(runner, batch)

    monkeypatch.setattr(ExecutorAppends, "__call__", appends)
    monkeypatch.setattr(engine, "_collected", collected)
    monkeypatch.setattr(SpooledRows, "read", refused)
    monkeypatch.setattr(DeltaSink, "_append_changelog", appending)
    root, checkpoint = tmp_path / "lake", tmp_path / "checkpoint"
    stats = engine.run(_config(kafka_broker, topic, root, checkpoint), until_idle=1.0, spark=spark)

    assert differences(delta_mirror_state(root, (t.schema for t in workload.tables)), truth) == []
    assert changelog_duplicates(root) == 0
    assert max(jobs) > 1  # the files of several tables of a batch written by one Spark job
    assert changelog_rows(root) == stats.rows == changelog_images(workload.config)
    untyped = {batch: _dmls(_values(rows)) for batch, rows in received.items()}
    dmls = sum(untyped.values())
    assert sum(appended_here) <= 2 * dmls  # only the rows it typed itself (an UPDATE makes two rows)
    assert not any(untyped[batch] for batch in untyped if batch > min(untyped))  # schemas known by then
    indexed = dmls_indexed = 0
    for data in (data for rows in received.values() for row in rows for data in row["changes"]):
        index = pa.ipc.open_stream(data).read_all()
        assert index.schema.remove_metadata() == INDEX_SCHEMA
        indexed, dmls_indexed = indexed + len(data), dmls_indexed + index.num_rows
    assert dmls_indexed + dmls == workload.config.rows
    changelogs = [DeltaTable(str(path)).to_pyarrow_table() for path in root.rglob("changelog")]
    per_row = sum(t.nbytes for t in changelogs) / sum(t.num_rows for t in changelogs)  # in memory, as sent
    per_dml = indexed / dmls_indexed  # an index row, and its share of the table's schema in the metadata
    assert per_dml < 80 and per_dml < per_row / 2, (per_dml, per_row)
    assert not list((checkpoint / "ticdc" / "spool").rglob("*.arrow"))


def _dmls(values: list[bytes]) -> int:
    return sum(isinstance(MessageDecoder().decode(value), RawDML) for value in values)


def _values(rows: list[dict[str, Any]]) -> list[bytes]:
    """The Kafka values of the records tasks did not type."""
    return [v for row in rows for v in pa.ipc.open_stream(row["records"]).read_all()["value"].to_pylist()]


def test_an_object_store_lake_is_written_by_the_executors(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    s3_server: LocalS3Server,
    s3_lake: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On `s3://` too, the changelog's files are written by Spark tasks (reaching the store with the sink's
    storage options, the only way executors learn them) and committed by the driver, which appends no row
    it did not type itself; the mirrors, MERGEd on the executors, equal the truth."""
    topic = kafka_topic(3)
    workload = Workload(WorkloadConfig(rows=1500, tables=2, partitions=3, dispatch="primary-key", ddl=False))
    produce_to_kafka(workload, MessageEncoder("json", "none"), kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    appended_here: list[int] = []
    append = DeltaSink._append_changelog

    def appending(sink: DeltaSink, uri: str, changelog: pa.Table, context: Any) -> int:
        appended_here.append(changelog.num_rows)
        return append(sink, uri, changelog, context)

    monkeypatch.setattr(DeltaSink, "_append_changelog", appending)
    config = load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{kafka_broker.bootstrap_servers}/{topic}", "group": f"{topic}.s3"},
            "sink": {"url": f"delta:{s3_lake}", "storage_options": s3_server.environment()},
            "engine": {"kind": "spark", "checkpoint": str(tmp_path / "checkpoint")},
            "budget": {"max_batch_records": 1500},
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    options = s3_server.environment()
    assert differences(delta_mirror_state(s3_lake, (t.schema for t in workload.tables), options), truth) == []
    assert changelog_rows(s3_lake, options) == stats.rows == changelog_images(workload.config)
    assert sum(appended_here) < stats.rows / 10  # only rows of the first batch a task could not type


def test_histories_are_merged_by_the_executors_as_the_loop_engine_merges_them(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--mode both,history`: each batch's history MERGE runs in a Spark task reading the spooled rows (the
    driver reads none: that raises here), and the lake (changelogs, mirrors, histories) is the loop
    engine's, row for row."""
    topic = kafka_topic(3)
    workload = Workload(WorkloadConfig(rows=1500, tables=2, partitions=3, dispatch="primary-key"))
    produce_to_kafka(workload, MessageEncoder("json", "none"), kafka_broker.bootstrap_servers, topic)
    source = {"url": f"kafka://{kafka_broker.bootstrap_servers}/{topic}"}
    mode = "changelog,mirror,history"
    loop = load_config(
        environ={},
        overrides={
            "source": {**source, "group": f"{topic}.loop"},
            "sink": {"url": f"delta:{tmp_path / 'loop'}", "mode": mode},
            "parallelism": {"decode_workers": 0},
        },
    )
    app.run(loop, until_idle=1.0)
    histories: list[int] = []
    run_histories = ExecutorHistories.__call__

    def merged(runner: ExecutorHistories, jobs: Sequence[HistoryJob]) -> list[int]:
        histories.extend(run_histories(runner, jobs))
        return histories[-len(jobs) :]

    def refused(*args: object) -> None:
        raise AssertionError("a spooled row was read on the driver")

    monkeypatch.setattr(ExecutorHistories, "__call__", merged)
    monkeypatch.setattr(SpooledRows, "read", refused)
    config = load_config(
        environ={},
        overrides={
            "source": {**source, "group": f"{topic}.spark"},
            "sink": {"url": f"delta:{tmp_path / 'spark'}", "mode": mode},
            "engine": {"kind": "spark", "checkpoint": str(tmp_path / "checkpoint")},
            "budget": {"max_batch_records": 500},
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    assert lake_contents(tmp_path / "spark") == lake_contents(tmp_path / "loop")
    assert sum(histories) > stats.rows / 2  # the changes the executors' MERGEs took (untyped rows aside)


def test_a_parquet_lake_is_written_by_the_executors_as_the_loop_engine_writes_it(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Parquet sink's files are written by Spark tasks from the spooled rows (the driver reads none: that
    raises here) and listed in the manifest by the driver: every table holds the rows the loop engine's
    run writes, and the totals are read back from the manifests."""
    topic = kafka_topic(3)
    workload = Workload(WorkloadConfig(rows=1500, tables=2, partitions=3, dispatch="primary-key"))
    produce_to_kafka(workload, MessageEncoder("json", "none"), kafka_broker.bootstrap_servers, topic)
    source = {"url": f"kafka://{kafka_broker.bootstrap_servers}/{topic}"}
    loop = load_config(
        environ={},
        overrides={
            "source": {**source, "group": f"{topic}.loop"},
            "sink": {"url": f"parquet:{tmp_path / 'loop'}"},
            "parallelism": {"decode_workers": 0},
        },
    )
    app.run(loop, until_idle=1.0)

    def refused(*args: object) -> None:
        raise AssertionError("a spooled row was read on the driver")

    files: list[int] = []
    write = ExecutorParquet.__call__

    def written(runner: ExecutorParquet, jobs: Sequence[ParquetJob]) -> list[ParquetFiles]:
        done = write(runner, jobs)
        files.extend(len(result.files) for result in done)
        return done

    monkeypatch.setattr(SpooledRows, "read", refused)
    monkeypatch.setattr(ExecutorParquet, "__call__", written)
    config = load_config(
        environ={},
        overrides={
            "source": {**source, "group": f"{topic}.spark"},
            "sink": {"url": f"parquet:{tmp_path / 'spark'}"},
            "engine": {"kind": "spark", "checkpoint": str(tmp_path / "checkpoint")},
            "budget": {"max_batch_records": 500},
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    assert parquet_lake(tmp_path / "spark") == parquet_lake(tmp_path / "loop")
    assert stats.rows == changelog_images(workload.config) and sum(files) > 1
