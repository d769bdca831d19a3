"""One table's typed changes as a Spark stream (`consumer.spark.table_source`): every change once, typed by
the mysqlType table, in commit order per key, followed through a RENAME, stopped with a named error at each
change of its columns and continued by a restart; the staging log stages nothing twice across a crash."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame, SparkSession

from consumer import app
from consumer.config import RunConfig, load_config
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import entry_uri, read_delta, tables
from consumer.pipeline import Pipeline
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka, write_capture_file
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sources.files import FileSource
from consumer.spark import table_stream
from consumer.spark.table_source import StagedTable, StagingLog
from consumer.state.machine import ConsumerState
from consumer.testing.broker import EmbeddedBroker

KEY = ["_topic", "_partition", "_offset", "_change_type"]


def _workload() -> Workload:  # t0 gets ADD COLUMN, DROP COLUMN, TRUNCATE and a RENAME to t0_renamed
    return Workload(WorkloadConfig(rows=1500, tables=2, partitions=2, dispatch="primary-key", seed=11))


def _config(broker: EmbeddedBroker, topic: str, root: Path) -> RunConfig:
    return load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{broker.bootstrap_servers}/{topic}", "group": f"{topic}.tables"},
            "sink": {"url": f"delta:{root}"},
        },
    )


def _lake_changelog(root: Path, database: str, table: str) -> pa.Table:
    """Every change the loop engine applied to the table of that name, whatever it is called now."""
    lake = LakeRoot.of(root)
    pieces = [
        read_delta(lake, lake.open(entry_uri(lake, entry, "changelog")))  # type: ignore[arg-type]
        for entry in tables(lake)
        if entry.names[0].name == (database, table)
    ]
    return pa.concat_tables(pieces, promote_options="default")


@pytest.mark.slow
def test_a_table_stream_delivers_each_change_once_typed_through_ddls_and_restarts(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(2)
    produce_to_kafka(_workload(), MessageEncoder("json", "none"), kafka_broker.bootstrap_servers, topic)
    config = _config(kafka_broker, topic, tmp_path / "lake")
    app.run(config, until_idle=1.0)  # the loop engine's changelog is the reference
    expected = _lake_changelog(tmp_path / "lake", "shop", "t0")
    checkpoint = str(tmp_path / "checkpoint")
    batches: dict[int, pa.Table] = {}  # a batch a stop interrupted runs again under its id
    schemas: list[dict[str, str]] = []
    changes: list[str] = []

    def collect(frame: DataFrame, batch_id: int) -> None:
        batches[batch_id] = frame.toArrow()

    def start(trigger: dict[str, Any]) -> Any:
        frame = table_stream(spark, config, "shop.t0", checkpoint)
        schemas.append(dict(frame.dtypes))
        writer = frame.writeStream.foreachBatch(collect).option("checkpointLocation", checkpoint)
        return writer.trigger(**trigger).start()

    def ended(query: Any, timeout: int | None = None) -> bool:
        try:
            return query.awaitTermination(timeout) is not False
        except StreamingQueryException as exc:
            assert "TableSchemaChanged" in str(exc), str(exc)[:2000]
            changes.append(str(exc))
            return True

    first = start({"processingTime": "0 seconds"})  # stopped once a batch is in: a restart goes on
    deadline = time.monotonic() + 120
    while not batches and not ended(first, 1) and time.monotonic() < deadline:
        pass
    first.stop()
    failed = first.exception()  # a schema change may end the query just as it is stopped: still told
    if failed is not None and not changes:
        assert "TableSchemaChanged" in str(failed), str(failed)[:2000]
        changes.append(str(failed))
    assert batches, "the first query delivered nothing"
    for _ in range(4):
        stopped = len(changes)
        ended(start({"availableNow": True}))
        if len(changes) == stopped:  # ended without a change of the table: everything is delivered
            break
    if len(changes) == 1:  # the first query met the ADD just as it was stopped: its restart has the column
        assert "added_note" in schemas[1]
    else:
        assert len(changes) == 2
        assert "column added_note added" in changes[0] and "ADD COLUMN `added_note`" in changes[0]
    assert "column added_note dropped" in changes[-1]
    assert "added_note" not in schemas[0] and schemas[-2]["added_note"] == "string"
    assert "added_note" not in schemas[-1]
    assert (schemas[0]["c_decimal"], schemas[0]["c_time"]) == ("decimal(12,2)", "interval day to second")
    delivered = pa.concat_tables([batches[b] for b in sorted(batches)], promote_options="default")
    keys = sorted(delivered.select(KEY).to_pylist(), key=lambda r: tuple(r.values()))
    assert len({tuple(r.values()) for r in keys}) == len(keys)  # nothing twice
    assert keys == sorted(expected.select(KEY).to_pylist(), key=lambda r: tuple(r.values()))  # nothing lost
    _same_values(delivered, expected, ["id", "c_decimal", "c_timestamp", "c_datetime", "_commit_ts"])
    _commit_order_per_key(delivered)


def _same_values(delivered: pa.Table, expected: pa.Table, columns: list[str]) -> None:
    def rows(table: pa.Table) -> list[tuple[Any, ...]]:
        return sorted(tuple(r.values()) for r in table.select([*KEY, *columns]).to_pylist())

    assert rows(delivered) == rows(expected)


def _commit_order_per_key(delivered: pa.Table) -> None:
    """In delivery order (batches, then rows), each key's changes come in commit order."""
    last: dict[Any, int] = {}
    for row in delivered.select(["id", "_commit_ts"]).to_pylist():
        assert row["_commit_ts"] >= last.get(row["id"], 0)
        last[row["id"]] = row["_commit_ts"]


