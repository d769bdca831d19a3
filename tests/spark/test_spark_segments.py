"""The Spark engine's parts without Spark: what tasks encode (segments), what the driver carries between
batches (the carry store), how the planner sizes batches, and the row decoder that takes typed rows from
segments (it must give exactly what decoding every row on the driver gives)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.batches.changes import table_changes
from consumer.errors import ConsumerError, RecordLocation, ValueDecodeError
from consumer.protocol.model import (
    DML,
    Bootstrap,
    Column,
    DataType,
    DMLType,
    Index,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.sources.record import SourceRecord
from consumer.spark.carry import KEEP_BATCHES, Carry, CarryStore
from consumer.spark.engine import _ExecutorRows
from consumer.spark.segments import Segment, encode_range, merged
from consumer.spark.source import (
    SMALL_TASK_RECORDS,
    OffsetRange,
    OffsetRanges,
    TicdcOptions,
    _limited,
    _ranges,
    _resolve,
    _tasks,
)
from consumer.state.schema_cache import SchemaCache
from consumer.state.units import RowOrigins

SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=7,
    version=3,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("note", DataType("varchar", charset="utf8mb4", collate="utf8mb4_bin", length=40)),
        Column("made", DataType("date")),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
OTHER = msgspec.structs.replace(SCHEMA, table="items", table_id=8, version=4)
TS = 449512873440575500
ENCODER = MessageEncoder()


def _dml(schema: TableSchema, kind: DMLType, key: int, ts: int, note: str = "n") -> bytes:
    image = {"id": key, "note": note, "made": None}
    dml = DML(
        type=kind,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=ts,
        build_ts=0,
        schema_version=schema.version,
        data=None if kind is DMLType.DELETE else image,
        old=image if kind is not DMLType.INSERT else None,
    )
    return ENCODER.encode(dml, schema)


def _records(values: Sequence[bytes | None], start: int = 10) -> list[SourceRecord]:
    return [SourceRecord("t", 1, start + index, value=value) for index, value in enumerate(values)]


def _stream() -> list[SourceRecord]:
    """orders rows before and after its BOOTSTRAP, items rows whose schema never comes, a bad record."""
    return _records(
        [
            _dml(SCHEMA, DMLType.INSERT, 1, TS),
            ENCODER.encode(Bootstrap(table_schema=SCHEMA, build_ts=0)),
            _dml(SCHEMA, DMLType.UPDATE, 1, TS + 1),
            _dml(OTHER, DMLType.INSERT, 5, TS + 1),
            b"\x00garbage",
            ENCODER.encode(Watermark(commit_ts=TS + 1, build_ts=0)),
            _dml(SCHEMA, DMLType.DELETE, 1, TS + 2),
        ]
    )


def _segment(records: list[SourceRecord] | None = None, schemas: SchemaCache | None = None) -> Segment:
    records = records if records is not None else _stream()
    end = records[-1].offset + 1
    return encode_range(
        "t", 1, records[0].offset, end, records, schemas or SchemaCache(), MessageDecoder(), ValuePolicy()
    )


def test_a_task_types_the_rows_whose_schema_its_range_announces_and_keeps_the_rest_as_values() -> None:
    segment = Segment.from_row(_segment().to_row())  # through the wire form
    assert list(segment.changes) == [SCHEMA.key]
    assert segment.changes[SCHEMA.key]["_offset"].to_pylist() == [10, 12, 12, 16]  # the UPDATE twice
    decoded = list(segment.decoded(MessageDecoder()))
    assert [location.offset for location, _, _, _ in decoded] == list(range(10, 17))
    kinds = [
        "typed" if isinstance(m, RawDML) and not m.payload else type(m).__name__ for _, m, _, _ in decoded
    ]
    assert kinds == [
        "typed",
        "Bootstrap",
        "typed",
        "RawDML",
        "CompressionError",
        "Watermark",
        "typed",
    ]
    typed = decoded[0][1]
    assert isinstance(typed, RawDML)
    assert (
        typed.type,
        typed.database,
        typed.table,
        typed.table_id,
        typed.commit_ts,
        typed.schema_version,
    ) == (
        DMLType.INSERT,
        "shop",
        "orders",
        7,
        TS,
        3,
    )
    assert (
        decoded[4][2] == b"\x00garbage"
    )  # a record that does not decode keeps its value for the dead letter


def test_a_task_types_rows_of_schemas_the_engine_recorded() -> None:
    schemas = SchemaCache()
    schemas.add(OTHER)
    segment = _segment(schemas=schemas)
    assert set(segment.changes) == {SCHEMA.key, OTHER.key}


def test_segments_filter_merge_and_keep_their_typed_rows() -> None:
    segment = _segment()
    kept = segment.kept([12, 15, 13])
    assert kept.records["offset"].to_pylist() == [12, 13, 15]
    assert kept.start_offset == 12
    assert kept.changes[SCHEMA.key]["_offset"].to_pylist() == [12, 12]
    later = segment.from_offset(14)
    assert later.records["offset"].to_pylist() == [14, 15, 16]
    assert later.changes[SCHEMA.key]["_offset"].to_pylist() == [16]
    both = merged([kept, later])
    assert both.records["offset"].to_pylist() == [12, 13, 15, 14, 15, 16]
    assert both.changes[SCHEMA.key]["_offset"].to_pylist() == [12, 12, 16]


def _orders_rows(records: list[SourceRecord], typed: set[int]) -> list[tuple[RawDML, RecordLocation]]:
    """The orders rows as the resolver hands them out: rows at `typed` offsets by their header only."""
    decoder = MessageDecoder()
    rows = []
    for record in records:
        try:
            message = decoder.decode(record.value)
        except ConsumerError:
            continue
        if isinstance(message, RawDML) and message.table == "orders":
            header = msgspec.structs.replace(message, payload=b"") if record.offset in typed else message
            rows.append((header, record.location))
    return sorted(rows, key=lambda row: (row[0].commit_ts, row[1].offset))


def _two_segments() -> list[Segment]:
    """The first row read alone (no schema: left untyped), the rest with the BOOTSTRAP (typed)."""
    records = _stream()
    return [_segment(records[:1]), _segment(records[1:])]


def test_the_row_decoder_gives_what_decoding_every_row_on_the_driver_gives() -> None:
    segments = _two_segments()
    assert not segments[0].changes and segments[1].changes[SCHEMA.key]["_offset"].to_pylist() == [12, 12, 16]
    executor_rows = _ExecutorRows()
    executor_rows.use(segments)
    codec = TableCodec(SCHEMA)
    on_driver = _orders_rows(_stream(), typed=set())
    mixed = _orders_rows(_stream(), typed={12, 16})
    assert executor_rows(codec, mixed, None).changelog.equals(table_changes(codec, on_driver).changelog)
    typed = mixed[1:]
    assert executor_rows(codec, typed, RowOrigins.of(typed)).changelog.equals(
        table_changes(codec, on_driver[1:]).changelog
    )


def test_the_row_decoder_names_a_bad_row_by_its_index_in_the_batch() -> None:
    broken = _dml(SCHEMA, DMLType.INSERT, 2, TS + 3).replace(b'"made":null', b'"made":"not a date"')
    bad = MessageDecoder().decode(broken)
    assert isinstance(bad, RawDML)
    executor_rows = _ExecutorRows()
    executor_rows.use(_two_segments())
    rows = [*_orders_rows(_stream(), typed={12, 16}), (bad, RecordLocation("t", 1, 40))]
    with pytest.raises(ValueDecodeError) as failed:
        executor_rows(TableCodec(SCHEMA), rows, None)
    assert failed.value.row == 3


def test_the_row_decoder_refuses_a_typed_row_no_segment_holds() -> None:
    executor_rows = _ExecutorRows()
    executor_rows.use(_two_segments()[:1])
    with pytest.raises(RuntimeError, match="in no segment"):
        executor_rows(TableCodec(SCHEMA), _orders_rows(_stream(), typed={12, 16}), None)


def test_the_carry_store_writes_whole_batches_and_keeps_the_newest(tmp_path: Path) -> None:
    store = CarryStore(str(tmp_path / "state"))
    assert store.latest() is None and store.latest_metadata() is None
    segment = _segment()
    schemas = msgspec.msgpack.encode([SCHEMA])
    for batch in range(5):
        store.write(batch, Carry([segment.kept([12, 16])], schemas, {("t", batch)}))
    assert store.batches() == list(range(5 - KEEP_BATCHES, 5))
    assert sorted(path.name for path in (tmp_path / "state").iterdir()) == [
        f"batch-{batch:020d}.arrow" for batch in range(5 - KEEP_BATCHES, 5)
    ]  # no temporary files left
    carry = store.read(4)
    assert carry.schemas == schemas and carry.paused == {("t", 4)}
    assert [s.records["offset"].to_pylist() for s in carry.segments] == [[12, 16]]
    assert carry.segments[0].changes[SCHEMA.key].equals(segment.kept([12, 16]).changes[SCHEMA.key])
    assert store.latest_metadata() == (4, schemas, {("t", 4)})


def test_a_batch_s_ranges_are_recorded_until_its_record_is_old(tmp_path: Path) -> None:
    store = CarryStore(str(tmp_path / "state"))
    assert store.intent(0) is None
    for batch in range(5):
        store.write_intent(batch, [("t", 1, 10 * batch, 10 * batch + 10), ("t", 0, 0, batch)])
        store.write(batch, Carry([], b"", set()))
    assert store.intent(4) == [("t", 0, 0, 4), ("t", 1, 40, 50)]
    assert store.intent(5 - KEEP_BATCHES - 1) is None  # pruned with the batch records


def test_options_arrive_in_any_case_and_go_back_to_spark() -> None:
    options = TicdcOptions.parse(
        {
            "KAFKA.BOOTSTRAP.SERVERS": "b:9092",
            "subscribe": "a, b",
            "kafka.security.protocol": "SASL_SSL",
            "maxoffsetspertrigger": "500",
            "decode.protocol": "debezium",
            "DECODE.MAX_COMMIT_TS_AHEAD_S": "2.5",
            "integrity.verify_checksums": "false",
        }
    )
    assert (options.bootstrap_servers, options.topics, options.kafka) == (
        "b:9092",
        ("a", "b"),
        {"security.protocol": "SASL_SSL"},
    )
    settings = options.settings
    assert (options.max_offsets_per_trigger, settings.decode.protocol) == (500, "debezium")
    assert (settings.decode.max_commit_ts_ahead_s, settings.integrity.verify_checksums) == (2.5, False)
    assert TicdcOptions.parse(options.to_spark()) == options


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"subscribe": "t"}, "needs the option 'kafka.bootstrap.servers'"),
        ({"kafka.bootstrap.servers": "b"}, "needs the option 'subscribe'"),
        ({"kafka.bootstrap.servers": "b", "subscribe": "t", "startingoffset": "0"}, "unknown option"),
        ({"kafka.bootstrap.servers": "b", "subscribe": "t", "decode.ordering": "random"}, "invalid"),
        # the registry's credentials are the driver's (`ChangeBatches` reads them from the run configuration)
        ({"kafka.bootstrap.servers": "b", "subscribe": "t", "decode.schema_registry": "x"}, "table stream"),
        ({"kafka.bootstrap.servers": "b", "subscribe": "t", "errors.policy": "fail"}, "table stream"),
        ({"kafka.bootstrap.servers": "b", "subscribe": "t", "table": "orders"}, "DATABASE.TABLE"),
        ({"kafka.bootstrap.servers": "b", "subscribe": "t", "table": "shop.orders"}, "stateLocation"),
    ],
)
def test_bad_options_are_refused(options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TicdcOptions.parse(options)


BOUNDS = {("t", 0): (5, 100), ("t", 1): (0, 50)}


def test_starting_and_ending_offsets() -> None:
    assert _resolve("earliest", BOUNDS) == {("t", 0): 5, ("t", 1): 0}
    assert _resolve("latest", BOUNDS) == {("t", 0): 100, ("t", 1): 50}
    assert _resolve(json.dumps({"t": {"0": 3, "1": -1}}), BOUNDS) == {("t", 0): 5, ("t", 1): 50}
    assert _resolve(json.dumps({"t": {"1": 20}}), BOUNDS) == {("t", 0): 5, ("t", 1): 20}
    with pytest.raises(ValueError, match="expected earliest, latest"):
        _resolve("newest", BOUNDS)


backlogs = st.dictionaries(
    st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 5)),
    st.tuples(st.integers(0, 1000), st.integers(0, 1000)),
    max_size=8,
)


@settings(max_examples=200)
@given(backlogs, st.integers(1, 3000))
def test_a_read_limit_is_shared_by_backlog_and_never_exceeded(
    partitions: dict[tuple[str, int], tuple[int, int]], limit: int
) -> None:
    begin = {tp: start for tp, (start, _) in partitions.items()}
    ends = {tp: start + size for tp, (start, size) in partitions.items()}
    limited = _limited(begin, ends, limit)
    taken = {tp: limited[tp] - begin[tp] for tp in partitions}
    assert all(0 <= taken[tp] <= ends[tp] - begin[tp] for tp in partitions)
    assert sum(taken.values()) == min(limit, sum(ends[tp] - begin[tp] for tp in partitions))


@settings(max_examples=200)
@given(backlogs, st.integers(0, 12))
def test_ranges_split_for_more_tasks_still_cover_each_range_once(
    partitions: dict[tuple[str, int], tuple[int, int]], least: int
) -> None:
    start = {tp: begin for tp, (begin, _) in partitions.items()}
    end = {tp: begin + size for tp, (begin, size) in partitions.items()}
    ranges = _ranges(start, end, least)
    for tp in partitions:
        mine = [(r.start, r.end) for r in ranges if (r.topic, r.partition) == tp]
        covered = [offset for low, high in mine for offset in range(low, high)]
        assert covered == list(range(start[tp], end[tp]))
    splittable = sum(end[tp] - start[tp] for tp in partitions)
    assert len(ranges) >= min(least, splittable) or all(r.end - r.start < 2 for r in ranges)


def test_small_ranges_share_tasks_and_large_ones_keep_their_own() -> None:
    """A small micro-batch runs as one wave of tasks (a task costs tens of ms whatever it reads); every
    range is read once, in the same ranges; `minPartitions` keeps a task per range."""
    small = SMALL_TASK_RECORDS // 4
    parts = [OffsetRange("t", partition, 100, 100 + small) for partition in range(6)]
    parts.append(OffsetRange("t", 6, 0, SMALL_TASK_RECORDS))
    options = TicdcOptions(bootstrap_servers="b:9092", topics=("t",))
    tasks = _tasks(parts, options)
    assert [len(task.ranges) if isinstance(task, OffsetRanges) else 1 for task in tasks] == [4, 1, 2]
    read = [r for task in tasks for r in (task.ranges if isinstance(task, OffsetRanges) else [task])]
    assert sorted(r.value for r in read) == sorted(r.value for r in parts)
    assert all(
        sum(r.end - r.start for r in task.ranges) <= SMALL_TASK_RECORDS
        for task in tasks
        if isinstance(task, OffsetRanges)
    )
    assert _tasks(parts, msgspec.structs.replace(options, min_partitions=2)) == parts


def test_consumer_errors_of_tasks_name_the_record_and_keep_its_value_and_key() -> None:
    records = _stream()
    records[4] = msgspec.structs.replace(records[4], key=b"the key")
    segment = Segment.from_row(_segment(records).to_row())  # through the wire form
    _, message, value, key = list(segment.decoded(MessageDecoder()))[4]
    assert isinstance(message, ConsumerError) and (value, key) == (b"\x00garbage", b"the key")
