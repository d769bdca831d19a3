"""The Spark engine's parts without Spark: what tasks encode (segments), what the driver carries between
batches (the carry store), how the planner sizes batches, and the typed rows' blocks through the state
machine (they must give exactly what decoding every row on the driver gives)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import msgspec
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.batches.changes import SpooledChanges, block_changes, table_changes
from consumer.batches.spool import SpooledRows
from consumer.errors import ConsumerError, DeadLetter, RecordLocation
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
from consumer.spark import source
from consumer.spark.carry import KEEP_BATCHES, Carry, CarryStore
from consumer.spark.segments import Segment, encode_range
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
from consumer.state.machine import ConsumerState
from consumer.state.schema_cache import SchemaCache
from consumer.state.units import BlockBatch, RowBatch, Unit

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
    decoded = list(segment.decoded(MessageDecoder()))  # the records the task did not type
    assert [location.offset for location, _, _, _ in decoded] == [11, 13, 14, 15]
    kinds = [type(m).__name__ for _, m, _, _ in decoded]
    assert kinds == ["Bootstrap", "RawDML", "CompressionError", "Watermark"]
    assert (
        decoded[2][2] == b"\x00garbage"
    )  # a record that does not decode keeps its value for the dead letter
    [block] = segment.blocks()
    assert (block.key, block.table_id, block.tp, block.whole) == (SCHEMA.key, 7, ("t", 1), True)
    assert block.offsets.tolist() == [10, 12, 16]
    assert block.commit_ts.tolist() == [TS, TS + 1, TS + 2]
    assert block.rows.equals(segment.changes[SCHEMA.key])


def test_a_task_types_rows_of_schemas_the_engine_recorded() -> None:
    schemas = SchemaCache()
    schemas.add(OTHER)
    segment = _segment(schemas=schemas)
    assert set(segment.changes) == {SCHEMA.key, OTHER.key}


def test_segments_filter_and_keep_their_typed_rows() -> None:
    segment = _segment()
    kept = segment.kept([12, 15, 13])
    assert kept.records["offset"].to_pylist() == [12, 13, 15]
    assert kept.start_offset == 12
    assert kept.changes[SCHEMA.key]["_offset"].to_pylist() == [12, 12]
    later = segment.from_offset(14)
    assert later.records["offset"].to_pylist() == [14, 15, 16]
    assert later.changes[SCHEMA.key]["_offset"].to_pylist() == [16]


def _two_segments() -> list[Segment]:
    """The first row read alone (no schema: left untyped), the rest with the BOOTSTRAP (typed)."""
    records = _stream()
    return [_segment(records[:1]), _segment(records[1:])]


def _fed(segments: list[Segment]) -> ConsumerState:
    """A state machine fed as the Spark engine feeds it: each segment's untyped records, then the blocks."""
    state = ConsumerState()
    state.assign([("t", 1)])
    decoder = MessageDecoder()
    for segment in segments:
        for location, message, value, _ in segment.decoded(decoder):
            if isinstance(message, ConsumerError):
                state.process_failed(location, message, value)
            else:
                state.process(location, message)
    state.process_blocks([block for segment in segments for block in segment.blocks()])
    return state


def _orders_changelog(units: Sequence[Unit]) -> pa.Table:
    """The orders rows of resolved units, typed as the sink writer types them."""
    codec = TableCodec(SCHEMA)
    pieces = []
    for unit in units:
        if isinstance(unit, BlockBatch):
            pieces.append(block_changes(codec, unit.blocks).changelog)
        elif isinstance(unit, RowBatch) and unit.schema.table == "orders":
            pieces.append(table_changes(codec, unit.rows, unit.origins).changelog)
    return pa.concat_tables(pieces)


def test_blocks_and_untyped_rows_resolve_to_what_decoding_every_row_on_the_driver_gives() -> None:
    segments = _two_segments()
    assert not segments[0].changes and segments[1].changes[SCHEMA.key]["_offset"].to_pylist() == [12, 12, 16]
    state = _fed(segments)
    state.process(RecordLocation("t", 1, 20), Watermark(commit_ts=TS + 2, build_ts=0))
    units = state.resolve()
    decoded = [(MessageDecoder().decode(r.value), r.location) for r in _stream() if r.offset in (10, 12, 16)]
    on_driver = [(message, location) for message, location in decoded if isinstance(message, RawDML)]
    expected = table_changes(TableCodec(SCHEMA), on_driver).changelog
    assert _orders_changelog(units).equals(expected)
    kinds = [type(unit).__name__ for unit in units if not isinstance(unit, DeadLetter)]
    assert kinds == ["RowBatch", "BlockBatch"]  # the untyped row first: its commit ts is the lowest


def test_a_block_straddling_the_watermark_leaves_its_later_rows_unapplied() -> None:
    state = _fed(_two_segments())  # the stream's WATERMARK (TS + 1) is before the DELETE (TS + 2)
    units = state.resolve()
    assert _orders_changelog(units)["_offset"].to_pylist() == [10, 12, 12]
    for unit in units:
        state.confirm(unit)
    assert state.unapplied_offsets() == {("t", 1): [13, 16]}  # the items row waits for its schema
    assert state.committable() == {("t", 1): 13}
    state.process(RecordLocation("t", 1, 20), Watermark(commit_ts=TS + 2, build_ts=0))
    later = state.resolve()
    assert [type(unit).__name__ for unit in later] == ["BlockBatch"]
    assert _orders_changelog(later)["_offset"].to_pylist() == [16]


