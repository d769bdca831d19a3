"""The Spark engine end to end on the embedded broker and the session's local Spark: the `ticdc` source read
and decoded by tasks, `ChangeBatches` applying micro-batches to the same sinks as the loop engine, checked
with the same ground truth (mirror), completeness and duplicate checks."""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from delta_changes import KV
from deltalake import DeltaTable, write_deltalake
from lakehouse_checks import (
    changelog_duplicates,
    changelog_rows,
    ddl_types,
    lake_contents,
    merge_processes,
    run_to_end,
)
from pyspark.sql import DataFrame, SparkSession

from consumer.batches.changes import table_changes
from consumer.config import RunConfig, load_config
from consumer.errors import RecordLocation
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.tables import BUCKET, bucket_of, table_uri
from consumer.large_messages.claim_check import ClaimCheckWriter
from consumer.large_messages.encoder import LargeMessageEncoder
from consumer.pipeline import Pipeline
from consumer.protocol.model import DML, DMLType, RawDML, Watermark
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.simulate.output import WatermarkHeartbeat, produce_to_kafka, write_ground_truth
from consumer.simulate.truth import changelog_images, delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.base import CommitContext
from consumer.sinks.bucket_merges import GROUPS_META
from consumer.sinks.delta import DeltaSink, MergeJob, MergeResult, process_name
from consumer.sinks.foreach_batch import BatchInfo, TableName
from consumer.sources.capture import read_capture
from consumer.sources.errors import SourceError
from consumer.sources.kafka import capture_topic
from consumer.spark import engine, merges, start_lakehouse
from consumer.spark.engine import ChangeBatches
from consumer.spark.merges import ExecutorMerges
from consumer.spark.readers import read_changelog
from consumer.spark.segments import Segment
from consumer.spark.source import (
    OffsetRange,
    OffsetRanges,
    TicdcOptions,
    read_partition,
    read_range,
    register,
)
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.messages import raw_dml

pytestmark = [pytest.mark.spark, pytest.mark.e2e]
Offsets = set[tuple[str, int, int]]


def _produce(
    broker: EmbeddedBroker, topic: str, encoding: str = "json", compression: str = "none", **options: Any
) -> Workload:
    config = WorkloadConfig(
        **{"rows": 4000, "tables": 3, "partitions": 3, "dispatch": "primary-key", **options}
    )
    workload = Workload(config)
    produce_to_kafka(workload, MessageEncoder(encoding, compression), broker.bootstrap_servers, topic)  # type: ignore[arg-type]
    return workload


def _config(
    broker: EmbeddedBroker,
    topic: str,
    root: Path,
    *,
    sink: str = "delta",
    checkpoint: Path | None = None,
    group: str = "",
    **budget: Any,
) -> RunConfig:
    return load_config(
        environ={},
        overrides={
            "source": {
                "url": f"kafka://{broker.bootstrap_servers}/{topic}",
                "group": group or f"{topic}.spark",
            },
            "sink": {"url": f"{sink}:{root}"},
            "engine": {"kind": "spark", "checkpoint": str(checkpoint or "")},
            "budget": {"max_batch_records": 1000, **budget},
        },
    )


def _options(config: RunConfig, **more: str) -> dict[str, str]:
    """The stream's options for `config`, with source options a run configuration does not name."""
    return {**engine.stream_options(config).to_spark(), **more}


def _run_exact(
    spark: SparkSession,
    broker: EmbeddedBroker,
    topic: str,
    tmp_path: Path,
    workload: dict[str, Any],
    batch: int,
    **sink: Any,
) -> tuple[Workload, Path]:
    """A run of the Spark engine over a workload (`_produce`'s options), these `[sink]` settings and batch
    size: its mirrors equal the ground truth, its changelogs hold no duplicate. The workload and lake."""
    produced = _produce(broker, topic, **workload)
    truth = write_ground_truth(produced, tmp_path / "truth.json")
    root = tmp_path / "lake"
    config = _config(broker, topic, root, max_batch_records=batch)
    engine.run(
        msgspec.structs.replace(config, sink=msgspec.structs.replace(config.sink, **sink)),
        until_idle=1.0,
        spark=spark,
    )
    assert differences(delta_mirror_state(root, (t.schema for t in produced.tables)), truth) == []
    assert changelog_duplicates(root) == 0
    return produced, root


