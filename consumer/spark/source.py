"""`ticdc`: TiCDC topics as a Spark data source, batch (`spark.read`) and streaming (`spark.readStream`).

    from consumer.spark.source import register

    register(spark)
    segments = (
        spark.readStream.format("ticdc")
        .option("kafka.bootstrap.servers", "broker:9092")
        .option("subscribe", "tidb-orders")
        .option("stateLocation", "/checkpoints/orders/ticdc")
        .load()
    )

Spark's Kafka source is a JVM jar; this one reads Kafka with confluent-kafka in Python. A micro-batch's input
partitions are Kafka partition offset ranges, read by tasks on the executors, which also decode: envelopes,
and the typed values of every row whose schema they know (`consumer.spark.segments`). Spark's checkpoint
owns the offsets. Rows are segments: `consumer.spark.engine.ChangeBatches`, the stream's foreachBatch
function, orders them with the loop engine's state machine and hands typed per-table batches to the sinks.

Options (Spark lower-cases their names; `TicdcOptions` lists them): like Spark's Kafka source where they mean
the same (`kafka.bootstrap.servers`, `subscribe`, `startingOffsets`, `endingOffsets`,
`maxOffsetsPerTrigger`, `kafkaConsumer.pollTimeoutMs`, any `kafka.*` passed to the client), and the SDK's own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from consumer.config import DecodeConfig, RunConfig, kafka_source_parts
from consumer.configured import build_decoder, build_policy
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.types import ValuePolicy
from consumer.sources.base import FixedStarts
from consumer.sources.ends import EndOffsets
from consumer.sources.errors import SourceError
from consumer.sources.kafka import KafkaSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.spark.carry import CarryStore
from consumer.spark.segments import ARROW_SCHEMA, SPARK_SCHEMA, encode_range
from consumer.spark.workers import settle_worker
from consumer.state.schema_cache import SchemaCache, snapshot_schemas

NAME = "ticdc"
SEGMENT_RECORDS = 50_000  # a task emits a segment row per this many records: bounds a task's memory
SMALL_TASK_RECORDS = 5_000  # ranges smaller than this share a task (a small batch: one wave of tasks)
EARLIEST, LATEST = -2, -1  # in `startingOffsets`/`endingOffsets` JSON, as Spark's Kafka source writes them
_METADATA_TIMEOUT_S = 30.0
_POLL_S = 0.5
Offsets = dict[str, dict[str, int]]  # {"topic": {"0": 42}}: Spark's Kafka source's JSON form


class TicdcOptions(msgspec.Struct, frozen=True, kw_only=True):
    """The source's options.

    Kafka: `kafka.bootstrap.servers` and `subscribe` (topics, comma-separated) are required; any other
    `kafka.*` goes to the client (`kafka.group.id` names the group the tasks' clients use, default
    `<group>.spark`: they only assign, never commit). `startingOffsets`: earliest (default; Spark's Kafka
    source starts a stream at latest, which would miss a table's history), latest, or JSON
    `{"topic": {"0": 23, "1": -2}}` (-2 earliest, -1 latest); `endingOffsets` (batch reads): latest or JSON.
    `maxOffsetsPerTrigger`: records per micro-batch, shared by partitions in proportion to their backlog.
    `minPartitions`: at least this many tasks per batch (ranges split), for more cores than partitions.
    `kafkaConsumer.pollTimeoutMs`: how long a task waits for a record its range should hold.

    The SDK's: `group` (the name the sinks record progress under), `stateLocation` (the engine's per-batch
    record, `consumer.spark.carry`: tasks take schemas from it), and the run configuration's settings that
    tasks decode under, named as in the TOML file: `decode.<field>` (but the registry's, which only the
    driver uses), `integrity.verify_checksums`, `source.unreachable_timeout_s`.
    """

    bootstrap_servers: str
    topics: tuple[str, ...]
    kafka: dict[str, str] = {}
    kafka_group: str = ""
    starting_offsets: str = "earliest"
    ending_offsets: str = "latest"
    max_offsets_per_trigger: int | None = None
    min_partitions: int | None = None
    poll_timeout_ms: int = 120_000
    group: str = "ticdc-consumer"
    state_location: str = ""
    table: str = ""  # DATABASE.TABLE: that table's typed changes (`consumer.spark.table_source`)
    settings: RunConfig = msgspec.field(default_factory=RunConfig)  # `TASK_SETTINGS` / `TABLE_SETTINGS`

    @classmethod
    def of_run(cls, config: RunConfig, state_location: str, **fields: Any) -> TicdcOptions:
        """For a run configuration's Kafka source and group; `fields` as the constructor takes them."""
        servers, topics = kafka_source_parts(config.source.url)
        return cls(
            bootstrap_servers=servers,
            topics=tuple(topics),
            kafka=dict(config.source.kafka),
            group=config.source.group,
            state_location=state_location,
            **fields,
        )

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> TicdcOptions:
        """From Spark's option map (any case); an unknown option is an error, not a silent no-op."""
        fields: dict[str, Any] = {"kafka": {}, "settings": {}}
        for name, value in options.items():
            key = name.lower()
            if key == "kafka.bootstrap.servers":
                fields["bootstrap_servers"] = value
            elif key == "kafka.group.id":
                fields["kafka_group"] = value
            elif key.startswith("kafka."):
                fields["kafka"][key.removeprefix("kafka.")] = value
            elif key == "subscribe":
                fields["topics"] = tuple(topic.strip() for topic in value.split(",") if topic.strip())
            elif key in _OPTION_FIELDS:
                fields[_OPTION_FIELDS[key]] = value
            elif _is_setting(key, TABLE_SETTINGS):
                section, _, field = key.partition(".")
                fields["settings"].setdefault(section, {})[field] = _setting_value(section, field, value)
            else:
                raise ValueError(f"unknown option {name!r} of the {NAME} source")
        for required, option in (("bootstrap_servers", "kafka.bootstrap.servers"), ("topics", "subscribe")):
            if not fields.get(required):
                raise ValueError(f"the {NAME} source needs the option {option!r}")
        _check_settings(fields)
        try:
            return msgspec.convert(fields, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"invalid {NAME} source option: {exc}") from exc

    def to_spark(self) -> dict[str, str]:
        """As options for `spark.readStream.format("ticdc").options(...)`."""
        options = {
            "kafka.bootstrap.servers": self.bootstrap_servers,
            "subscribe": ",".join(self.topics),
            **{f"kafka.{key}": value for key, value in self.kafka.items()},
        }
        if self.kafka_group:
            options["kafka.group.id"] = self.kafka_group
        defaults = TicdcOptions(bootstrap_servers="", topics=())
        for option, name in _OPTION_FIELDS.items():
            value = getattr(self, name)
            if value != getattr(defaults, name):
                options[_SPARK_NAMES[option]] = str(value)
        for section, names in (TABLE_SETTINGS if self.table else TASK_SETTINGS).items():
            ours, default = getattr(self.settings, section), getattr(defaults.settings, section)
            for field in names:
                value = getattr(ours, field)
                if value != getattr(default, field):
                    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
                    options[f"{section}.{field}"] = text
        return options

    @property
    def client_group(self) -> str:
        return self.kafka_group or f"{self.group}.spark"


