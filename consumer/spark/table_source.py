"""One upstream table's changes as a typed stream: `spark.readStream.format("ticdc").option("table",
"shop.orders")`, or `consumer.spark.table_source(spark, config, "shop.orders")`.

The rows are the table's changelog (`consumer.batches.changes`): its columns typed by the mysqlType table,
and the change metadata (`_change_type`, `_commit_ts`, `_commit_time`, `_topic`, `_partition`, `_offset`),
released at watermarks in commit order by the loop engine's own `Pipeline` (schemas from BOOTSTRAPs and
DDLs, rows held for their schema, DDL barriers, claim-checks, the pending timeout and the error policy,
dead letters to the configured destination).

How: the reader's planner, in the driver's data-source process, runs the pipeline over Kafka into a
*staging log* in the state location (`<checkpoint>/ticdc`): each write of the table is an entry (an Arrow
file), and `progress.json` says, atomically, how far the log is and where the pipeline resumes (offsets,
watermarks, schemas, and the offsets staged past the resume points, so nothing is staged twice). Spark's
offsets are entry numbers: executors read the entries of a micro-batch, and the planner drops them once Spark
committed the batch. A restart resumes the pipeline from the log and Spark from its checkpoint: nothing is
lost or repeated.

The stream's schema is learned at start (from the log, else from the stream: up to a BOOTSTRAP interval).
When the table's columns change (a DDL), the entries before the change are delivered and then the query
stops with `TableSchemaChanged`, which names the change; a restart continues with the new schema. A renamed
table is followed under its new name.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructField, StructType

from consumer.batches.changes import TableChanges, changelog_schema
from consumer.batches.frames import spark_schema
from consumer.config import RunConfig
from consumer.configured import (
    build_dead_letters,
    build_decoder,
    build_large_messages,
    build_policy,
    build_state,
)
from consumer.errors import ConsumerError
from consumer.lakehouse.ddl import renamed_from
from consumer.pipeline import Pipeline
from consumer.protocol.model import DDLType
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sources.base import FixedStarts
from consumer.sources.errors import SourceError
from consumer.sources.kafka import KafkaSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.sources.retry import SourceRetry
from consumer.spark.source import NAME, TicdcOptions, _KafkaOffsets, _resolve, register
from consumer.state.schema_cache import snapshot_schemas

STAGE_SECONDS = 2.0  # how long one planning call runs the pipeline before it answers
_POLL_S = 0.2


class TableSchemaChanged(ConsumerError):
    """The table's columns changed: the stream delivered every change before it and stops; restart the
    query to continue with the new schema."""

    code = "table-schema-changed"


class _Segment(msgspec.Struct, frozen=True):
    """Entries from `first` on have this Arrow schema (IPC-serialized); `change`: what made it differ."""

    first: int
    schema: bytes
    change: str = ""


class _Progress(msgspec.Struct):
    next_entry: int = 0
    resume_offsets: list[tuple[str, int, int]] = []
    applied_ts: list[tuple[str, int, int]] = []
    staged_above: list[tuple[str, int, list[int]]] = []  # offsets staged at or past the resume offset
    schemas: bytes = b""  # the pipeline's schema cache
    segments: list[_Segment] = []
    table: tuple[str, str] = ("", "")  # the name the table has now (renames are followed)

    def schema_at(self, entry: int) -> _Segment | None:
        return next((s for s in reversed(self.segments) if s.first <= entry), None)


class StagingLog:
    """The staged entries and their progress record in a local directory (the state location)."""

    def __init__(self, location: str) -> None:
        self.path = Path(location.removeprefix("file://")) / "table"
        (self.path / "entries").mkdir(parents=True, exist_ok=True)

    def progress(self) -> _Progress:
        try:
            return msgspec.json.decode((self.path / "progress.json").read_bytes(), type=_Progress)
        except FileNotFoundError:
            return _Progress()

    def save(self, progress: _Progress) -> None:
        _replace(self.path / "progress.json", msgspec.json.encode(progress))

    def write_entry(self, entry: int, rows: pa.Table) -> None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_file(sink, rows.schema) as writer:
            writer.write_table(rows)
        _replace(self._entry(entry), sink.getvalue().to_pybytes())

    def read_entry(self, entry: int) -> pa.Table:
        with pa.memory_map(str(self._entry(entry))) as source:
            return pa.ipc.open_file(source).read_all()

    def drop_entries(self, through: int) -> None:
        for path in (self.path / "entries").glob("*.arrow"):
            if int(path.stem) <= through:
                path.unlink(missing_ok=True)

    def _entry(self, entry: int) -> Path:
        return self.path / "entries" / f"{entry:012d}.arrow"


def _replace(path: Path, data: bytes) -> None:
    """Write whole or not at all: a reader sees the old file or the new one."""
    temporary = path.with_suffix(".tmp")
    temporary.write_bytes(data)
    temporary.replace(path)


def _arrow_schema(data: bytes) -> pa.Schema:
    return pa.ipc.read_schema(pa.py_buffer(data))


# -- the sink the planner's pipeline writes -------------------------------------------------------------
class StagedTable:
    """A `Sink` and `ProgressRecorder` that stages one table's changes as log entries, exactly once."""

    def __init__(self, log: StagingLog, database: str, table: str) -> None:
        self.log = log
        self.progress = log.progress()
        if self.progress.table == ("", ""):
            self.progress.table = (database, table)
        self._last_ddl = ""

    # Sink
    def write(self, changes: TableChanges, context: CommitContext) -> None:
        if (changes.database, changes.table) != self.progress.table:
            return
        fresh = self._unstaged(changes.changelog)
        if fresh.num_rows:
            entry = self.progress.next_entry
            self._segment_for(entry, fresh.schema)
            self.log.write_entry(entry, fresh)
            self.progress.next_entry = entry + 1
            self._remember_staged(fresh)
        self.record_progress(context)

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        self._follow_rename(event)
        if (event.database, event.table) == self.progress.table:
            self._last_ddl = f"{event.ddl.type.value} {event.ddl.sql!r} at TSO {event.ddl.commit_ts}"
        self.record_progress(context)

    def _follow_rename(self, event: DDLEvent) -> None:
        database, table = event.database, event.table
        if event.ddl.type is not DDLType.RENAME or database is None or table is None:
            return
        if renamed_from(event.ddl, database, table) == self.progress.table:
            self.progress.table = (database, table)

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {(topic, partition): offset for topic, partition, offset in self.progress.resume_offsets}

    def recorded_schema_snapshot(self) -> bytes | None:
        return self.progress.schemas or None

    def close(self) -> None:
        return None

    # ProgressRecorder
    def record_progress(self, context: CommitContext) -> None:
        progress = self.progress
        if context.resume_offsets:
            resume = {**self.recorded_offsets(""), **context.resume_offsets}
            progress.resume_offsets = [(t, p, o) for (t, p), o in sorted(resume.items())]
            progress.staged_above = [
                (t, p, kept)
                for t, p, offsets in progress.staged_above
                if (kept := [o for o in offsets if o >= resume.get((t, p), 0)])
            ]
        if context.applied_ts:
            applied = {**self.recorded_watermarks(""), **context.applied_ts}
            progress.applied_ts = [(t, p, ts) for (t, p), ts in sorted(applied.items())]
        if context.schema_snapshot:
            progress.schemas = context.schema_snapshot
        self.log.save(progress)

    def recorded_watermarks(self, group: str) -> dict[TopicPartition, int]:
        return {(topic, partition): ts for topic, partition, ts in self.progress.applied_ts}

    # the log
    def learn_schema(self, schema: pa.Schema) -> None:
        """The stream's schema before any entry (learned from the stream's schemas)."""
        if not self.progress.segments:
            self._segment_for(self.progress.next_entry, schema)
            self.log.save(self.progress)

    def _segment_for(self, entry: int, schema: pa.Schema) -> None:
        current = self.progress.schema_at(entry)
        if current is not None and _arrow_schema(current.schema).equals(schema):
            return
        change = ""
        if current is not None:
            name = ".".join(self.progress.table)
            change = f"{name}: {_described_change(_arrow_schema(current.schema), schema)}"
            change += f" ({self._last_ddl})" if self._last_ddl else ""
        data = schema.serialize().to_pybytes()
        self.progress.segments.append(_Segment(entry, data, change))

    def _unstaged(self, rows: pa.Table) -> pa.Table:
        """The rows not staged before (a restarted pipeline re-reads from its resume offsets)."""
        staged = self.progress.staged_above
        if not staged:
            return rows
        seen = None
        for topic, partition, offsets in staged:
            here = pc.and_(pc.equal(rows["_topic"], topic), pc.equal(rows["_partition"], partition))
            again = pc.and_(here, pc.is_in(rows["_offset"], value_set=pa.array(offsets, pa.int64())))
            seen = again if seen is None else pc.or_(seen, again)
        return rows.filter(pc.invert(seen))

    def _remember_staged(self, rows: pa.Table) -> None:
        staged = {(t, p): set(offsets) for t, p, offsets in self.progress.staged_above}
        for topic, partition, offset in zip(
            rows["_topic"].to_pylist(),
            rows["_partition"].to_pylist(),
            rows["_offset"].to_pylist(),
            strict=True,
        ):
            staged.setdefault((topic, partition), set()).add(offset)
        self.progress.staged_above = [(t, p, sorted(o)) for (t, p), o in sorted(staged.items())]