def test_the_staging_log_stages_nothing_twice_across_a_crash(tmp_path: Path) -> None:
    """A pipeline killed between staging an entry and recording its progress re-reads from the last
    record; the restarted staging skips what the log holds, so each change is staged once."""
    capture = tmp_path / "capture.jsonl"
    workload = Workload(WorkloadConfig(rows=800, tables=2, partitions=2, dispatch="primary-key", ddl=False))
    write_capture_file(workload, MessageEncoder("json"), "t", capture)
    reference = _staged(tmp_path / "whole", capture)
    log = StagingLog(str(tmp_path / "crashed"))
    written = 0
    write, save = log.write_entry, log.save

    def counted(entry: int, rows: pa.Table) -> None:
        nonlocal written
        written += 1
        write(entry, rows)

    def dead_after_the_second_entry(progress: Any) -> None:  # its progress is never recorded
        if written >= 2:
            raise KeyboardInterrupt("killed")
        save(progress)

    log.write_entry = counted  # type: ignore[method-assign]
    log.save = dead_after_the_second_entry  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        _run(log, tmp_path, capture)
    crashed = StagingLog(str(tmp_path / "crashed"))
    assert crashed.progress().next_entry > 0
    _run(crashed, tmp_path, capture)
    staged = _entries(crashed)
    assert reference.num_rows > 0
    assert sorted(staged.select(KEY).to_pylist(), key=str) == sorted(
        reference.select(KEY).to_pylist(), key=str
    )
    again = StagingLog(str(tmp_path / "crashed"))
    before = again.progress().next_entry
    _run(again, tmp_path, capture)  # a third run of a finished stream stages nothing
    assert again.progress().next_entry == before


def _staged(location: Path, capture: Path) -> pa.Table:
    log = StagingLog(str(location))
    _run(log, location, capture)
    return _entries(log)


def _run(log: StagingLog, work: Path, capture: Path) -> None:
    pipeline = Pipeline(
        group="tables",
        state=ConsumerState(),
        sinks=[StagedTable(log, "shop", "t1")],
        dead_letters=DeadLetterFile(work / "letters.jsonl"),
        max_batch_records=100,
    )
    source = FileSource(capture, listener=pipeline)
    try:
        pipeline.run(source, until_idle=0.2)
    finally:
        pipeline.close()


def _entries(log: StagingLog) -> pa.Table:
    return pa.concat_tables(log.read_entry(entry) for entry in range(log.progress().next_entry))