def _task_settings() -> dict[str, tuple[str, ...]]:
    """The `RunConfig` fields tasks read: how values decode, and how long a broker may be unreachable (all
    scalars: an option's text converts to them)."""
    registry = {"schema_registry", "schema_registry_auth", "schema_registry_config"}  # the driver's
    decode = tuple(name for name in DecodeConfig.__struct_fields__ if name not in registry)
    return {"decode": decode, "integrity": ("verify_checksums",), "source": ("unreachable_timeout_s",)}


def _table_settings() -> dict[str, tuple[str, ...]]:
    """The `RunConfig` fields a table stream reads: its planner runs the whole pipeline (no sink of the
    run configuration's: the stream is the output)."""
    whole = ("decode", "integrity", "errors", "budget", "large_messages")
    settings = {section: getattr(RunConfig(), section).__struct_fields__ for section in whole}
    return {**settings, "source": ("unreachable_timeout_s", "retries", "retry_backoff_s")}


TASK_SETTINGS = _task_settings()
TABLE_SETTINGS = _table_settings()


def _is_setting(key: str, settings: Mapping[str, tuple[str, ...]]) -> bool:
    section, _, field = key.partition(".")
    return field in settings.get(section, ())


def _setting_value(section: str, field: str, text: str) -> Any:
    """Option values are text: a scalar converts from it, a table or a list is JSON."""
    default = getattr(getattr(RunConfig(), section), field)
    return json.loads(text) if isinstance(default, dict | list) else text