def _described_change(before: pa.Schema, after: pa.Schema) -> str:
    old, new = (
        dict(zip(before.names, before.types, strict=True)),
        dict(zip(after.names, after.types, strict=True)),
    )
    parts = [f"column {n} added" for n in new if n not in old]
    parts += [f"column {n} dropped" for n in old if n not in new]
    parts += [f"column {n} {old[n]} -> {new[n]}" for n in new if n in old and old[n] != new[n]]
    return ", ".join(parts) or "column order changed"


# -- the planner ------------------------------------------------------------------------------------------
class _StagingSource:
    """The pipeline's source: Kafka, read at the log's resume offsets; commits are the log's own record."""

    def __init__(self, kafka: KafkaSource) -> None:
        self.kafka = kafka

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        return self.kafka.poll_batch(max_records, timeout)

    def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        return None

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        return {}

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self.kafka.pause(partitions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self.kafka.resume(partitions)

    def assignment(self) -> set[TopicPartition]:
        return self.kafka.assignment()

    def close(self) -> None:
        self.kafka.close()


class TableStager:
    """The loop engine's pipeline over the subscribed topics, staging one table into the log."""

    def __init__(self, options: TicdcOptions) -> None:
        database, _, table = options.table.partition(".")
        self.options = options
        self.config = _run_config(options)
        self.log = StagingLog(options.state_location)
        self.sink = StagedTable(self.log, database, table)
        policy = build_policy(self.config)
        decoder = build_decoder(self.config.decode, policy)
        self.pipeline = Pipeline(
            group=options.group,
            state=build_state(self.config, decoder),
            sinks=[self.sink],
            dead_letters=build_dead_letters(self.config),
            decoder=decoder,
            policy=policy,
            max_batch_records=self.config.budget.max_batch_records,
            large_messages=build_large_messages(self.config, policy),
            source_retry=SourceRetry(self.config.source.retries, self.config.source.retry_backoff_s),
        )
        self.policy = policy
        bounds = _KafkaOffsets(options).bounds()
        self.source = self._source(bounds)
        self.positions = {tp: start for tp, start in self._starts.items()}
        self.target: dict[TopicPartition, int] | None = None  # availableNow: where to stop staging

    def _source(self, bounds: Mapping[TopicPartition, tuple[int, int]]) -> _StagingSource:
        partitions = sorted(bounds)
        recorded = self.pipeline.on_assign(partitions) or {}
        self._starts = {**_resolve(self.options.starting_offsets, bounds), **recorded}
        kafka = KafkaSource(
            self.options.bootstrap_servers,
            list(self.options.topics),
            self.options.client_group,
            partitions=partitions,
            config=self.options.kafka,
            listener=FixedStarts(self._starts),
            unreachable_timeout=self.config.source.unreachable_timeout_s,
        )
        source = _StagingSource(kafka)
        self.pipeline.attach(source)
        return source

    def stage(self, seconds: float) -> int:
        """Run the pipeline for about `seconds`, or until the stream is idle (or, for availableNow, read
        up to its target); how many records it read."""
        deadline = time.monotonic() + seconds
        read = 0
        while time.monotonic() < deadline and not self.reached_target():
            records = self.pipeline.source_retry.call(
                "poll", partial(self.source.poll_batch, self.config.budget.max_batch_records, _POLL_S)
            )
            for record in records:
                self.positions[(record.topic, record.partition)] = record.offset + 1
            read += len(records)
            self.pipeline.step(records)
            if not records and self.target is None:
                break
        self.pipeline.finish()
        return read

    def learned_schema(self, timeout: float) -> pa.Schema:
        """The schema of the first entries: the log's, else staged until the table's first rows are (or,
        on an idle stream or after `timeout`, the newest version its schemas announced)."""
        deadline = time.monotonic() + timeout
        progress = self.sink.progress
        while not progress.segments:
            before = dict(self.positions)
            self.stage(STAGE_SECONDS)
            if progress.segments:
                break
            known = self._known_schema()
            idle = self.positions == before
            if known is not None and (idle or time.monotonic() > deadline):
                self.sink.learn_schema(known)
            elif time.monotonic() > deadline:
                name = ".".join(progress.table)
                raise ConsumerError(f"no schema of {name} arrived within {timeout:.0f} s")
        return _arrow_schema(progress.segments[-1].schema)

    def _known_schema(self) -> pa.Schema | None:
        name = self.sink.progress.table
        versions = [
            schema
            for schema in snapshot_schemas(self.pipeline.state.schemas.snapshot())
            if (schema.database, schema.table) == name
        ]
        if not versions:
            return None
        newest = max(versions, key=lambda schema: schema.version)
        return changelog_schema(TableCodec(newest, self.policy, protocol=self.pipeline.decoder.protocol))

    def reached_target(self) -> bool:
        target = self.target
        return target is not None and all(self.positions.get(tp, 0) >= end for tp, end in target.items())

    def close(self) -> None:
        try:
            self.pipeline.finish()
        finally:
            self.source.close()
            self.pipeline.close()


def _run_config(options: TicdcOptions) -> RunConfig:
    """The run configuration the stream's options name (dead letters default to the state location)."""
    settings = options.settings
    source = msgspec.structs.replace(
        settings.source,
        url=f"kafka://{options.bootstrap_servers}/{','.join(options.topics)}",
        group=options.group,
        kafka=dict(options.kafka),
    )
    errors = settings.errors
    if not errors.dead_letter:
        errors = msgspec.structs.replace(
            errors, dead_letter=f"file:{Path(options.state_location) / '_dead_letters.jsonl'}"
        )
    return msgspec.structs.replace(settings, source=source, errors=errors)


# -- the Spark side ---------------------------------------------------------------------------------------
def table_stream(spark: SparkSession, config: RunConfig, table: str, checkpoint: str) -> DataFrame:
    """The typed changes of `table` (DATABASE.TABLE) under the run configuration's source, decoding, error
    policy and budgets, as a streaming DataFrame. Give its query the same `checkpoint`
    (`.option("checkpointLocation", checkpoint)`): the stream stages in `<checkpoint>/ticdc`."""
    register(spark)
    options = table_options(config, table, checkpoint)
    return spark.readStream.format(NAME).options(**options.to_spark()).load()


def table_options(config: RunConfig, table: str, checkpoint: str) -> TicdcOptions:
    return TicdcOptions.of_run(config, f"{checkpoint.rstrip('/')}/ticdc", table=table, settings=config)


def stream_schema(options: TicdcOptions) -> StructType:
    """The schema of the entries the query delivers next: the log's after what Spark's checkpoint holds,
    else learned from the stream."""
    log = StagingLog(options.state_location)
    progress = log.progress()
    delivered = checkpointed_entry(options.state_location)
    segment = progress.schema_at(delivered + 1)
    if segment is not None:
        schema = _arrow_schema(segment.schema)
    else:
        stager = TableStager(options)
        try:
            schema = stager.learned_schema(options.settings.budget.pending_timeout_s)
        finally:
            stager.close()
    return stream_struct(schema)


def stream_struct(schema: pa.Schema) -> StructType:
    """The Spark schema of entries of `schema`, every field nullable (a key-only image leaves NOT NULL
    columns empty)."""
    return StructType([StructField(f.name, f.dataType, True) for f in spark_schema(schema)])


def checkpointed_entry(state_location: str) -> int:
    """The last entry a committed micro-batch delivered, from Spark's checkpoint around the state
    location (`<checkpoint>/ticdc`); -1 when there is none."""
    checkpoint = Path(state_location.removeprefix("file://")).parent
    commits = [int(p.name) for p in (checkpoint / "commits").glob("[0-9]*") if p.name.isdigit()]
    if not commits:
        return -1
    lines = (checkpoint / "offsets" / str(max(commits))).read_text().splitlines()
    for line in lines[2:]:
        try:
            offset = json.loads(line)
        except ValueError:
            continue
        if isinstance(offset, dict) and "entry" in offset:
            return int(offset["entry"])
    return -1


class EntryRange(InputPartition):
    """One task's work: one staged entry."""

    def __init__(self, entry: int) -> None:
        super().__init__(entry)
        self.entry = entry


class TableStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans in the driver's data-source process (where the stager runs); `read` runs in executor tasks."""

    def __init__(self, options: TicdcOptions, schema: StructType) -> None:
        self.options = options
        self.schema = schema
        self._arrow = _arrow_schema(_serialized(schema))
        self._stager: TableStager | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "schema": self.schema, "_arrow": self._arrow, "_stager": None}

    def initialOffset(self) -> dict[str, int]:
        return {"entry": -1}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        stager = self._planner()
        stager.target = {tp: high for tp, (_, high) in _KafkaOffsets(self.options).bounds().items()}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """Stage for a while, then answer the last entry of the query's schema; once every such entry is
        delivered and a differing one waits, stop the query naming the change."""
        begin = int(start["entry"])
        progress = self._staged_past(begin)
        change = self._next_change(progress, begin)
        end = progress.next_entry - 1 if change is None else change.first - 1
        if change is not None and end <= begin:
            raise TableSchemaChanged(
                f"the table changed: {change.change}; every change before it was delivered: restart the "
                "query to continue with the new schema"
            )
        return {"entry": max(begin, end)}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> Sequence[InputPartition]:
        return [EntryRange(entry) for entry in range(int(start["entry"]) + 1, int(end["entry"]) + 1)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, EntryRange)
        rows = StagingLog(self.options.state_location).read_entry(partition.entry)
        yield from rows.cast(self._arrow).to_batches()

    def commit(self, end: dict[str, int]) -> None:
        StagingLog(self.options.state_location).drop_entries(int(end["entry"]))

    def stop(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _staged_past(self, begin: int) -> _Progress:
        """Stage for a while. An availableNow query ends when an answer repeats its start, so for one this
        stages on until an entry or a change comes, or its target is read (a target Kafka does not deliver
        within `kafkaConsumer.pollTimeoutMs` is an error, never a silent end)."""
        stager = self._planner()
        progress = stager.sink.progress
        patience = self.options.poll_timeout_ms / 1000
        waited = 0.0
        while self._next_change(progress, begin) is None:
            staged, started = progress.next_entry, time.monotonic()
            read = stager.stage(STAGE_SECONDS)
            if progress.next_entry > staged or stager.target is None or stager.reached_target():
                break
            waited = 0.0 if read else waited + time.monotonic() - started
            if waited > patience:
                raise SourceError(
                    f"records up to {stager.target} did not arrive within {patience:.0f} s "
                    "(kafkaConsumer.pollTimeoutMs)"
                )
        return progress

    def _planner(self) -> TableStager:
        if self._stager is None:
            self._stager = TableStager(self.options)
        return self._stager

    def _next_change(self, progress: _Progress, begin: int) -> _Segment | None:
        """The first segment after `begin` whose schema is not the query's."""
        for segment in progress.segments:
            if segment.first > begin and stream_struct(_arrow_schema(segment.schema)) != self.schema:
                return segment
        return None


def _serialized(schema: StructType) -> bytes:
    data: bytes = to_arrow_schema(schema, timezone="UTC").serialize().to_pybytes()
    return data