def test_lazy_bucketed_mirrors_through_the_spark_engine(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """`[sink] mirror_interval_rows` and `mirror_buckets` reach the Spark engine's sink: the changelog is
    committed every micro-batch, the bucketed mirrors MERGEd less often, and reads equal the truth."""
    workload, root = _run_exact(
        spark,
        kafka_broker,
        kafka_topic(3),
        tmp_path,
        {"rows": 1500, "ddl": False},
        300,
        mirror_interval_rows=1200,
        mirror_buckets=4,
    )
    for table in workload.tables:
        uri = table_uri(root, table.schema.database, table.schema.table)
        assert uri is not None
        mirror = DeltaTable(uri)
        assert mirror.metadata().partition_columns == ["_bucket"]
        merges = sum(c["operation"] == "MERGE" for c in mirror.history())
        appends = sum(
            c["operation"] == "WRITE" for c in DeltaTable(uri.removesuffix("mirror") + "changelog").history()
        )
        assert 1 <= merges < appends


def test_mirrors_are_merged_on_the_executors_and_the_lake_equals_the_loop_engines(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Mirror mode (changelog and mirror, no cadence): the driver appends the changelog, and every mirror
    MERGE runs in a Spark task, in an executor's Python worker (not this driver's process), from the
    changelog, at every micro-batch; every DDL kind (ALTERs are barriers). The lake equals the ground
    truth and, row for row, the loop engine's (which MERGEs in its own process)."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=1500)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    stats = engine.run(_config(kafka_broker, topic, root, max_batch_records=400), until_idle=1.0, spark=spark)
    assert differences(delta_mirror_state(root, (t.schema for t in workload.tables)), truth) == []
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == stats.rows == changelog_images(workload.config)
    merged_in = merge_processes(root)
    assert len(merged_in) >= 4  # MERGEs at many batches, not once at the end
    assert process_name() not in merged_in
    assert all(name.rpartition(":")[0] == socket.gethostname() for name in merged_in)

    code, log = run_to_end(
        kafka_broker, topic, f"{topic}.loop", f"delta:{tmp_path / 'loop'}", tmp_path / "loop"
    )
    assert code == 0, log.read_text()[-3000:]
    assert lake_contents(root) == lake_contents(tmp_path / "loop")
    assert len(set(merge_processes(tmp_path / "loop"))) == 1


def test_bucket_groups_of_large_merges_run_as_tasks_and_the_lake_equals_the_loop_engines(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Bucketed mirrors whose MERGEs are split at a few keys (`sink.mirror_split_rows`): a table's MERGE
    runs in bucket groups as Spark tasks, each commit made of several groups (`ticdc.bucket_groups`), in an
    executor's process; the lake equals the ground truth and the loop engine's (which splits on threads)."""
    topic = kafka_topic(3)
    workload, root = _run_exact(
        spark, kafka_broker, topic, tmp_path, {"rows": 1500}, 400, mirror_buckets=4, mirror_split_rows=20
    )
    assert not list(root.rglob("_ticdc_parts/*.arrow"))  # the groups' spooled rows are gone
    groups = []
    for table in workload.tables:
        uri = table_uri(root, table.schema.database, table.schema.table)
        assert uri is not None
        commits = DeltaTable(uri).history()
        groups += [int(c[GROUPS_META]) for c in commits if GROUPS_META in c]
        assert all(c.get("ticdc.process") != process_name() for c in commits if GROUPS_META in c)
    assert len(groups) >= 3 and min(groups) >= 2

    options = ["--mirror-buckets", "4", "--mirror-split-rows", "20"]
    code, log = run_to_end(
        kafka_broker, topic, f"{topic}.loop", f"delta:{tmp_path / 'loop'}", tmp_path / "loop", options=options
    )
    assert code == 0, log.read_text()[-3000:]
    assert lake_contents(root) == lake_contents(tmp_path / "loop")


def _pending_job(tmp_path: Path, keys: int, **sink: Any) -> tuple[DeltaSink, MergeJob]:
    """A lazy mirror's MERGE of `keys` inserts its changelog holds (commit ts 10.. and point 2 * keys, in
    TSO units), run by nobody yet, and the sink that wrote them (MERGEing only when a MERGE is run)."""
    writer = DeltaSink(tmp_path, mirror_interval_rows=10**12, **sink)
    located = [
        (
            raw_dml(KV, DMLType.INSERT, {"id": key, "v": f"v{key}"}, None, commit_ts=(10 + key) << 18),
            RecordLocation("t", 0, key),
        )
        for key in range(keys)
    ]
    point = (2 * keys) << 18
    context = CommitContext("g", {("t", 0): keys}, point, b"", {("t", 0): point})
    writer.write(table_changes(TableCodec(KV), located), context)
    writer.record_progress(context)  # reads the consistent point; nothing due yet
    entry = next(iter(writer._lagging.values())).entry
    job = MergeJob(writer.root.uri, {}, entry, "g", point, point, None, None, split_rows=writer.split_rows)
    return writer, job


def test_a_merge_task_run_twice_at_once_commits_once(spark: SparkSession, tmp_path: Path) -> None:
    """The same MERGE job as two Spark tasks at once (a retried or speculative task): one commits, the other
    conflicts, re-reads the mirror's app transactions and commits nothing; both report the same result."""
    _, job = _pending_job(tmp_path, 20)
    results = ExecutorMerges(spark.sparkContext)([job, job])
    uri = table_uri(tmp_path, "shop", "kv")
    assert uri is not None
    mirror = DeltaTable(uri)
    merges = [c for c in mirror.history() if c["operation"] == "MERGE"]
    assert len(merges) == 1 and mirror.to_pyarrow_table().num_rows == 20
    assert [(r.gone, r.merged_ts, r.left) for r in results] == [(False, 40 << 18, 0)] * 2
    assert os.getpid() not in {int(r.process.rpartition(":")[2]) for r in results}
    assert sum(r.metrics.get("merges", 0) for r in results) == 1


class _ConflictOnce(ExecutorMerges):
    """Another writer commits to the mirror after the first bucket groups ran, before their commit."""

    def __init__(self, context: Any, conflict: Callable[[], None]) -> None:
        super().__init__(context)
        self.conflict, self.rounds = conflict, 0

    def _run_splits(
        self, jobs: Sequence[MergeJob], prepared: Sequence[MergeResult], retry: int
    ) -> list[MergeResult]:
        self.rounds += 1
        if self.rounds == 1:
            real = merges.finish_split

            def conflicting(*args: Any) -> MergeResult | None:
                self.conflict()
                return real(*args)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(merges, "finish_split", conflicting)
                return super()._run_splits(jobs, prepared, retry)
        return super()._run_splits(jobs, prepared, retry)


def test_a_split_merge_whose_commit_conflicts_on_the_driver_runs_again(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A MERGE split in bucket groups (Spark tasks) whose driver commit conflicts with another writer's
    commit (a file appended to a touched bucket) is prepared and run again: one split
    commit, every change in."""
    sink, job = _pending_job(tmp_path, 60, mirror_buckets=4, mirror_split_rows=10)
    uri = table_uri(tmp_path, "shop", "kv")
    assert uri is not None

    def append() -> None:  # a blind append into a touched bucket: delta-rs alone would not see a conflict
        mirror = DeltaTable(uri)
        bucket = bucket_of(pa.array([1000]), 4)[0].as_py()
        row = {"id": 1000, "v": "other", "_commit_ts": 1, "_schema_version": 1, BUCKET: bucket}
        write_deltalake(
            mirror, pa.Table.from_pylist([row], pa.schema(mirror.schema().to_arrow())), mode="append"
        )

    runner = _ConflictOnce(spark.sparkContext, append)
    sink.run_merges_with(runner)
    [result] = runner([job])
    assert runner.rounds == 2 and result.split is None and result.metrics["merges"] == 1
    mirror = DeltaTable(uri)
    assert sorted(mirror.to_pyarrow_table()["id"].to_pylist()) == [*range(60), 1000]
    assert sum(GROUPS_META in c for c in mirror.history()) == 1
    assert mirror.transaction_version("ticdc:g:t:0") == 60
    assert not list(tmp_path.rglob("_ticdc_parts/*.arrow"))


@pytest.mark.slow
@pytest.mark.parametrize(("encoding", "compression"), [("json", "none"), ("avro", "lz4")])
def test_mirror_equals_ground_truth_through_every_ddl_type(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    encoding: str,
    compression: str,
) -> None:
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, encoding, compression)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    stats = engine.run(_config(kafka_broker, topic, root), until_idle=1.0, spark=spark)
    assert differences(delta_mirror_state(root, (t.schema for t in workload.tables)), truth) == []
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == stats.rows == changelog_images(workload.config)
    assert ddl_types(root) == {"CREATE", "ALTER", "CINDEX", "TRUNCATE", "RENAME", "ERASE"}
    assert consistent_ts(root) == workload.last_watermark
    progress = DeltaTable(str(root / "_progress")).to_pyarrow_table()
    assert set(progress["topic_partitions"].to_pylist()) == {3}  # the topic's count: no false point
    assert stats.dead_letters == 0
    batches = sorted((root / "_spark" / f"{topic}.spark" / "ticdc").glob("batch-*.arrow"))
    assert len(batches) == 3  # the newest kept, of several micro-batches (1000 records each)
    assert int(batches[-1].stem.rpartition("-")[2]) >= 3


@pytest.mark.slow
def test_claim_checked_rows_are_made_whole_as_the_loop_engine_makes_them(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """A third of the rows are claim-checked (objects on local files): the driver fetches each through the
    configured roots and applies the whole row in its place; nothing is set aside."""
    topic = kafka_topic(3)
    workload = Workload(WorkloadConfig(rows=3000, tables=3, partitions=3, dispatch="primary-key"))
    claims = tmp_path / "claims"
    writer = ClaimCheckWriter(f"file://{claims}")
    encoder = LargeMessageEncoder(MessageEncoder("json", "lz4"), "claim-check", 600, writer)
    produce_to_kafka(workload, encoder, kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    config = load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{kafka_broker.bootstrap_servers}/{topic}", "group": f"{topic}.spark"},
            "sink": {"url": f"delta:{root}"},
            "engine": {"kind": "spark"},
            "budget": {"max_batch_records": 1000},
            "large_messages": {"claim_check_roots": [f"file://{claims}"]},
        },
    )
    stats = engine.run(config, until_idle=1.0, spark=spark)
    objects = len(list(claims.iterdir()))
    assert 0.25 * 3000 < objects < 0.45 * 3000
    assert stats.claim_check_fetches == objects
    assert stats.dead_letters == 0
    assert differences(delta_mirror_state(root, (t.schema for t in workload.tables)), truth) == []
    assert changelog_duplicates(root) == 0


def _delivered(root: Path, *, writing: bool = False) -> dict[str, list[dict[str, Any]]]:
    """Changelog rows per table. `writing`: a running query may be appending, so a last line without its
    newline is not read yet (it can even end inside a UTF-8 character)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(root.glob("*/*.jsonl")):
        data = path.read_bytes()
        if writing:
            data = data[: data.rfind(b"\n") + 1]
        rows[f"{path.parent.name}.{path.stem}"] = [json.loads(line) for line in data.decode().splitlines()]
    return rows


def _offsets_of(rows: dict[str, list[dict[str, Any]]]) -> list[tuple[str, int, int]]:
    return [
        (r["_topic"], r["_partition"], r["_offset"])
        for images in rows.values()
        for r in images
        if r["_change_type"] != "update_preimage"
    ]


def _dml_offsets(records: Iterable[Any], starts: dict[tuple[str, int], int]) -> Offsets:
    decoder = MessageDecoder()
    return {
        (r.topic, r.partition, r.offset)
        for r in records
        if r.offset >= starts[(r.topic, r.partition)] and isinstance(decoder.decode(r.value), RawDML)
    }


def _stream(spark: SparkSession, options: dict[str, str], handler: ChangeBatches, checkpoint: Path) -> Any:
    register(spark)
    frames = spark.readStream.format("ticdc").options(**options).load()
    return frames.writeStream.foreachBatch(handler).option("checkpointLocation", str(checkpoint))


@pytest.mark.slow
def test_mid_stream_start_holds_rows_until_a_bootstrap_on_partition_0(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Started half-way through each partition with BOOTSTRAPs on partition 0 only (a processingTime
    query): rows of every partition wait, across micro-batches, for the next one there, then all come out
    exactly once and in order."""
    topic = kafka_topic(3)
    _produce(kafka_broker, topic, ddl=False, bootstrap_every_rows=600, bootstrap_to_all_partitions=False)
    capture = tmp_path / "all.jsonl"
    capture_topic(kafka_broker.bootstrap_servers, topic, capture, idle_seconds=2.0)
    records = list(read_capture(capture))
    ends = {(r.topic, r.partition): r.offset + 1 for r in records}
    starts = {tp: end // 2 for tp, end in ends.items()}
    expected = _dml_offsets(records, starts)
    out = tmp_path / "out"
    config = _config(
        kafka_broker, topic, out, sink="jsonl", checkpoint=tmp_path / "checkpoint", group=f"{topic}.mid"
    )
    config.budget.max_batch_records = 300
    starting = json.dumps({topic: {str(p): offset for (_, p), offset in starts.items()}})
    options = _options(config, startingOffsets=starting)
    held: list[int] = []

    def observe(pipeline: Pipeline) -> None:
        held.append(pipeline.state.stats().held_rows)

    handler = ChangeBatches(config, on_batch=observe)
    query = (
        _stream(spark, options, handler, tmp_path / "checkpoint")
        .trigger(processingTime="0.2 seconds")
        .start()
    )
    try:
        deadline = time.monotonic() + 180
        while len(_offsets_of(_delivered(out, writing=True))) < len(expected) and time.monotonic() < deadline:
            assert query.isActive, query.exception()
            time.sleep(0.5)
    finally:
        query.stop()
        handler.close()
    delivered = _offsets_of(_delivered(out))
    assert len(delivered) == len(set(delivered))  # nothing twice
    assert set(delivered) == expected  # nothing lost
    assert max(held) > 0 and held[-1] == 0  # rows waited across batches, and were all released
    assert not (out / "_dead_letters.jsonl").read_text()
    for images in _delivered(out).values():
        commit_ts = [image["_commit_ts"] for image in images]
        assert commit_ts == sorted(commit_ts)


def test_batch_read_applies_the_rows_its_ranges_resolve(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """`spark.read.format("ticdc")` between offsets: applied as one batch, exactly the rows its ranges
    complete (partition 1 ends at a WATERMARK half-way, so later rows of partition 0 must wait)."""
    topic = kafka_topic(2)
    _produce(kafka_broker, topic, rows=600, partitions=2, ddl=False)
    capture = tmp_path / "all.jsonl"
    capture_topic(kafka_broker.bootstrap_servers, topic, capture, idle_seconds=1.0)
    records = list(read_capture(capture))
    decoder = MessageDecoder()
    messages = [(r, decoder.decode(r.value)) for r in records]
    marks = [(r.offset, m.commit_ts) for r, m in messages if r.partition == 1 and isinstance(m, Watermark)]
    cut, watermark = marks[len(marks) // 2]
    out = tmp_path / "out"
    config = _config(kafka_broker, topic, out, sink="jsonl", checkpoint=tmp_path / "checkpoint")
    options = _options(config, endingOffsets=json.dumps({topic: {"0": -1, "1": cut + 1}}))
    register(spark)
    frame = spark.read.format("ticdc").options(**options).load()
    ranges = {(r.partition, r.start_offset, r.end_offset) for r in frame.drop("records", "changes").collect()}
    end = max(r.offset for r in records if r.partition == 0) + 1
    assert ranges == {(0, 0, end), (1, 0, cut + 1)}
    handler = ChangeBatches(config)
    handler(frame, 0)
    handler.close()
    expected = {
        (r.topic, r.partition, r.offset)
        for r, m in messages
        if isinstance(m, RawDML) and m.commit_ts <= watermark and (r.partition == 0 or r.offset < cut)
    }
    delivered = _offsets_of(_delivered(out))
    assert sorted(delivered) == sorted(expected)
    assert handler.stats.records == end + cut + 1
    # ranges that hold nothing (ending where they start): an empty frame, not a failed task
    nothing = _options(
        config,
        startingOffsets=json.dumps({topic: {"0": end, "1": cut + 1}}),
        endingOffsets=json.dumps({topic: {"0": end, "1": cut + 1}}),
    )
    assert spark.read.format("ticdc").options(**nothing).load().count() == 0


@pytest.mark.slow
def test_bad_records_and_a_schema_that_never_arrives_go_to_dead_letters(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Bytes that are no message, and a row of a schema version nobody announces: both go to the error
    policy (the row once the pending timeout passed, while WATERMARKs keep batches coming), the rest is
    exact."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=1500)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    schema = workload.tables[0].schema
    orphan = DML(
        type=DMLType.INSERT,
        database="elsewhere",
        table="unknown",
        table_id=999_999,
        commit_ts=workload.last_watermark - 1,
        build_ts=0,
        schema_version=1,
        data={column.name: None for column in schema.columns},
    )
    unknown = msgspec.structs.replace(
        schema, database="elsewhere", table="unknown", table_id=999_999, version=1
    )
    stray = MessageEncoder().encode(orphan, unknown)
    kafka_broker.produce(topic, [(1, None, b"\x00not a message"), (2, b"", stray)])
    root = tmp_path / "lake"
    config = _config(kafka_broker, topic, root, pending_timeout_s=2.0)
    with WatermarkHeartbeat(workload, MessageEncoder(), kafka_broker.bootstrap_servers, topic, interval=0.3):
        stats = engine.run(config, until_idle=4.0, spark=spark)
    letters = [json.loads(line) for line in (root / "_dead_letters.jsonl").read_text().splitlines()]
    assert sorted((letter["partition"], letter["reason"].split(":")[0]) for letter in letters) == [
        (1, "CompressionError"),  # compression "auto": neither JSON, Avro, LZ4 nor snappy
        (2, "schema (elsewhere.unknown, version 1) never arrived"),
    ]
    assert stats.dead_letters == 2
    assert differences(delta_mirror_state(root, (t.schema for t in workload.tables)), truth) == []
    assert changelog_duplicates(root) == 0


def test_unknown_options_are_refused(spark: SparkSession) -> None:
    register(spark)
    with pytest.raises(Exception, match="unknown option 'startingoffset'"):
        spark.read.format("ticdc").option("kafka.bootstrap.servers", "x:1").option("subscribe", "t").option(
            "startingOffset", "earliest"
        ).load().collect()


def test_a_task_fails_on_a_range_kafka_does_not_deliver(
    kafka_broker: EmbeddedBroker, kafka_topic: Any
) -> None:
    """Offsets a batch planned that never arrive (gone, or a broker behind) fail the task: never a gap."""
    topic = kafka_topic(1)
    kafka_broker.produce(topic, [(0, None, b"{}") for _ in range(5)])
    options = TicdcOptions.parse(
        {
            "kafka.bootstrap.servers": kafka_broker.bootstrap_servers,
            "subscribe": topic,
            "kafkaConsumer.pollTimeoutMs": "500",
        }
    )
    with pytest.raises(SourceError, match=r"offsets 5\.\.7 did not arrive within"):
        list(read_range(options, OffsetRange(topic, 0, 0, 8)))


def test_a_task_of_small_ranges_reads_each_exactly_with_one_consumer(
    kafka_broker: EmbeddedBroker, kafka_topic: Any
) -> None:
    """A task's small ranges share one consumer: each range yields exactly its records, while the others'
    arrive in between and records past a range's end (the stream goes on) are not taken; a range whose
    records never come still fails the task, naming its partition."""
    topic = kafka_topic(3)
    kafka_broker.produce(topic, [(p, None, f"{p}-{i}".encode()) for i in range(40) for p in range(3)])
    options = TicdcOptions.parse(
        {
            "kafka.bootstrap.servers": kafka_broker.bootstrap_servers,
            "subscribe": topic,
            "kafkaConsumer.pollTimeoutMs": "500",
            "decode.protocol": "debezium",  # the driver decodes: the segments carry the raw records
        }
    )
    parts = [OffsetRange(topic, 0, 5, 12), OffsetRange(topic, 1, 0, 40), OffsetRange(topic, 2, 30, 31)]
    segments = [
        Segment.from_row(batch.to_pylist()[0]) for batch in read_partition(options, OffsetRanges(parts))
    ]
    assert [(s.partition, s.start_offset, s.end_offset) for s in segments] == [
        (0, 5, 12),
        (1, 0, 40),
        (2, 30, 31),
    ]
    assert [s.offsets().tolist() for s in segments] == [list(range(5, 12)), list(range(40)), [30]]
    late = [OffsetRange(topic, 0, 38, 40), OffsetRange(topic, 2, 39, 43)]
    with pytest.raises(SourceError, match=rf"{topic}\[2\]: offsets 40\.\.42 did not arrive within"):
        list(read_partition(options, OffsetRanges(late)))


@pytest.mark.slow
def test_parquet_and_a_user_function_get_typed_per_table_frames(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """The one-call job (`consumer.spark.start_lakehouse`): the Parquet sink and a user function over every
    table batch, in one availableNow query: every changelog image once, in frames typed by the mysqlType
    table."""
    topic = kafka_topic(2)
    workload = _produce(kafka_broker, topic, rows=800, partitions=2, tables=2, ddl=False)
    seen: dict[str, int] = {}
    types: dict[str, dict[str, str]] = {}

    def collect(table: TableName, frame: DataFrame, info: BatchInfo) -> None:
        name = f"{table.database}.{table.table}"
        seen[name] = seen.get(name, 0) + frame.count()
        types[name] = dict(frame.dtypes)

    root = tmp_path / "lake"
    config = _config(kafka_broker, topic, root, sink="parquet", checkpoint=tmp_path / "checkpoint")
    config.budget.max_batch_records = 700
    with start_lakehouse(spark, config, trigger={"availableNow": True}, on_table=collect) as query:
        assert query.await_termination() is True
    images = changelog_images(workload.config)
    assert sum(seen.values()) == query.stats.rows == images
    stored = 0
    for table in workload.tables:
        name = f"{table.schema.database}.{table.schema.table}"
        if table_uri(root, table.schema.database, table.schema.table) is None:  # dropped
            continue
        frame = read_changelog(spark, root, table.schema.database, table.schema.table, format="parquet")
        keys = frame.select("_topic", "_partition", "_offset", "_change_type")
        assert keys.count() == keys.distinct().count()
        stored += keys.count()
        assert {c: t for c, t in dict(frame.dtypes).items() if c in types.get(name, {})} == {
            c: t for c, t in types.get(name, {}).items() if c in dict(frame.dtypes)
        }
    assert stored == images
    assert types["shop.t0"]["_commit_time"] == "timestamp" and types["shop.t0"]["_offset"] == "bigint"