def _check_settings(fields: Mapping[str, Any]) -> None:
    """A table stream stages in its state location. Without `table`, only what tasks read: the engine's
    driver reads the rest from its run configuration, and an option nothing reads must not look honoured."""
    if fields.get("table"):
        if "." not in fields["table"] or not fields.get("state_location"):
            raise ValueError(
                "option 'table' names DATABASE.TABLE and needs 'stateLocation' (<checkpoint>/ticdc)"
            )
        return
    for section, values in fields["settings"].items():
        for field in values:
            if not _is_setting(f"{section}.{field}", TASK_SETTINGS):
                raise ValueError(
                    f"option {section}.{field!r} is read by a table stream (option 'table'); the Spark "
                    "engine's driver takes it from its run configuration (`ChangeBatches(config)`)"
                )


_SPARK_NAMES = {
    name.lower(): name
    for name in (
        "startingOffsets",
        "endingOffsets",
        "maxOffsetsPerTrigger",
        "minPartitions",
        "kafkaConsumer.pollTimeoutMs",
        "group",
        "stateLocation",
        "table",
    )
}
_OPTION_FIELDS = {
    "startingoffsets": "starting_offsets",
    "endingoffsets": "ending_offsets",
    "maxoffsetspertrigger": "max_offsets_per_trigger",
    "minpartitions": "min_partitions",
    "kafkaconsumer.polltimeoutms": "poll_timeout_ms",
    "group": "group",
    "statelocation": "state_location",
    "table": "table",
}


def register(spark: SparkSession) -> None:
    """Make `format("ticdc")` available to `spark.read` and `spark.readStream`."""
    spark.dataSource.register(TicdcDataSource)


class TicdcDataSource(DataSource):
    """Segments of every record (for `ChangeBatches`), or with option `table` that table's typed changes
    (`consumer.spark.table_source`)."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self) -> StructType | str:
        options = TicdcOptions.parse(self.options)
        if options.table:
            from consumer.spark.table_source import stream_schema  # it plans on this module's helpers

            return stream_schema(options)
        return SPARK_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        options = TicdcOptions.parse(self.options)
        if options.table:
            raise ValueError(f"option 'table' makes a stream: use spark.readStream.format({NAME!r})")
        return TicdcBatchReader(options)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        options = TicdcOptions.parse(self.options)
        if options.table:
            from consumer.spark.table_source import TableStreamReader

            return TableStreamReader(options, schema)
        return TicdcStreamReader(options)


class OffsetRange(InputPartition):
    """One task's work: records [start, end) of one Kafka partition."""

    def __init__(self, topic: str, partition: int, start: int, end: int) -> None:
        super().__init__((topic, partition, start, end))
        self.topic, self.partition, self.start, self.end = topic, partition, start, end


class OffsetRanges(InputPartition):
    """One task's work when ranges are small (`SMALL_TASK_RECORDS`): each range in turn."""

    def __init__(self, ranges: Sequence[OffsetRange]) -> None:
        super().__init__(tuple(part.value for part in ranges))
        self.ranges = list(ranges)


class TicdcStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Plans micro-batches in the driver's planner process; `read` runs in executor tasks, on a copy."""

    def __init__(self, options: TicdcOptions) -> None:
        self.options = options
        self._target: dict[TopicPartition, int] | None = None  # availableNow: the ends fixed at its start
        self._kafka: _KafkaOffsets | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"options": self.options, "_target": None, "_kafka": None}  # tasks need only the options

    def initialOffset(self) -> Offsets:
        return _offsets_json(_resolve(self.options.starting_offsets, self._client().bounds()))

    def getDefaultReadLimit(self) -> ReadLimit:
        limit = self.options.max_offsets_per_trigger
        return ReadMaxRows(limit) if limit else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {tp: high for tp, (_, high) in self._client().bounds().items()}

    def latestOffset(self, start: Offsets, limit: ReadLimit) -> Offsets:
        """The ends of the next batch: the partitions' latest offsets (or the availableNow target), within
        `limit`; a partition the engine asked to pause stays where it is, a new one starts at its earliest."""
        begin = _from_json(start)
        bounds = self._client().bounds()
        paused = self._paused()
        ends: dict[TopicPartition, int] = {}
        for tp, (low, high) in bounds.items():
            if tp not in begin:
                ends[tp] = low
            elif tp in paused:
                ends[tp] = begin[tp]
            else:
                target = high if self._target is None else min(high, self._target.get(tp, begin[tp]))
                ends[tp] = max(begin[tp], target)
        if isinstance(limit, ReadMaxRows):
            ends = _limited(begin, ends, limit.max_rows)
        return _offsets_json({**begin, **ends})

    def partitions(self, start: Offsets, end: Offsets) -> Sequence[InputPartition]:
        return _tasks(_ranges(_from_json(start), _from_json(end), self.options.min_partitions), self.options)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options, partition, spool=bool(self.options.state_location))

    def commit(self, end: Offsets) -> None:
        """Nothing to do: Spark's checkpoint holds the offsets, and the engine's record prunes itself."""

    def stop(self) -> None:
        if self._kafka is not None:
            self._kafka.close()
            self._kafka = None

    def _client(self) -> _KafkaOffsets:
        if self._kafka is None:
            self._kafka = _KafkaOffsets(self.options)
        return self._kafka

    def _paused(self) -> set[TopicPartition]:
        if not self.options.state_location:
            return set()
        latest = CarryStore(self.options.state_location).latest_metadata()
        return latest[2] if latest else set()


class TicdcBatchReader(DataSourceReader):
    """`spark.read.format("ticdc")`: the segments between `startingOffsets` and `endingOffsets`."""

    def __init__(self, options: TicdcOptions) -> None:
        self.options = options

    def partitions(self) -> Sequence[InputPartition]:
        kafka = _KafkaOffsets(self.options)
        try:
            bounds = kafka.bounds()
        finally:
            kafka.close()
        options = self.options
        starts, ends = _resolve(options.starting_offsets, bounds), _resolve(options.ending_offsets, bounds)
        return _tasks(_ranges(starts, ends, options.min_partitions), options)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_partition(self.options, partition)


# -- tasks ------------------------------------------------------------------------------------------------
_task_schemas: dict[
    str, tuple[tuple[int | None, tuple[int, ...]], SchemaCache]
] = {}  # per state location, in a (reused) Python worker


def read_partition(
    options: TicdcOptions, partition: InputPartition, *, spool: bool = False
) -> Iterator[pa.RecordBatch]:
    """A task: its range, or its small ranges (none: Spark plans one task of no range when `partitions`
    found nothing to read)."""
    if isinstance(partition, OffsetRanges):
        yield from read_ranges(options, partition.ranges, spool=spool)
    elif isinstance(partition, OffsetRange):
        yield from read_ranges(options, [partition], spool=spool)