def test_a_block_teaches_the_state_machine_the_schema_that_typed_it() -> None:
    schemas = SchemaCache()
    schemas.add(SCHEMA)
    typed_alone = Segment.from_row(_segment(_stream()[2:3], schemas).to_row())  # its BOOTSTRAP read before
    state = ConsumerState()
    state.assign([("t", 1)])
    state.process_blocks(typed_alone.blocks())
    assert state.schemas.get(SCHEMA.key) == SCHEMA
    without = dataclasses.replace(typed_alone.blocks()[0], typed_by=None)
    unknowing = ConsumerState()
    unknowing.assign([("t", 1)])
    with pytest.raises(ValueError, match=r"shop\.orders version 3"):
        unknowing.process_blocks([without])


def test_a_spooled_segment_carries_an_index_and_its_rows_read_back_as_the_inline_ones(tmp_path: Path) -> None:
    """Spooled: the typed rows go to a file, the segment (on the wire and in the carry) holds per DML its
    offset, commit ts, table id and images; the blocks resolve to the very changelog of the inline rows."""
    inline = _segment()
    spooled = Segment.from_row(inline.spool(str(tmp_path / "state")).to_row())
    assert spooled.records["offset"].to_pylist() == [11, 13, 14, 15]  # the untyped records only
    assert [schema.key for schema in spooled.announced] == [SCHEMA.key]  # the next batch's tasks learn it
    index = spooled.changes[SCHEMA.key]
    assert index.column_names == ["_offset", "_commit_ts", "_table_id", "_images"]
    assert index["_offset"].to_pylist() == [10, 12, 16] and index["_images"].to_pylist() == [1, 2, 1]
    [path] = [spool.path for spool in spooled.spooled.values()]
    assert Path(path).is_file() and Path(path).is_relative_to(tmp_path / "state" / "spool" / "t" / "1")
    [block] = spooled.blocks()
    assert isinstance(block.rows, SpooledRows) and block.offsets.tolist() == [10, 12, 16]
    changes = block_changes(TableCodec(SCHEMA), [block])
    assert isinstance(changes, SpooledChanges) and changes.row_count == 4
    assert changes.changelog.equals(block_changes(TableCodec(SCHEMA), inline.blocks()).changelog)
    kept = spooled.kept([12, 15])
    assert kept.start_offset == 12 and kept.offsets().tolist() == [15, 12]
    [part] = kept.blocks()
    assert not part.whole and block_changes(TableCodec(SCHEMA), [part]).row_count == 2
    assert spooled.from_offset(13).changes[SCHEMA.key]["_offset"].to_pylist() == [16]


def test_spool_files_go_once_read_and_not_carried(tmp_path: Path) -> None:
    location = str(tmp_path / "state")
    store = CarryStore(location)
    segment = _segment()
    old, carried, later = (
        dataclasses.replace(segment, start_offset=start, end_offset=end).spool(location)
        for start, end in ((0, 10), (10, 17), (17, 30))
    )
    keep = {spool.path for spool in carried.spooled.values()}
    store.remove_spooled({("t", 1): 17, ("t", 2): 5}, keep)
    left = {str(path) for path in (tmp_path / "state" / "spool").rglob("*.arrow")}
    assert left == keep | {spool.path for spool in later.spooled.values()}
    assert not {spool.path for spool in old.spooled.values()} & left


def test_tasks_learn_the_schemas_the_batch_being_applied_announced(tmp_path: Path) -> None:
    """The driver records the schemas a batch's BOOTSTRAPs and DDLs name as it hands the batch over; the
    next batch's tasks (which start before the batch's record) type rows with them, until the record holds
    them."""
    location = str(tmp_path / "state")
    segment = Segment.from_row(_segment().to_row())
    assert [schema.key for schema in segment.announced] == [SCHEMA.key]
    store = CarryStore(location)
    assert SCHEMA.key not in source._schemas_for(location)
    store.write_announced(0, msgspec.msgpack.encode(segment.announced))
    assert store.announced_after(None) == [(0, msgspec.msgpack.encode([SCHEMA]))]
    assert SCHEMA.key in source._schemas_for(location)
    store.write(0, Carry([], msgspec.msgpack.encode([SCHEMA]), set()))
    assert store.announced_after(None) == [] and SCHEMA.key in source._schemas_for(location)


def test_a_task_reading_as_the_batch_being_applied_is_recorded_still_learns_its_schemas(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch's record is written (and its announcement removed) between a task reading the record
    before it and reading the announcements: the task reads both again, and learns the batch's schemas."""
    location = str(tmp_path / "state")
    store = CarryStore(location)
    store.write_announced(0, msgspec.msgpack.encode([SCHEMA]))
    read_announced = CarryStore.announced_after

    def recorded_meanwhile(self: CarryStore, batch_id: int | None) -> list[tuple[int, bytes]]:
        if store.latest() is None:
            store.write(0, Carry([], msgspec.msgpack.encode([SCHEMA]), set()))
        return read_announced(self, batch_id)

    monkeypatch.setattr(CarryStore, "announced_after", recorded_meanwhile)
    assert SCHEMA.key in source._schemas_for(location)


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
    _, message, value, key = list(segment.decoded(MessageDecoder()))[2]
    assert isinstance(message, ConsumerError) and (value, key) == (b"\x00garbage", b"the key")
