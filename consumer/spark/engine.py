"""The Spark engine: the loop engine's pipeline, fed by a `ticdc` stream's micro-batches.

Executors read Kafka ranges and decode (`consumer.spark.source`); the stream's foreachBatch function,
`ChangeBatches`, runs in the driver: it feeds each batch's records, in partition offset order, to the same
`Pipeline` and `ConsumerState` the loop engine uses (schemas from DDLs and BOOTSTRAPs, rows held until their
schema arrives, ordering by the global watermark, DDL barriers, the pending timeout and the error policy),
and the pipeline applies the resolved units to the same `Sink` objects. Rows the executors typed stay in
the files they spooled them to (`Segment.spool`) and reach the state machine as blocks, one per partition
range and schema version (`Segment.blocks`): it orders them by their index (offsets, commit ts), and the
Delta sink has Spark tasks write their changelog files, which it commits here (`ExecutorAppends`), so no
typed row passes through this process; only records the executors could not type are decoded here, one by
one. A thread applies batch N while the executors read batch N+1; the schemas batch N announces are recorded
as it is handed over, so batch N+1's tasks type rows with them. Delta mirrors are not MERGEd here: as
progress is recorded (every micro-batch) the mirrors due are MERGEd from the changelog by Spark tasks, one
per table (`consumer.spark.merges`); the driver only says which tables and up to which TSO.

Exactly once across a driver killed at any point:

- Before a batch is handed to the applying thread, its Kafka ranges are recorded in the state location;
  after the sinks applied it, what it leaves unapplied (rows waiting, DDL copies), each partition's last
  WATERMARK and the schema cache are (`consumer.spark.carry`). A restarted driver starts from the latest
  such record, as a restarted loop engine starts from its committed offsets, and reads again from Kafka a
  batch Spark had committed whose applying it did not finish.
- A batch whose record exists is complete: Spark running it again (it had not recorded its commit) skips it.
- A batch interrupted mid-way runs again from the previous record; the sinks skip the rows they hold (Delta
  app transactions and the Parquet manifest per partition), DDLs are idempotent.
- A new checkpoint on the same lake starts a partition where the sinks' recorded offsets say (as a loop
  engine joining a group does: the query's `startingOffsets`), and the sinks skip anything they hold. A
  checkpoint behind the lake (the loop engine ran since) feeds none of the records before those offsets.
  Either engine takes over from the other: the same group, app transactions, progress and schema records.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
from pyspark.errors import PySparkException, StreamingQueryException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery

from consumer.config import RunConfig, check_engine
from consumer.configured import (
    build_dead_letters,
    build_decoder,
    build_large_messages,
    build_policy,
    build_sinks,
    build_state,
)
from consumer.errors import ConsumerError
from consumer.kill_points import start_gate
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.pipeline import DecodedRecord, Pipeline, PipelineStats
from consumer.pipeline.loop import BEHIND_GRACE_S
from consumer.pipeline.resume import PROGRESS_SECONDS, recorded_offsets
from consumer.protocol.model import Watermark
from consumer.sinks.base import Sink
from consumer.sinks.dead_letter import DeadLetterQueue
from consumer.sinks.delta import DeltaSink
from consumer.sinks.foreach_batch import BatchFunction, ForeachBatchSink
from consumer.sinks.parquet import ParquetSink
from consumer.sources.ends import EARLIEST, EndOffsets, PartitionEnd, unread
from consumer.sources.group_commits import GroupCommits
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.spark.carry import Carry, CarryStore
from consumer.spark.merges import ExecutorAppends, ExecutorHistories, ExecutorMerges, ExecutorParquet
from consumer.spark.segments import Segment
from consumer.spark.session import spark_session
from consumer.spark.source import (
    TASK_SETTINGS,
    OffsetRange,
    TicdcOptions,
    parse_offsets,
    read_range,
    register,
    starting_offsets,
)
from consumer.state.schema_cache import snapshot_schemas
from consumer.stopping import StopRequest
from consumer.watchdog import Watchdog

log = logging.getLogger(__name__)

STATE_DIRECTORY = "ticdc"  # the engine's record, inside the query's checkpoint directory
IDLE_POLL_SECONDS = 0.5  # with --until-idle: the pause between availableNow runs that found nothing new
STOP_POLL_SECONDS = 1  # how often a running query looks at the stop request (whole seconds: the API)
_CHANGE_ORDER = [(name, "ascending") for name in ("_commit_ts", "_topic", "_partition", "_offset")]


class SparkQueryError(ConsumerError):
    """The streaming query failed outside the foreachBatch function (e.g. a task could not read Kafka)."""


class WorkerStartError(SparkQueryError):
    """A Python worker the query needed did not connect back to the JVM within Spark's fixed 10 s (the
    streaming source's planner, started with each query: on a loaded machine its start-up can take
    longer). Nothing was applied by the failed query, so starting it again is exact."""


WORKER_STARTS = 3  # query starts tried when its Python worker does not connect back in time


class _SparkOffsets:
    """The `Source` the pipeline sees: Spark reads Kafka by ranges, so the pipeline's commits go to Kafka for
    the group without joining it (`GroupCommits`: lag tools, `status` and a loop member taking over read
    them), and pauses go to the planner through the engine's record."""

    def __init__(self, commits: GroupCommits, topics: Sequence[str]) -> None:
        self._commits = commits
        self._topics = topics
        self.assigned: set[TopicPartition] = set()
        self.first: dict[TopicPartition, int] = {}  # the first offset fed, per partition
        self.paused: set[TopicPartition] = set()
        self._counts: dict[str, int] = {}
        self._counted = -1  # how many partitions were assigned when the counts were read

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        return []

    def commit(
        self, offsets: Mapping[TopicPartition, int], watermarks: Mapping[TopicPartition, int] | None = None
    ) -> None:
        self._commits.commit(offsets, watermarks)

    def committed_watermarks(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {}  # a partition new to the query resumes with the watermark the lake's progress recorded

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        return {tp: self.first.get(tp) for tp in partitions}

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self.paused |= set(partitions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self.paused -= set(partitions)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def partition_counts(self) -> dict[str, int]:
        """`CountsPartitions`: read again whenever a partition new to the query was fed."""
        if self._counted != len(self.assigned):
            counts = self._commits.partition_counts(self._topics)
            if counts is not None:
                self._counts, self._counted = counts, len(self.assigned)
        return dict(self._counts)

    def close(self) -> None:
        return None


class ChangeBatches:
    """The foreachBatch function of a `ticdc` stream read with `stream_options(config)`:
    `segments.writeStream.foreachBatch(ChangeBatches(config))`.

    Everything comes from the run configuration `config`, built as the loop engine builds it
    (`consumer.configured`): the decoder (any protocol, with its registry), value policy, state machine,
    sinks, dead letters and the large-message resolver; `sinks`, `dead_letters` and `large_messages`
    replace the configured ones. The engine's record is kept in `<checkpoint>/ticdc` (`checkpoint_location`),
    with the typed rows' spool files (`<checkpoint>/ticdc/spool`). A Delta changelog on a local root is
    written by Spark tasks (`ExecutorAppends`) and committed here.
    Delta mirrors are MERGEd from the changelog by Spark tasks, one per table due (`ExecutorMerges`), as
    progress is recorded (every micro-batch, or at `[sink] mirror_interval_s`/`_rows`): no mirror row
    passes through the driver (`executor_merges=False`: MERGEd here from the batch, as the loop engine
    does).
    `on_batch(pipeline)` runs after every batch, on the applying thread (progress display). Call `close`
    when the query is over: it applies the last batch handed over.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        sinks: Sequence[Sink] | None = None,
        dead_letters: DeadLetterQueue | None = None,
        large_messages: LargeMessageResolver | None = None,
        on_batch: Callable[[Pipeline], None] | None = None,
        executor_merges: bool = True,
    ) -> None:
        check_engine(config, "spark")
        self.config = config
        policy = build_policy(config)
        self.sinks = list(sinks) if sinks is not None else build_sinks(config)
        self.options = _starting_where_recorded(stream_options(config), self.sinks)
        self.dead_letters = dead_letters or build_dead_letters(config)
        self.large_messages = large_messages or build_large_messages(config, policy)
        self.on_batch = on_batch
        self.merges = ExecutorMerges() if executor_merges else None
        for sink in self.sinks:  # the changelog written and the mirrors MERGEd from it on the executors
            if isinstance(sink, DeltaSink) and "changelog" in sink.outputs:
                sink.append_with(ExecutorAppends())
            if isinstance(sink, DeltaSink) and "history" in sink.outputs:
                sink.history_with(ExecutorHistories())
            if isinstance(sink, ParquetSink):
                sink.append_with(ExecutorParquet())
            if self.merges is not None and isinstance(sink, DeltaSink) and "mirror" in sink.outputs:
                sink.run_merges_with(self.merges)
        self.failure: BaseException | None = None  # what stopped the query, if this function did
        self.changed_batches = 0  # batches with a change record (anything but WATERMARKs)
        self.executor_cpu_seconds = 0.0  # the tasks' CPU time on this process's batches
        self._store = CarryStore(self.options.state_location)
        self._commits = GroupCommits(self.options.bootstrap_servers, self.options.group, self.options.kafka)
        self._policy = policy
        self._decoder = build_decoder(config.decode, policy)
        self._stats = PipelineStats()
        self._watchdog = Watchdog(config.watchdog.stall_after_s)  # one for every pipeline: their stalls
        self._pipeline: Pipeline | None = None
        self._source = _SparkOffsets(self._commits, self.options.topics)
        self._next_batch: int | None = None  # the batch id the in-memory state expects next
        self._live: list[Segment] = []  # the records fed and not yet carried
        self._unfed: list[Segment] = []  # a restored carry, fed before the next batch
        self._watermarks: dict[TopicPartition, int] = {}  # each partition's last WATERMARK offset
        self._starts: dict[TopicPartition, int] = {}  # the lake's resume offsets, where ahead of the query
        self._applier = ThreadPoolExecutor(1, thread_name_prefix="ticdc-apply")
        self._applying: Future[None] | None = None  # the batch handed over last, while it is applied
        self._ends: EndOffsets | None = None  # made when first asked (`check_ends`)

    @property
    def stats(self) -> PipelineStats:
        return self._stats

    def __call__(self, frame: DataFrame, batch_id: int) -> None:
        """Collect batch `batch_id` (the executors read and decode it while the previous batch is still
        being applied here), record its ranges, and hand it to the applying thread."""
        try:
            rows = _collected(frame, batch_id)  # the one action: each action would read Kafka again
            self.drain()
            if self._next_batch != batch_id and self._restore(batch_id):
                return
            segments = sorted((Segment.from_row(row) for row in rows), key=lambda s: (s.tp, s.start_offset))
            ranges = [(s.topic, s.partition, s.start_offset, s.end_offset) for s in segments]
            self._store.write_intent(batch_id, ranges)
            announced = [schema for segment in segments for schema in segment.announced]
            if announced:  # the next batch's tasks start before this one's record: they learn them here
                self._store.write_announced(batch_id, msgspec.msgpack.encode(announced))
            self._applying = self._applier.submit(self._apply, batch_id, segments)
        except BaseException as exc:
            self._stopped(exc)
            raise

    def drain(self) -> None:
        """Wait until the batch handed over last is applied; raise what stopped it."""
        applying, self._applying = self._applying, None
        if applying is not None:
            try:
                applying.result()
            except BaseException as exc:
                self._stopped(exc)
                raise

    def check_ends(self, positions: Mapping[TopicPartition, int]) -> list[PartitionEnd]:
        """Where the query read each partition to (`positions`: its progress's end offsets; a partition
        missing from them, from its earliest), against where a fetch from there finds its end, the
        partitions the engine holds back marked: the totals' `ends`."""
        if self._ends is None:
            options = self.options
            self._ends = EndOffsets(options.bootstrap_servers, options.kafka, group=options.client_group)
        partitions = self._ends.listed(self.options.topics)
        latest = self._store.latest_metadata()
        paused = latest[2] if latest is not None else set()
        found = self._ends.probe({tp: positions.get(tp, EARLIEST) for tp in partitions}, paused)
        self._stats.ends = [found[tp] for tp in sorted(found)]
        return self._stats.ends

    def close(self) -> None:
        """Apply the batch handed over last, then release the sinks and the dead-letter destination. A run
        that had no batch to apply still feeds what an earlier run left unapplied (its carry): applied now
        if it can be, else reported as unapplied again (a run never claims what it did not apply)."""
        try:
            self.drain()
            if self._pipeline is None and self.failure is None:
                self._feed_carried()
            if self._pipeline is not None:
                self._pipeline.finish()
        finally:
            self._applier.shutdown()
            self._commits.close()
            if self._ends is not None:
                self._ends.close()
            if self._pipeline is not None:
                self._pipeline.close()
            else:
                for sink in self.sinks:
                    sink.close()
                self.dead_letters.close()
                if self.large_messages is not None:
                    self.large_messages.close()

    def _stopped(self, exc: BaseException) -> None:
        """A batch failed: the in-memory state is mid-batch, so the next call starts from the last record."""
        with contextlib.suppress(BaseException):
            if self._applying is not None:
                self._applying.result()
        self._applying = None
        self._next_batch = None
        if self.failure is None:
            self.failure = exc

    # -- batches ---------------------------------------------------------------------------------------
    def _restore(self, batch_id: int) -> bool:
        """Start over from the record of the latest batch before `batch_id` (applying again, from Kafka, a
        batch Spark committed whose applying a dead driver did not finish); True when `batch_id` itself was
        recorded (complete: Spark runs it again only because it had not recorded its commit)."""
        latest = self._store.latest()
        if latest is not None and latest > batch_id:
            raise ConsumerError(
                f"{self._store.location} records batch {latest}, ahead of the query's batch {batch_id}: "
                "a state location belongs to one checkpoint"
            )
        self._start(self._store.read(latest) if latest is not None else None)
        if latest == batch_id:
            self._next_batch = batch_id + 1
            return True
        for missed in range(0 if latest is None else latest + 1, batch_id):
            self._apply(missed, self._read_again(missed))
        return False

    def _feed_carried(self) -> None:
        """Feed the rows the latest recorded batch carried, as a batch of nothing new under its id."""
        latest = self._store.latest()
        if latest is None:
            return
        carry = self._store.read(latest)
        if carry.segments:
            self._start(carry)
            self._apply(latest, [])

    def _read_again(self, batch_id: int) -> list[Segment]:
        ranges = self._store.intent(batch_id)
        if ranges is None:
            raise ConsumerError(
                f"{self._store.location} has no record of batch {batch_id}: a state location belongs to "
                "one checkpoint, and rows carried past that batch would be lost"
            )
        log.info("applying batch %d again from Kafka: %s", batch_id, ranges)
        segments = []
        for topic, partition, start, end in ranges:
            for row in read_range(self.options, OffsetRange(topic, partition, start, end), spool=True):
                segments.append(Segment.from_row(row.to_pylist()[0]))
        return segments

    def _start(self, carry: Carry | None) -> None:
        """A fresh pipeline and state machine (keeping the totals), to be fed the carry first."""
        state = build_state(self.config, self._decoder)
        pipeline = Pipeline(
            group=self.config.source.group,
            state=state,
            sinks=self.sinks,
            dead_letters=self.dead_letters,
            decoder=self._decoder,
            policy=self._policy,
            large_messages=self.large_messages,
            watchdog=self._watchdog,
            progress_seconds=0 if self._merges_elsewhere() else PROGRESS_SECONDS,
        )
        pipeline.stats = self._stats
        self._source = _SparkOffsets(self._commits, self.options.topics)
        pipeline.attach(self._source)
        pipeline.open()  # the sinks' recorded schemas first: the carry's are the newer
        if carry is not None and carry.schemas:
            state.learn_schemas(snapshot_schemas(carry.schemas))
        self._pipeline = pipeline
        self._live = self._unfed = carry.segments if carry is not None else []
        self._watermarks = {}
        self._starts = {}

    def _merges_elsewhere(self) -> bool:
        """Whether a sink MERGEs its mirrors on the executors, as progress is recorded: then progress is
        recorded every micro-batch, so a mirror without a cadence is MERGEd every batch."""
        return any(isinstance(sink, DeltaSink) and sink.merge_runner is not None for sink in self.sinks)

    def _apply(self, batch_id: int, segments: list[Segment]) -> None:
        """The applying thread's job (or the restoring call's): feed, resolve, write, record."""
        if self._pipeline is None:
            self._start(None)
        assert self._pipeline is not None
        collecting = gc.isenabled()
        gc.disable()  # as `Pipeline.run`: a batch's rows are many short-lived objects without cycles
        try:
            self._assign(self._pipeline, segments)
            segments = self._unapplied(segments)
            feed = self._unapplied(self._unfed) + segments
            self._unfed = []
            self._live = [*self._live, *segments]
            self.executor_cpu_seconds += sum(segment.cpu_seconds for segment in segments)
            blocks = [block for segment in feed for block in segment.blocks()]
            if self._pipeline.step_decoded(self._records(feed), blocks):
                self.changed_batches += 1
            self._carry(batch_id, self._pipeline)
        finally:
            if collecting:
                gc.enable()
        if self.on_batch:
            self.on_batch(self._pipeline)

    def _assign(self, pipeline: Pipeline, segments: list[Segment]) -> None:
        """Partitions seen for the first time are assigned to the state machine, which says where the sinks
        recorded a later resume offset (another run applied the records before it: the other engine, or
        this one with another checkpoint)."""
        fresh: dict[TopicPartition, int] = {}
        for segment in [*self._unfed, *segments]:
            if segment.tp not in self._source.assigned:
                fresh[segment.tp] = min(fresh.get(segment.tp, segment.start_offset), segment.start_offset)
        if not fresh:
            return
        self._source.first.update(fresh)
        self._source.assigned |= set(fresh)
        self._starts.update(pipeline.on_assign(sorted(fresh)) or {})

    def _unapplied(self, segments: list[Segment]) -> list[Segment]:
        """The records at or after their partition's resume offset: a query behind the lake reads records
        another run applied for as many batches as it takes to reach it, and feeds none of them."""
        starts = self._starts
        return [segment.from_offset(starts.get(segment.tp, segment.start_offset)) for segment in segments]

    def _records(self, segments: Sequence[Segment]) -> Iterator[DecodedRecord]:
        watermarks = self._watermarks
        for segment in segments:
            for record in segment.decoded(self._decoder):
                if isinstance(record[1], Watermark):
                    watermarks[segment.tp] = record[0].offset
                yield record

    def _carry(self, batch_id: int, pipeline: Pipeline) -> None:
        """Record what the batch leaves unapplied; from then on the batch is complete, and the spool files
        of the records it read that nothing carried are removed."""
        unapplied = pipeline.state.unapplied_offsets()
        by_partition: dict[TopicPartition, list[Segment]] = {}
        for segment in self._live:
            by_partition.setdefault(segment.tp, []).append(segment)
        carried = []
        for tp, segments in by_partition.items():
            offsets = unapplied.get(tp, [])
            wanted = [*offsets, *self._marks(tp)]
            kept = [held for segment in segments if len((held := segment.kept(wanted)).offsets())]
            found = np.concatenate([segment.offsets() for segment in kept]) if kept else np.empty(0)
            missing = set(offsets).difference(found.tolist())
            if missing:
                raise RuntimeError(f"{tp}: unapplied records {sorted(missing)[:5]} are in no segment")
            carried += kept
        snapshot = pipeline.state.schemas.snapshot()
        self._store.write(batch_id, Carry(carried, snapshot, set(self._source.paused)))
        read = {tp: max(segment.end_offset for segment in segments) for tp, segments in by_partition.items()}
        self._store.remove_spooled(read, {spool.path for s in carried for spool in s.spooled.values()})
        self._live = carried
        self._next_batch = batch_id + 1

    def _marks(self, tp: TopicPartition) -> list[int]:
        mark = self._watermarks.get(tp)
        return [] if mark is None else [mark]


def _starting_where_recorded(options: TicdcOptions, sinks: Sequence[Sink]) -> TicdcOptions:
    """A new checkpoint's query starts each partition where the sinks' records resume the group (as a loop
    engine joining it does), not at its earliest; Spark reads `startingOffsets` only without a checkpoint."""
    recorded = recorded_offsets(sinks, options.group)
    if not recorded or options.starting_offsets != "earliest":
        return options
    return msgspec.structs.replace(options, starting_offsets=starting_offsets(recorded))


def _collected(frame: DataFrame, batch_id: int) -> list[dict[str, Any]]:
    """The batch's segment rows; a failed job (a task that failed as often as Spark allows, e.g. its Python
    worker killed: `spark.task.maxFailures`) is the query's failure, not this function's."""
    try:
        return frame.toArrow().to_pylist()
    except (Py4JJavaError, PySparkException) as exc:
        text = str(exc)
        reason = re.search(r"Job aborted due to stage failure: [^\n]*", text)
        detail = reason.group(0) if reason else (text.strip().splitlines() or [type(exc).__name__])[0]
        raise SparkQueryError(
            f"the streaming query failed: the executors could not read batch {batch_id}: {detail[:1000]}"
        ) from exc


# -- `ticdc-consumer run --engine spark` -----------------------------------------------------------------
def checkpoint_location(config: RunConfig) -> str:
    """The configured checkpoint, else `<sink root>/_spark/<group>` (the configuration checks the root is
    local then)."""
    if config.engine.checkpoint:
        return config.engine.checkpoint
    root = config.sink.url.partition(":")[2].removeprefix("file://")
    return str(Path(root).absolute() / "_spark" / config.source.group)


def stream_options(config: RunConfig) -> TicdcOptions:
    """The `ticdc` source's options for a run configuration (the loop engine's settings, one for one)."""
    return TicdcOptions.of_run(
        config,
        f"{checkpoint_location(config)}/{STATE_DIRECTORY}",
        max_offsets_per_trigger=config.budget.max_batch_records,
        settings=_task_settings(config),
    )


def _task_settings(config: RunConfig) -> RunConfig:
    """Only what tasks read (`TASK_SETTINGS`): the registry's credentials stay with the driver."""
    defaults = RunConfig()
    for section, names in TASK_SETTINGS.items():
        ours, into = getattr(config, section), getattr(defaults, section)
        for name in names:
            setattr(into, name, getattr(ours, name))
    return defaults


class LakehouseQuery:
    """A `ticdc` stream applying to the configured lakehouse (`start_lakehouse`): Spark's query, and the
    foreachBatch function that applies its micro-batches. `stop()` (or leaving a `with` block) ends the query
    and applies what was handed over; an error of the query or of a batch is raised as the loop engine's
    would be."""

    def __init__(self, query: StreamingQuery, batches: ChangeBatches) -> None:
        self.query = query
        self.batches = batches

    @property
    def stats(self) -> PipelineStats:
        return self.batches.stats

    def await_termination(self, timeout: int | None = None) -> bool:
        """Whether the query ended within `timeout` seconds (None: wait until it does); once it has, its
        last batch is applied."""
        try:
            if timeout is None:
                self.query.awaitTermination()  # returns nothing: it waits for the end
                ended = True
            else:
                ended = bool(self.query.awaitTermination(timeout))
        except StreamingQueryException as exc:
            raise self._failure(exc) from None
        if ended:
            self.batches.drain()
        return ended

    def stop(self) -> PipelineStats:
        """Stop the query (between batches or in one: the record and the sinks stay exact), apply what was
        handed over and release the sinks; the totals."""
        try:
            self.query.stop()
            self.batches.drain()
        finally:
            self.batches.close()
        return self.stats

    def __enter__(self) -> LakehouseQuery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _failure(self, exc: StreamingQueryException) -> BaseException:
        if self.batches.failure is not None:
            return self.batches.failure
        error = WorkerStartError if "Python worker failed to connect back" in str(exc) else SparkQueryError
        return error(f"the streaming query failed: {str(exc).splitlines()[0]}")


def start_lakehouse(
    spark: SparkSession,
    config: RunConfig,
    *,
    trigger: Mapping[str, Any] | None = None,
    on_table: BatchFunction | None = None,
    on_batch: Callable[[Pipeline], None] | None = None,
) -> LakehouseQuery:
    """Start the multi-table job `run --engine spark` runs, in `spark`: the configured topics into the
    configured sink, with the checkpoint `checkpoint_location(config)`.

    `trigger`: as `DataStreamWriter.trigger` takes it (default: `processingTime` of
    `engine.trigger_seconds`; `{"availableNow": True}` reads what is there and ends). `on_table(table,
    frame, info)`: your own function, called with every table batch as a typed DataFrame after the
    configured sink took it (`ForeachBatchSink`). `on_batch(pipeline)`: after every applied micro-batch.
    """
    register(spark)
    sinks = build_sinks(config) + ([ForeachBatchSink(spark, on_table)] if on_table else [])
    batches = ChangeBatches(config, sinks=sinks, on_batch=on_batch)
    start = _query_starter(spark, batches.options, batches, checkpoint_location(config))
    chosen = dict(trigger or {"processingTime": f"{config.engine.trigger_seconds} seconds"})
    try:
        return LakehouseQuery(start(chosen), batches)
    except BaseException:
        batches.close()
        raise


def run(
    config: RunConfig,
    *,
    until_idle: float | None = None,
    on_cycle: Callable[[Pipeline], None] | None = None,
    spark: SparkSession | None = None,
    stop: StopRequest | None = None,
) -> PipelineStats:
    """Run the configured consumer as a Spark streaming query; returns its totals once stopped.

    `until_idle`: availableNow runs, one after another, until one found no change record and that many
    seconds passed since the last that did; else a processingTime query until stopped. `stop`: a request
    (`StopRequest.on_signals`: Ctrl-C, SIGTERM) that stops the query, whether between batches or in one: what
    was handed over is applied and recorded, nothing past it. `spark`: a session to use (kept open), else one
    for `[engine] master` (stopped at the end).
    """
    stop = stop or StopRequest()
    session = spark or spark_session(master=config.engine.master or None)
    try:
        start_gate(stop.wait)  # tests: a restart started early waits here, before it reads any state
        register(session)
        handler = ChangeBatches(config, on_batch=on_cycle)
        try:
            start = _query_starter(session, handler.options, handler, checkpoint_location(config))
            if until_idle is None:
                _run_continuously(start, config.engine.trigger_seconds, handler, stop)
            else:
                _run_until_idle(start, until_idle, handler, stop)
        finally:
            handler.close()
        handler.stats.stopped_on_request = stop.requested
        return handler.stats
    finally:
        if spark is None:
            session.stop()


QueryStarter = Callable[[dict[str, Any]], StreamingQuery]


def _query_starter(
    spark: SparkSession, options: TicdcOptions, handler: ChangeBatches, checkpoint: str
) -> QueryStarter:
    def start(trigger: dict[str, Any]) -> StreamingQuery:
        segments = spark.readStream.format("ticdc").options(**options.to_spark()).load()
        writer = segments.writeStream.foreachBatch(handler).option("checkpointLocation", checkpoint)
        return writer.trigger(**trigger).start()

    return start


def _awaited(
    start: QueryStarter, trigger: dict[str, Any], handler: ChangeBatches, stop: StopRequest
) -> StreamingQuery:
    """Start a query and await it (`_await`), starting it again when its Python worker was too slow to
    connect back (`WorkerStartError`), up to WORKER_STARTS times; the query that ran."""
    attempt = 1
    while True:
        query = start(trigger)
        try:
            _await(query, handler, stop)
            return query
        except WorkerStartError as exc:
            if attempt == WORKER_STARTS or stop.requested:
                raise
            attempt += 1
            log.warning("%s; starting the query again (%d of %d)", exc, attempt, WORKER_STARTS)


def _run_until_idle(
    start: QueryStarter, until_idle: float, handler: ChangeBatches, stop: StopRequest
) -> None:
    """availableNow queries until one found no change record, `until_idle` seconds passed since the last
    that did, and every partition is read to the end a fetch finds (`ChangeBatches.check_ends`): records
    left on a partition the engine does not hold back are read on (for `BEHIND_GRACE_S` at most)."""
    idle_since = time.monotonic()
    positions: dict[TopicPartition, int] = {}
    while not stop.requested:
        changed = handler.changed_batches
        positions.update(_read_to(_awaited(start, {"availableNow": True}, handler, stop)))
        now = time.monotonic()
        idle = now - idle_since
        if handler.changed_batches != changed:
            idle_since = now
        elif idle >= until_idle:
            readable = [end for end in unread(handler.check_ends(positions)) if not end.paused]
            if not readable or idle >= until_idle + BEHIND_GRACE_S:
                return
            log.info("idle, yet records are left: reading on from %s", ", ".join(map(str, readable)))
        else:
            stop.wait(min(IDLE_POLL_SECONDS, until_idle - idle))


def _read_to(query: StreamingQuery) -> dict[TopicPartition, int]:
    """Where the query's last progress says it read its source to (the offsets its checkpoint holds)."""
    progress = query.lastProgress
    ended = progress.sources[0].endOffset if progress is not None and progress.sources else None
    return parse_offsets(ended) if ended else {}


def _run_continuously(
    start: QueryStarter, trigger_seconds: float, handler: ChangeBatches, stop: StopRequest
) -> None:
    queries: list[StreamingQuery] = []

    def started(trigger: dict[str, Any]) -> StreamingQuery:
        queries.append(start(trigger))
        return queries[-1]

    try:
        _awaited(started, {"processingTime": f"{trigger_seconds} seconds"}, handler, stop)
    except KeyboardInterrupt:  # a second signal, or a Ctrl-C outside `StopRequest.on_signals`
        if queries:  # between batches or mid-batch: either way the record and the sinks stay exact
            queries[-1].stop()


def _await(query: StreamingQuery, handler: ChangeBatches, stop: StopRequest) -> None:
    """Until the query ends (or is stopped on request) and its last batch is applied."""
    running = LakehouseQuery(query, handler)
    while not running.await_termination(STOP_POLL_SECONDS):
        if stop.requested:
            query.stop()  # between batches or mid-batch: either way the record and the sinks stay exact