def read_range(options: TicdcOptions, part: OffsetRange, *, spool: bool = False) -> Iterator[pa.RecordBatch]:
    """One range, as a task reads it (`read_ranges`)."""
    return read_ranges(options, [part], spool=spool)


def read_ranges(
    options: TicdcOptions, parts: Sequence[OffsetRange], *, spool: bool = False
) -> Iterator[pa.RecordBatch]:
    """A task: read the ranges (of distinct partitions) with one confluent-kafka consumer, a segment row per
    `SEGMENT_RECORDS` records of a range; `spool`: its typed rows go to spool files in the state location,
    the segment carries their index (`Segment.spool`)."""
    schemas = _schemas_for(options.state_location)
    policy = build_policy(options.settings)
    decoder = _task_decoder(options.settings, policy)
    fetcher = _RangeFetcher(options, parts)
    try:
        for part in parts:
            position = part.start
            while position < part.end:
                started = time.process_time()  # the process's: librdkafka's threads fetch for this task
                records = fetcher.fetch(part, position)
                end = records[-1].offset + 1
                fetched = time.process_time() - started
                segment = encode_range(
                    part.topic, part.partition, position, end, records, schemas, decoder, policy, fetched
                )
                if spool:
                    segment = segment.spool(options.state_location)
                yield pa.RecordBatch.from_pylist([segment.to_row()], schema=ARROW_SCHEMA)
                position = end
    finally:
        fetcher.close()
        settle_worker()


class _RangeFetcher:
    """One consumer for a task's ranges, each partition assigned at its range's start, so that librdkafka
    fetches them together (a consumer per range cost a client's start and a fetch's round trip each).
    Records of a range other than the one being read wait in a buffer: ranges that share a task are small
    (`SMALL_TASK_RECORDS`)."""

    def __init__(self, options: TicdcOptions, parts: Sequence[OffsetRange]) -> None:
        self._ranges = {(part.topic, part.partition): part for part in parts}
        if len(self._ranges) != len(parts):
            raise ValueError(f"a task's ranges must be of distinct partitions: {parts}")
        self._timeout = options.poll_timeout_ms / 1000
        self._waiting: dict[TopicPartition, list[SourceRecord]] = {tp: [] for tp in self._ranges}
        self._source = KafkaSource(
            options.bootstrap_servers,
            sorted({part.topic for part in parts}),
            options.client_group,
            partitions=list(self._ranges),
            config=options.kafka,
            listener=FixedStarts({tp: part.start for tp, part in self._ranges.items()}),
            unreachable_timeout=options.settings.source.unreachable_timeout_s,
        )

    def fetch(self, part: OffsetRange, position: int) -> list[SourceRecord]:
        """Up to `SEGMENT_RECORDS` records of the range from `position`; a range Kafka no longer (or not
        yet) holds is an error, never a silent gap."""
        wanted = min(SEGMENT_RECORDS, part.end - position)
        tp = (part.topic, part.partition)
        records: list[SourceRecord] = []
        waited_since = time.monotonic()
        expected = position
        while len(records) < wanted:
            fresh = [r for r in self._take(tp, wanted - len(records)) if expected <= r.offset < part.end]
            if fresh:
                if fresh[0].offset != expected or fresh[-1].offset - expected + 1 != len(fresh):
                    raise SourceError(  # e.g. deleted by retention before this batch read them
                        f"{part.topic}[{part.partition}]: records missing between offsets {expected} and "
                        f"{fresh[-1].offset}: they are no longer in Kafka"
                    )
                records += fresh
                expected = fresh[-1].offset + 1
                waited_since = time.monotonic()
            elif time.monotonic() - waited_since > self._timeout:
                raise SourceError(
                    f"{part.topic}[{part.partition}]: offsets {expected}..{part.end - 1} did not arrive "
                    f"within {self._timeout:.0f} s (kafkaConsumer.pollTimeoutMs)"
                )
        return records

    def _take(self, tp: TopicPartition, count: int) -> list[SourceRecord]:
        """Up to `count` waiting records of `tp`, polling once when none wait; the other ranges' records
        polled wait for their turn (records past a range's end are dropped)."""
        waiting = self._waiting[tp]
        if not waiting:
            complete = []
            for record in self._source.poll_batch(count, _POLL_S):
                key = (record.topic, record.partition)
                part = self._ranges.get(key)
                if part is not None and record.offset < part.end:
                    self._waiting[key].append(record)
                    if record.offset == part.end - 1:
                        complete.append(key)
            if complete:  # nothing more of these is wanted: librdkafka stops fetching past their ends
                self._source.pause(complete)
        taken, self._waiting[tp] = waiting[:count], waiting[count:]
        return taken

    def close(self) -> None:
        self._source.close()


