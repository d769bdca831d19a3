"""Lakehouse throughput: Kafka -> Delta changelog, Delta mirror and Parquet, as ratios to a baseline.

Each pass is measured against a consume-and-decode baseline from the same run; then the benchmark decides
which Delta write strategy (delta-rs alone, or Spark files + a delta-rs commit) wins at which batch size.

Run: `python benchmarks/lakehouse.py [--rows N] [--batch N] [--batches N,N] [--workers N,N] [--members N]
[--repeats N] [--sizes N,N,N] [--s3]`.

1. Produce once. The simulator (4 tables: one with every column type, three narrow order-like ones;
   inserts, updates, deletes and key changes in small transactions; BOOTSTRAPs and WATERMARKs as TiCDC
   sends them; no DDLs) writes `--rows` DML events into a 4-partition topic of the embedded broker (tansu),
   rows dispatched by primary key (TiCDC's `index-value`), so every partition carries every table.
   Timed, not counted.
2. Consume the same topic once per pass, each with its own consumer group, output directory and pipeline,
   built as `ticdc-consumer run` builds them (`consumer.app.build_pipeline`,
   `consumer.configured.build_sinks`), reading every partition without group membership so a group
   join does not blur the figure. Timed: `Pipeline.run` until the last record is applied and committed;
   "in sink" is the time inside the sink's `write` (with decode workers, spent on the writer thread beside
   the loop).
   - baseline: a sink that drops every batch, i.e. Kafka fetch, envelope decode, state machine and typed
     Arrow changelog, which every sink sits behind. Run first and last; the faster one is the reference
     for the passes with as many processes and decode workers.
   - Delta changelog and Delta mirror (`DeltaSink` mode "changelog" / "mirror"), Parquet (`ParquetSink`:
     pyarrow writes the files, a manifest commits them).
   - With `--s3`: the Delta passes at `--batch` and the first worker count again, the lakehouse on a local
     S3 server (moto, a process of this run), against the same passes on the local disk.
   - Group passes (`--members` N > 1, default 2): the baseline and Delta passes again by N processes of one
     group (as `run --processes N` runs them), each assigned its share of the partitions, decoding in its
     loop, into one output; timed from when all start until the last has applied and committed its share.
   Each Delta pass runs `--repeats` times (default 2) and the fastest counts: other load on this shared
   machine only ever slows a pass. rows/s counts DML events (upstream row changes); an UPDATE is two
   changelog images. Every pass run must apply every image of the baseline without dead letters, the
   changelogs must hold them all and the mirrors as many live rows as the simulator's final tables.
3. `max_batch_records` bounds the records a cycle polls, and so the rows per Delta commit or MERGE: the
   Delta passes run at `--batch` and again at each of `--batches` (100000 is the default). Each count of
   `--workers` (`decode_workers`: processes decoding values beside the loop; default: the run default,
   then 0) gets its own baseline and Delta passes; Parquet runs at the first.
4. Write strategies for one Delta append of `--sizes` rows of the typed changelog the baseline produced
   (the narrow tables; repeated with shifted offsets where the run has fewer): delta-rs `write_deltalake`
   against Spark writing the Parquet files into the table and delta-rs committing them
   (`create_write_transaction`, add actions with the files' stats). Both tables are read back and
   compared first. Best of 3 appends per size.

Targets (issues): changelog >= 100k rows/s, mirror >= 50k rows/s; the mirror on S3 >= 0.7x the local
disk. The default run (1M rows) takes about 8
minutes on 2 cores; `--rows 50000` is a quick check (about a minute).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import deltalake
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pyspark
from deltalake import DeltaTable, write_deltalake
from deltalake.transaction import AddAction
from pyspark.sql import SparkSession

from consumer import app
from consumer.batches.changes import META_COLUMNS, TableChanges
from consumer.batches.frames import to_dataframe
from consumer.config import (
    DEFAULT_DECODE_WORKERS,
    BudgetConfig,
    ParallelismConfig,
    RunConfig,
    SinkConfig,
    SourceConfig,
)
from consumer.configured import build_sinks
from consumer.lakehouse.manifest import manifest_files
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import entry_uri, tables
from consumer.pipeline import Pipeline
from consumer.protocol.model import TableSchema
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.base import CommitContext, DDLEvent, Sink
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource
from consumer.sources.record import TopicPartition
from consumer.spark.session import spark_session
from consumer.testing.broker import EmbeddedBroker

TOPIC = "bench"
TABLES = 4
PARTITIONS = 4
REPEATS = 3
TARGETS = {"changelog": 100_000, "mirror": 50_000}
BASELINE = "baseline: consume + decode"
NAMES = {
    "changelog": "Kafka -> Delta changelog",
    "mirror": "Kafka -> Delta mirror",
    "parquet": "Kafka -> Parquet",
}


# -- 1. produce ----------------------------------------------------------------------------------------
def produce(broker: EmbeddedBroker, rows: int, encoding: str) -> tuple[Workload, dict[int, int], float]:
    """The stream, once, into the broker: (workload holding the final tables, records per partition,
    seconds). Rows are dispatched by primary key (TiCDC's `index-value`), so every partition carries every
    table and group members share the work evenly."""
    config = WorkloadConfig(
        rows=rows,
        tables=TABLES,
        partitions=PARTITIONS,
        ddl=False,
        dispatch="primary-key",
        start_physical_ms=1_700_000_000_000,
    )
    workload = Workload(config)
    started = time.perf_counter()
    report = produce_to_kafka(workload, MessageEncoder(encoding), broker.bootstrap_servers, TOPIC)  # type: ignore[arg-type]
    return workload, report.end_offsets, time.perf_counter() - started


# -- 2. consume ----------------------------------------------------------------------------------------
class DropSink:
    """Writes nothing; keeps the changelogs `keep` selects (for the write-strategy comparison)."""

    def __init__(self, keep: Callable[[TableChanges], bool] = lambda _: False) -> None:
        self.keep = keep
        self.kept: list[TableChanges] = []

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        if self.keep(changes):
            self.kept.append(changes)

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        return None

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {}

    def recorded_schema_snapshot(self) -> bytes | None:
        return None

    def close(self) -> None:
        return None


class TimedSink:
    """Delegates to a sink and keeps how long its writes took: the sink's share of a pass."""

    def __init__(self, inner: Sink) -> None:
        self.inner = inner
        self.writes = 0
        self.seconds = 0.0

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        started = time.perf_counter()
        self.inner.write(changes, context)
        self.seconds += time.perf_counter() - started
        self.writes += 1

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        self.inner.apply_ddl(event, context)

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return self.inner.recorded_offsets(group)

    def recorded_schema_snapshot(self) -> bytes | None:
        return self.inner.recorded_schema_snapshot()

    def close(self) -> None:
        self.inner.close()


class _AllApplied(Exception):
    """Raised from `on_cycle` once every produced record went through: ends `Pipeline.run`."""


@dataclass
class Pass:
    name: str
    sink: str  # "drop", "changelog", "mirror" or "parquet"
    root: str  # a directory, or an s3:// URI (`--s3`)
    batch: int
    workers: int
    members: int = 1  # processes of one consumer group, each reading its share of the partitions
    seconds: float = 0.0
    sink_seconds: float = 0.0
    writes: int = 0
    images: int = 0
    dead_letters: int = 0


def consume(broker: EmbeddedBroker, run: Pass, records: int, inner: Sink | None = None) -> Pass:
    """One pass over the whole topic, with its own group, into `inner` or the sink `ticdc-consumer run`
    builds for the pass."""
    group = f"bench-{uuid.uuid4().hex[:8]}"
    kind = {"parquet": "parquet", "changelog": "delta", "mirror": "delta"}.get(run.sink, "jsonl")
    config = RunConfig(
        source=SourceConfig(url=f"kafka://{broker.bootstrap_servers}/{TOPIC}", group=group),
        sink=SinkConfig(url=f"{kind}:{run.root}", mode=run.sink if kind == "delta" else "both"),  # type: ignore[arg-type]
        budget=BudgetConfig(max_batch_records=run.batch),
        parallelism=ParallelismConfig(decode_workers=run.workers),
    )
    sink = TimedSink(inner if inner is not None else build_sinks(config)[0])
    pipeline = app.build_pipeline(config, sinks=[sink])
    source = KafkaSource(
        broker.bootstrap_servers, [TOPIC], group, partitions=ALL_PARTITIONS, listener=pipeline
    )

    def stop_when_done(p: Pipeline) -> None:
        if p.stats.records >= records:
            raise _AllApplied

    gc.collect()
    started = time.perf_counter()
    try:
        pipeline.run(source, on_cycle=stop_when_done)
    except _AllApplied:
        pass
    finally:
        run.seconds = time.perf_counter() - started
        source.close()
        sink.close()
        pipeline.dead_letters.close()
    stats = pipeline.stats
    assert stats.records == records, (run.name, stats.records, records)
    run.images, run.dead_letters = stats.rows, stats.dead_letters
    run.sink_seconds, run.writes = sink.seconds, sink.writes
    print(f"  {run.name}, batch {run.batch:,}, {run.workers} workers: {run.seconds:.1f} s", flush=True)
    return run


def consume_as_members(broker: EmbeddedBroker, run: Pass, end_offsets: dict[int, int]) -> Pass:
    """One pass by `run.members` processes of one group, each reading its share of the partitions (assigned,
    as after a rebalance, so the group join is not timed) into the same output root. Timed from the moment
    they all start until the last one has applied and committed its share."""
    group = f"bench-{uuid.uuid4().hex[:8]}"
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(run.members)
    results = context.Queue()
    shares = [sorted(end_offsets)[index :: run.members] for index in range(run.members)]
    members = [
        context.Process(
            target=member,
            args=(broker.bootstrap_servers, run, group, {p: end_offsets[p] for p in share}, start, results),
        )
        for share in shares
    ]
    for process in members:
        process.start()
    reports = [results.get() for _ in members]
    for process in members:
        process.join()
    run.seconds = max(r["ended"] for r in reports) - min(r["started"] for r in reports)
    run.images = sum(r["images"] for r in reports)
    run.dead_letters = sum(r["dead_letters"] for r in reports)
    run.sink_seconds = sum(r["sink_seconds"] for r in reports)
    run.writes = sum(r["writes"] for r in reports)
    print(f"  {run.name}, batch {run.batch:,}, {run.members} members: {run.seconds:.1f} s", flush=True)
    return run


def member(servers: str, run: Pass, group: str, shares: dict[int, int], start: Any, results: Any) -> None:
    """A group member's process: its own pipeline (decoding in its loop) over its partitions."""
    config = RunConfig(
        source=SourceConfig(url=f"kafka://{servers}/{TOPIC}", group=group),
        sink=SinkConfig(
            url=f"{'delta' if run.sink != 'drop' else 'jsonl'}:{run.root}",
            mode=run.sink if run.sink != "drop" else "both",
        ),  # type: ignore[arg-type]
        budget=BudgetConfig(max_batch_records=run.batch),
        parallelism=ParallelismConfig(decode_workers=run.workers),
    )
    sink = TimedSink(DropSink() if run.sink == "drop" else build_sinks(config)[0])
    pipeline = app.build_pipeline(config, sinks=[sink])
    source = KafkaSource(servers, [TOPIC], group, partitions=[(TOPIC, p) for p in shares], listener=pipeline)
    records = sum(shares.values())

    def stop_when_done(p: Pipeline) -> None:
        if p.stats.records >= records:
            raise _AllApplied

    start.wait()
    started = time.monotonic()
    with contextlib.suppress(_AllApplied):
        pipeline.run(source, on_cycle=stop_when_done)
    ended = time.monotonic()
    source.close()
    pipeline.close()
    stats = pipeline.stats
    assert stats.records == records, (run.name, stats.records, records)
    results.put(
        {
            "started": started,
            "ended": ended,
            "images": stats.rows,
            "dead_letters": stats.dead_letters,
            "sink_seconds": sink.seconds,
            "writes": sink.writes,
        }
    )


def written_rows(run: Pass) -> int:
    """What a pass left in its output: changelog rows, or the mirrors' live rows (every table of the
    lakehouse catalog)."""
    lake = LakeRoot.of(run.root)
    if run.sink == "parquet":
        filesystem, _ = lake.filesystem()
        listed = (manifest_files(lake, entry.location) or [] for entry in tables(lake))
        return sum(
            pq.read_metadata(path, filesystem=filesystem).num_rows for files in listed for path in files
        )
    opened = (lake.open(entry_uri(lake, entry, run.sink)) for entry in tables(lake))  # type: ignore[arg-type]
    return sum(lake.scan(table).count_rows() for table in opened if table is not None)


def verify_passes(passes: list[Pass], live: int) -> None:
    images = passes[0].images
    for run in passes:
        assert run.images == images and run.dead_letters == 0, (run.name, run.images, images)
        if run.sink != "drop":
            expected = live if run.sink == "mirror" else images
            assert written_rows(run) == expected, (run.name, run.batch, written_rows(run), expected)


def merge_amplification(run: Pass) -> str:
    """From the mirrors' Delta history: rows the MERGEs wrote per source row, files they scanned and
    skipped, and how the cost of one MERGE grew from the first to the last."""
    source = output = count = scanned = skipped = 0
    first_ms: list[int] = []
    last_ms: list[int] = []
    lake = LakeRoot.of(run.root)
    for entry in tables(lake):
        table = lake.open(entry_uri(lake, entry, "mirror"))
        history = table.history() if table is not None else []
        merges = [c["operationMetrics"] for c in history if c.get("operation") == "MERGE"]
        if not merges:
            continue
        count += len(merges)
        source += sum(m["num_source_rows"] for m in merges)
        output += sum(m["num_output_rows"] for m in merges)
        scanned += sum(m["num_target_files_scanned"] for m in merges)
        skipped += sum(m["num_target_files_skipped_during_scan"] for m in merges)
        last_ms.append(merges[0]["execution_time_ms"])  # history is newest first
        first_ms.append(merges[-1]["execution_time_ms"])
    first, last = sum(first_ms) / len(first_ms), sum(last_ms) / len(last_ms)
    return (
        f"{run.name}, batch {run.batch:,}: {count} MERGEs wrote {output:,} rows for {source:,} source "
        f"rows ({output / source:.1f}x), scanned {scanned} files and skipped {skipped}; a table's first "
        f"MERGE took {first:.0f} ms, its last {last:.0f} ms"
    )


# -- 4. write strategies -------------------------------------------------------------------------------
def storable(changelog: pa.Table) -> pa.Table:
    """The changelog as the Delta sink stores it: user columns nullable, TIME (duration) as int64 us."""
    fields, arrays = [], []
    for column_field, column in zip(changelog.schema, changelog.columns, strict=True):
        kind = pa.int64() if pa.types.is_duration(column_field.type) else column_field.type
        nullable = column_field.nullable or column_field.name not in META_COLUMNS
        fields.append(pa.field(column_field.name, kind, nullable=nullable))
        arrays.append(column.cast(kind))
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def sized(base: pa.Table, rows: int) -> pa.Table:
    """`rows` rows of `base`, repeated with offsets shifted past the previous copy where it is shorter."""
    copies, span = [], pc.max(base["_offset"]).as_py() + 1
    for copy in range(math.ceil(rows / base.num_rows)):
        part = base.slice(0, rows - copy * base.num_rows)
        offsets = pc.add(part["_offset"], copy * span)
        copies.append(part.set_column(part.schema.get_field_index("_offset"), "_offset", offsets))
    return pa.concat_tables(copies).combine_chunks()


def write_delta_rs(path: Path, data: pa.Table) -> dict[str, float]:
    write_deltalake(str(path), data, mode="append")
    return {}


def write_spark(spark: SparkSession, schema: TableSchema, path: Path, data: pa.Table) -> dict[str, float]:
    """Spark writes the data files (a task per core) into a fresh directory inside the table; delta-rs
    commits them, which makes the write atomic: until then no reader sees them. Returns phase seconds."""
    marks = [time.perf_counter()]
    directory = f"spark-{uuid.uuid4().hex}"
    frame = to_dataframe(spark, TableChanges(schema, data))  # stages the Arrow batches for the JVM
    marks.append(time.perf_counter())
    frame.write.parquet(str(path / directory))
    marks.append(time.perf_counter())
    files = sorted((path / directory).glob("part-*.parquet"))
    table = DeltaTable(str(path))
    actions = [add_action(path, f"{directory}/{file.name}") for file in files]
    table.create_write_transaction(actions, mode="append", schema=table.schema())
    marks.append(time.perf_counter())
    phases = ("createDataFrame", "write job (reads the Arrow batches)", "stats + commit")
    return {phase: end - start for phase, start, end in zip(phases, marks, marks[1:], strict=False)}


def add_action(table: Path, relative: str) -> AddAction:
    """A Delta add action for a Parquet file: size, mtime and stats from its footer (row count, null counts,
    min/max of the flat numeric and temporal columns: enough to skip files on keys and `_commit_ts`)."""
    stat = (table / relative).stat()
    metadata = pq.read_metadata(table / relative)
    nulls: dict[str, int] = {}
    low: dict[str, Any] = {}
    high: dict[str, Any] = {}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            column = row_group.column(index)
            name, stats = column.path_in_schema, column.statistics
            if "." in name or stats is None:
                continue  # nested (lists): no stats
            nulls[name] = nulls.get(name, 0) + stats.null_count
            if stats.has_min_max and _orderable(stats.min) and _orderable(stats.max):
                low[name] = min(low.get(name, stats.min), stats.min)
                high[name] = max(high.get(name, stats.max), stats.max)
    document = {
        "numRecords": metadata.num_rows,
        "minValues": {k: _stat_json(v) for k, v in low.items()},
        "maxValues": {k: _stat_json(v) for k, v in high.items()},
        "nullCount": nulls,
    }
    return AddAction(relative, stat.st_size, {}, int(stat.st_mtime * 1000), True, json.dumps(document))


def _orderable(value: Any) -> bool:
    if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        return False
    return isinstance(value, int | float | date | Decimal)  # a datetime is a date


def _stat_json(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat(timespec="microseconds").replace("+00:00", "Z")
    if isinstance(value, date):
        return value.isoformat()
    return float(value) if isinstance(value, Decimal) else value


@dataclass
class Timing:
    seconds: float = math.inf
    phases: dict[str, float] = field(default_factory=dict)


def best_of(run: Callable[[], dict[str, float]]) -> Timing:
    best = Timing()
    for _ in range(REPEATS):
        started = time.perf_counter()
        phases = run()
        seconds = time.perf_counter() - started
        if seconds < best.seconds:
            best = Timing(seconds, phases)
    return best


def verify_strategies(spark: SparkSession, schema: TableSchema, data: pa.Table, work: Path) -> None:
    """Both strategies give the same Delta table, and delta-rs skips the Spark files by their stats."""
    ours, theirs = work / "verify-delta-rs", work / "verify-spark"
    write_delta_rs(ours, data)
    DeltaTable.create(str(theirs), data.schema)
    write_spark(spark, schema, theirs, data)
    order = [("_partition", "ascending"), ("_offset", "ascending"), ("_change_type", "ascending")]
    read = [DeltaTable(str(path)).to_pyarrow_table().sort_by(order) for path in (ours, theirs)]
    assert read[1].num_rows == data.num_rows and read[0].equals(read[1]), "the two Delta tables differ"
    newest = pc.max(data["_commit_ts"]).as_py()
    assert DeltaTable(str(theirs)).to_pyarrow_table(filters=[("_commit_ts", ">", newest)]).num_rows == 0


def compare_strategies(
    spark: SparkSession, schema: TableSchema, changelog: pa.Table, sizes: Sequence[int], work: Path
) -> list[tuple[int, Timing, Timing]]:
    """(rows, delta-rs, Spark) per size: best of REPEATS appends to a table of each, created beforehand."""
    verify_strategies(spark, schema, sized(changelog, min(sizes)), work)
    print("  verified: both give the same Delta table; delta-rs skips the Spark files by their stats")
    results = []
    for rows in sizes:
        data = sized(changelog, rows)
        ours, theirs = work / f"delta-rs-{rows}", work / f"spark-{rows}"
        for path in (ours, theirs):
            DeltaTable.create(str(path), data.schema)
        ours_t = best_of(lambda ours=ours, data=data: write_delta_rs(ours, data))
        theirs_t = best_of(lambda theirs=theirs, data=data: write_spark(spark, schema, theirs, data))
        print(f"  {rows:,} rows: delta-rs {ours_t.seconds:.2f} s, Spark {theirs_t.seconds:.2f} s", flush=True)
        results.append((rows, ours_t, theirs_t))
    return results


def warm_up(spark: SparkSession, changes: TableChanges, work: Path) -> None:
    """One small Spark write first: the JVM's first job (class loading, JIT) is not a per-batch cost."""
    sample = TableChanges(changes.schema, changes.changelog.slice(0, 1000))
    to_dataframe(spark, sample).write.parquet(str(work / f"warm-up-{uuid.uuid4().hex}"))


# -- report --------------------------------------------------------------------------------------------
def print_passes(passes: list[Pass], dml_rows: int) -> None:
    """Each pass against the faster baseline with as many processes and decode workers."""
    reference: dict[tuple[int, int], Pass] = {}
    for run in passes:
        best = reference.get((run.members, run.workers))
        if run.sink == "drop" and (best is None or run.seconds < best.seconds):
            reference[run.members, run.workers] = run
    width = max(len(run.name) for run in passes) + 2
    head = (
        f"{'pass':<{width}} {'members':>7} {'workers':>7} {'batch':>7} {'seconds':>8} {'in sink':>8} "
        f"{'writes':>6} {'rows/s':>8} {'images/s':>9} {'/ baseline':>10} {'target':>8} {'/ target':>8}"
    )
    print(head)
    print("-" * len(head))
    for run in passes:
        rate = dml_rows / run.seconds
        target = TARGETS.get(run.sink)
        print(
            f"{run.name:<{width}} {run.members:>7} {run.workers:>7} {run.batch:>7,} {run.seconds:>8.1f} "
            f"{run.sink_seconds:>8.1f} {run.writes:>6} {rate:>8,.0f} {run.images / run.seconds:>9,.0f} "
            f"{reference[run.members, run.workers].seconds / run.seconds:>9.2f}x "
            f"{f'{target:,}' if target else '':>8} {f'{rate / target:.2f}x' if target else '':>8}"
        )


def print_strategies(results: list[tuple[int, Timing, Timing]], available: int) -> None:
    head = (
        f"{'rows':>9} {'delta-rs rows/s':>16} {'Spark + commit rows/s':>22} {'Spark / delta-rs':>17}  winner"
    )
    print(head)
    print("-" * len(head))
    for rows, ours, theirs in results:
        winner = "Spark + commit" if theirs.seconds < ours.seconds else "delta-rs"
        print(
            f"{rows:>9,} {rows / ours.seconds:>16,.0f} {rows / theirs.seconds:>22,.0f} "
            f"{ours.seconds / theirs.seconds:>16.2f}x  {winner}"
        )
    for rows, _, theirs in results:
        phases = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in theirs.phases.items())
        print(f"Spark's time at {rows:,} rows: {phases}")
    print_decision(results)
    if any(rows > available for rows, _, _ in results):
        print(
            f"(the run decoded {available:,} narrow-table images; larger sizes repeat them, offsets shifted)"
        )


def print_decision(results: list[tuple[int, Timing, Timing]]) -> None:
    """The smallest size where Spark wins; else whether a larger size could still cross over, judged by the
    cost of each further row between the two largest sizes."""
    wins = [rows for rows, ours, theirs in results if theirs.seconds < ours.seconds]
    if wins:
        print(f"decision: Spark writes + delta-rs commits from {min(wins):,} rows per commit, delta-rs below")
        return
    print(f"decision: delta-rs write_deltalake at every size up to {max(r for r, _, _ in results):,} rows")
    if len(results) >= 2:
        (small, ours_s, theirs_s), (large, ours_l, theirs_l) = sorted(results, key=lambda r: r[0])[-2:]
        ours_rate = (large - small) / max(ours_l.seconds - ours_s.seconds, 1e-9)
        theirs_rate = (large - small) / max(theirs_l.seconds - theirs_s.seconds, 1e-9)
        verdict = "no cross-over at larger sizes either" if theirs_rate < ours_rate else "larger may cross"
        print(
            f"  rows added per second between {small:,} and {large:,} rows: delta-rs {ours_rate:,.0f}, "
            f"Spark {theirs_rate:,.0f}: {verdict}"
        )


def print_s3_ratios(passes: list[Pass]) -> None:
    """Each Delta pass on the S3 server against the same pass on the local disk."""
    for s3 in (run for run in passes if run.root.startswith("s3://")):
        local = next(
            run
            for run in passes
            if run.sink == s3.sink
            and run.batch == s3.batch
            and run.workers == s3.workers
            and run.members == 1
            and not run.root.startswith("s3://")
        )
        print(
            f"{s3.name}: {args_rate(s3):,.0f} images/s, {local.seconds / s3.seconds:.2f}x the local disk's "
            f"{args_rate(local):,.0f} (target for the mirror: >= 0.7x)"
        )


def args_rate(run: Pass) -> float:
    return run.images / run.seconds


@contextlib.contextmanager
def local_s3(enabled: bool) -> Iterator[str | None]:
    """With `enabled`, a moto S3 server process for the run (stopped at its end), reached through the
    standard AWS_* variables as delta-rs and pyarrow take them; yields a fresh bucket's URI."""
    if not enabled:
        yield None
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        os.environ.update(
            AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
            AWS_ALLOW_HTTP="true",
            AWS_REGION="us-east-1",
            AWS_ACCESS_KEY_ID="bench",
            AWS_SECRET_ACCESS_KEY="bench",
        )
        endpoint = f"127.0.0.1:{port}"
        bucket = pafs.S3FileSystem(endpoint_override=endpoint, scheme="http", allow_bucket_creation=True)
        bucket.create_dir("lakehouse-bench")
        yield "s3://lakehouse-bench"
    finally:
        server.terminate()
        server.wait(30)


# -- main ----------------------------------------------------------------------------------------------
def run_passes(
    broker: EmbeddedBroker,
    args: argparse.Namespace,
    work: Path,
    end_offsets: dict[int, int],
    spark: SparkSession,
    s3_root: str | None,
) -> tuple[list[Pass], list[Pass], DropSink]:
    """Per decode-worker count: a baseline, then the Delta passes; Parquet at the first count; then, with
    `--members` > 1, the same as a group of processes; the baselines again at the end (the faster of each
    pair is the reference). Each Delta pass runs `--repeats` times, the fastest counts. Returns the passes
    that count, every pass run (all are verified) and the narrow tables' changelogs. With `s3_root`, the
    Delta passes at `--batch` and the first worker count run again into it."""
    narrow = DropSink(keep=lambda changes: changes.table != "t0")  # t0 has every type, t1..t3 are narrow
    records = sum(end_offsets.values())
    every: list[Pass] = []

    def counted(run: Pass) -> Pass:
        every.append(run)
        return run

    def fastest(make: Callable[[int], Pass]) -> Pass:
        return min((counted(make(repeat)) for repeat in range(args.repeats)), key=lambda run: run.seconds)

    def baseline(workers: int, sink: DropSink | None = None) -> Pass:
        run = Pass(BASELINE, "drop", str(work / "baseline"), args.batch, workers)
        return counted(consume(broker, run, records, sink or DropSink()))

    def sink_pass(sink: str, batch: int, workers: int, repeat: int = 0, root: str | None = None) -> Pass:
        where = root or str(work)
        name = NAMES[sink] + (" on S3" if root else "")
        run = Pass(name, sink, f"{where}/{sink}-{batch}-{workers}-{repeat}", batch, workers)
        return consume(broker, run, records)

    def group_pass(sink: str, repeat: int = 0) -> Pass:
        name = BASELINE if sink == "drop" else NAMES[sink]
        run = Pass(name, sink, str(work / f"{sink}-members-{repeat}"), args.batch, 0, args.members)
        return consume_as_members(broker, run, end_offsets)

    first = args.workers[0]
    passes = []
    for workers in args.workers:
        passes.append(baseline(workers, narrow if workers == first else None))
        for batch in dict.fromkeys([args.batch, *args.batches]):
            for sink in ("changelog", "mirror"):
                passes.append(fastest(lambda repeat, s=sink, b=batch, w=workers: sink_pass(s, b, w, repeat)))
    if s3_root:  # the same Delta passes with the lakehouse on the S3 server
        for sink in ("changelog", "mirror"):
            passes.append(fastest(lambda repeat, s=sink: sink_pass(s, args.batch, first, repeat, s3_root)))
    warm_up(spark, narrow.kept[0], work)
    passes.append(counted(sink_pass("parquet", args.batch, first)))
    grouped = args.members > 1
    if grouped:
        passes.append(counted(group_pass("drop")))
        for sink in ("changelog", "mirror"):
            passes.append(fastest(lambda repeat, s=sink: group_pass(s, repeat)))
    passes += [baseline(workers) for workers in args.workers]
    if grouped:
        passes.append(counted(group_pass("drop", 1)))
    return passes, every, narrow


def parse_sizes(text: str, least: int = 1) -> list[int]:
    try:
        values = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) < least:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers >= {least}, not {text!r}")
    return list(dict.fromkeys(values))