def _task_decoder(settings: RunConfig, policy: ValuePolicy) -> MessageDecoder | None:
    """The Simple protocol's decoder (its BOOTSTRAPs and DDLs teach a task the schemas to type rows with);
    none for the protocols whose records describe their own rows: the driver decodes those."""
    if settings.decode.protocol != "simple":
        return None
    decoder = build_decoder(settings.decode, policy)
    assert isinstance(decoder, MessageDecoder)
    return decoder


def _schemas_for(location: str) -> SchemaCache:
    """The schemas the engine recorded with its newest batch and those the batches after it announced (being
    applied while this task runs), kept per worker while those are the newest. A record written meanwhile
    (the batch being applied completed) removes the announcements it holds: then both are read again, else
    its schemas would be in neither."""
    if not location:
        return SchemaCache()
    store = CarryStore(location)
    while True:
        latest = store.latest_metadata()
        batch_id, snapshot = (latest[0], latest[1]) if latest is not None else (None, b"")
        announced = store.announced_after(batch_id)
        if store.latest() == batch_id:
            break
    version = (batch_id, tuple(announced_id for announced_id, _ in announced))
    cached = _task_schemas.get(location)
    if cached is None or cached[0] != version:
        schemas = SchemaCache.restore(snapshot) if snapshot else SchemaCache()
        for _, data in announced:
            for schema in snapshot_schemas(data):
                schemas.add(schema)
        cached = _task_schemas[location] = (version, schemas)
    return cached[1]


# -- planning -------------------------------------------------------------------------------------------
class _KafkaOffsets:
    """The subscribed topics' partitions and their earliest and end offsets (the planner's client). The ends
    are those a fetch finds (`EndOffsets.bounds`): the broker's listed ends alone can fall short of the
    records a reader gets (tansu lists a partition's last producer batch as one record)."""

    def __init__(self, options: TicdcOptions) -> None:
        self._topics = options.topics
        self._ends = EndOffsets(
            options.bootstrap_servers, options.kafka, group=options.client_group, timeout=_METADATA_TIMEOUT_S
        )

    def bounds(self) -> dict[TopicPartition, tuple[int, int]]:
        return self._ends.bounds(self._topics)

    def close(self) -> None:
        self._ends.close()


def _resolve(setting: str, bounds: Mapping[TopicPartition, tuple[int, int]]) -> dict[TopicPartition, int]:
    """`earliest`, `latest` or Spark's JSON form (-2 earliest, -1 latest; unnamed partitions earliest)."""
    if setting in ("earliest", "latest"):
        return {tp: bound[0 if setting == "earliest" else 1] for tp, bound in bounds.items()}
    try:
        named = _from_json(json.loads(setting))
    except (ValueError, AttributeError, TypeError) as exc:
        raise ValueError(
            f'offsets {setting!r}: expected earliest, latest or {{"topic": {{"0": 42}}}}'
        ) from exc
    offsets = {}
    for tp, (low, high) in bounds.items():
        offset = named.get(tp, EARLIEST)
        offsets[tp] = low if offset == EARLIEST else high if offset == LATEST else min(max(offset, low), high)
    return offsets


def _limited(
    begin: Mapping[TopicPartition, int], ends: dict[TopicPartition, int], limit: int
) -> dict[TopicPartition, int]:
    """At most `limit` records in all, each partition's share in proportion to its backlog (Spark's Kafka
    source does the same), the rounding remainder to the largest backlogs."""
    backlog = {tp: end - begin.get(tp, end) for tp, end in ends.items()}
    total = sum(backlog.values())
    if total <= limit:
        return ends
    shares = {tp: limit * size // total for tp, size in backlog.items()}
    spare = limit - sum(shares.values())
    for tp in sorted(backlog, key=lambda tp: backlog[tp] - shares[tp], reverse=True)[:spare]:
        shares[tp] += 1
    return {tp: begin.get(tp, end) + min(shares[tp], backlog[tp]) for tp, end in ends.items()}


def _ranges(
    start: Mapping[TopicPartition, int], end: Mapping[TopicPartition, int], min_partitions: int | None
) -> list[OffsetRange]:
    """A task per partition's range; with `min_partitions`, the largest ranges split in halves until there
    are that many (a task learns the schemas its own range announces: rows of a later half that only the
    first half's BOOTSTRAP describes are typed by the driver instead)."""
    ranges = [
        (topic, partition, start.get((topic, partition), stop), stop)
        for (topic, partition), stop in end.items()
        if stop > start.get((topic, partition), stop)
    ]
    while ranges and len(ranges) < (min_partitions or 0):
        largest = max(ranges, key=lambda r: r[3] - r[2])
        topic, partition, low, high = largest
        if high - low < 2:
            break
        middle = (low + high) // 2
        ranges.remove(largest)
        ranges += [(topic, partition, low, middle), (topic, partition, middle, high)]
    return [OffsetRange(*r) for r in sorted(ranges)]


def _tasks(ranges: list[OffsetRange], options: TicdcOptions) -> list[InputPartition]:
    """A task per range, but ranges of fewer than `SMALL_TASK_RECORDS` records share tasks of up to that
    many: a small micro-batch runs as one wave of tasks, not one task per partition (each costs Spark and
    its Python worker tens of ms); large ranges keep their own. Not with `minPartitions` (tasks asked for)."""
    if options.min_partitions:
        return list(ranges)
    tasks: list[InputPartition] = []
    shared: list[OffsetRange] = []
    size = 0
    for part in ranges:
        records = part.end - part.start
        if records >= SMALL_TASK_RECORDS:
            tasks.append(part)
            continue
        if shared and size + records > SMALL_TASK_RECORDS:
            tasks.append(shared[0] if len(shared) == 1 else OffsetRanges(shared))
            shared, size = [], 0
        shared.append(part)
        size += records
    if shared:
        tasks.append(shared[0] if len(shared) == 1 else OffsetRanges(shared))
    return tasks


def starting_offsets(offsets: Mapping[TopicPartition, int]) -> str:
    """The `startingOffsets` option that starts these partitions at these offsets (the others at their
    earliest)."""
    return json.dumps(_offsets_json(offsets))


def _offsets_json(offsets: Mapping[TopicPartition, int]) -> Offsets:
    result: Offsets = {}
    for (topic, partition), offset in sorted(offsets.items()):
        result.setdefault(topic, {})[str(partition)] = offset
    return result


def parse_offsets(text: str) -> dict[TopicPartition, int]:
    """Offsets in Spark's Kafka JSON form, as a query's progress and checkpoint hold them."""
    return _from_json(json.loads(text))


def _from_json(offsets: Mapping[str, Mapping[str, int]]) -> dict[TopicPartition, int]:
    return {
        (topic, int(partition)): int(offset)
        for topic, parts in offsets.items()
        for partition, offset in parts.items()
    }