def parse_workers(text: str) -> list[int]:
    return parse_sizes(text, least=0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="DML events produced (default 1000000)")
    parser.add_argument(
        "--batch", type=int, default=100_000, help="max_batch_records of every pass (default 100000)"
    )
    parser.add_argument(
        "--batches",
        type=parse_sizes,
        default=[],
        help="more max_batch_records for the Delta passes (e.g. 20000)",
    )
    parser.add_argument(
        "--workers",
        type=parse_workers,
        default=list(dict.fromkeys([DEFAULT_DECODE_WORKERS, 0])),
        help=f"decode worker counts, the first also for Parquet (default {DEFAULT_DECODE_WORKERS},0)",
    )
    parser.add_argument(
        "--sizes",
        type=parse_sizes,
        default=[10_000, 100_000, 500_000],
        help="rows per append (strategies; default 10000,100000,500000)",
    )
    parser.add_argument(
        "--members",
        type=int,
        default=2,
        help="processes of one consumer group for the group passes, 0 or 1 to skip them (default 2)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs of each Delta pass, the fastest counts: other load on the machine only slows (default 2)",
    )
    parser.add_argument("--encoding", choices=("json", "avro"), default="json", help="(default json)")
    parser.add_argument(
        "--s3", action="store_true", help="also run the Delta passes into s3:// on a local S3 server (moto)"
    )
    parser.add_argument("--workdir", type=Path, help="keep the outputs here (default: a temporary directory)")
    args = parser.parse_args(argv)
    if min(args.rows, args.batch, args.repeats) <= 0:
        parser.error("--rows, --batch and --repeats must be positive")

    began = time.perf_counter()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="lakehouse-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"Lakehouse throughput; {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, pyarrow "
        f"{pa.__version__}, deltalake {deltalake.__version__}, pyspark {pyspark.__version__}"
    )
    spark = spark_session("ticdc-bench")
    spark.sparkContext.setLogLevel("ERROR")
    try:
        with EmbeddedBroker() as broker, local_s3(args.s3) as s3_root:
            workload, end_offsets, produce_seconds = produce(broker, args.rows, args.encoding)
            print(
                f"produced {args.rows:,} DML events ({sum(end_offsets.values()):,} records, {args.encoding}, "
                f"{TABLES} tables, {PARTITIONS} partitions, dispatched by primary key) in "
                f"{produce_seconds:.1f} s (not counted)",
                flush=True,
            )
            passes, every, narrow = run_passes(broker, args, work, end_offsets, spark, s3_root)
            live = sum(len(table.rows) for table in workload.tables if not table.dropped)
            verify_passes(every, live)
            print()
            print(
                f"{args.rows:,} DML events = {passes[0].images:,} changelog images; rows/s counts DML events"
            )
            print(
                "verified: every pass applied every image, no dead letters; the Delta and Parquet changelogs"
            )
            print(f"hold every image, the Delta mirrors {live:,} live rows (the simulator's final tables)")
            print()
            print_passes(passes, args.rows)
            print_s3_ratios(passes)
            for run in passes:
                if run.sink == "mirror":
                    print(merge_amplification(run))

        print()
        print(f"write strategies: one Delta append of the typed changelog (narrow tables), best of {REPEATS}")
        schema = narrow.kept[0].schema
        changelog = storable(pa.concat_tables([changes.changelog for changes in narrow.kept]))
        results = compare_strategies(spark, schema, changelog, args.sizes, work / "strategies")
        print_strategies(results, changelog.num_rows)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(f"total run time {time.perf_counter() - began:.0f} s, producing included")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
