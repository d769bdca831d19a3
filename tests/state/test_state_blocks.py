"""Rows typed elsewhere (the Spark engine's executors) reach the state machine as blocks, one per partition
and schema version: they must be ordered, held back and committed exactly as the same rows fed one by one."""

from __future__ import annotations

import numpy as np

from consumer.errors import RecordLocation
from consumer.protocol.model import DDLType
from consumer.state import BlockBatch, ConsumerState, DDLUnit, RowBatch, RowBlock, Unit
from consumer.state.offsets import PartitionOffsets
from tests.state.test_state_scenarios import TOPIC, bootstrap, confirm_all, ddl, row, schema, watermark

ROWS = "the typed rows"  # opaque to the state machine


def block(partition: int, offsets: list[int], commit_ts: list[int], version: int = 1) -> RowBlock:
    return RowBlock(
        ("shop", "orders", version),
        10,
        TOPIC,
        partition,
        np.array(offsets, np.int64),
        np.array(commit_ts, np.int64),
        100,
        ROWS,
    )


def state_knowing(*versions: int, partitions: int = 2) -> ConsumerState:
    state = ConsumerState()
    state.assign((TOPIC, p) for p in range(partitions))
    state.learn_schemas(schema(version=v) for v in versions)
    return state


def at(partition: int, offset: int) -> RecordLocation:
    return RecordLocation(TOPIC, partition, offset)


def rows_of(unit: Unit) -> list[tuple[int, int, int]]:
    """(commit_ts, partition, offset) of a unit's rows, in emission order."""
    if isinstance(unit, RowBatch):
        return [(dml.commit_ts, location.partition, location.offset) for dml, location in unit.rows]
    assert isinstance(unit, BlockBatch)
    found = [
        (ts, b.partition, offset)
        for b in unit.blocks
        for ts, offset in zip(b.commit_ts.tolist(), b.offsets.tolist(), strict=True)
    ]
    return sorted(found)


def test_held_offsets_of_blocks_merge_with_the_records_held_around_them() -> None:
    offsets = PartitionOffsets()
    for offset in (3, 7):  # a DDL copy and a row waiting for its schema, fed first
        assert offsets.admit(offset)
        offsets.hold(offset)
    offsets.hold_many([4, 5, 8])
    assert offsets.unapplied() == [3, 4, 5, 7, 8]
    assert not offsets.admit(6)  # the blocks count as admitted
    offsets.apply([3, 4, 5])
    assert offsets.committable() == 7
    offsets.apply([7, 8])
    assert offsets.committable() == 9


def test_blocks_of_two_partitions_resolve_at_the_global_watermark_as_one_batch() -> None:
    state = state_knowing(1)
    state.process_blocks([block(0, [0, 1, 3], [100, 200, 300]), block(1, [0, 1], [150, 250])])
    state.process(at(0, 4), watermark(200))
    state.process(at(1, 2), watermark(260))
    [unit] = state.resolve()
    assert isinstance(unit, BlockBatch) and unit.schema == schema(version=1)
    assert rows_of(unit) == [(100, 0, 0), (150, 1, 0), (200, 0, 1)]  # 300 and 250 wait
    state.confirm(unit)
    assert state.committable() == {(TOPIC, 0): 3, (TOPIC, 1): 1}
    assert state.unapplied_offsets() == {(TOPIC, 0): [3], (TOPIC, 1): [1]}  # WATERMARKs are not held
    state.process(at(0, 5), watermark(400))
    state.process(at(1, 3), watermark(400))
    [later] = state.resolve()
    assert rows_of(later) == [(250, 1, 1), (300, 0, 3)]
    state.confirm(later)
    assert state.committable() == {(TOPIC, 0): 6, (TOPIC, 1): 4}


def test_a_ddl_is_a_barrier_for_blocks_of_the_versions_before_and_after_it() -> None:
    state = state_knowing(1, 2, partitions=1)
    state.process(at(0, 2), ddl(DDLType.ALTER, 200, schema(version=2)))
    state.process_blocks([block(0, [0, 1], [100, 150]), block(0, [3, 4], [250, 300], version=2)])
    state.process(at(0, 5), watermark(400))
    units = state.resolve()
    assert [type(unit).__name__ for unit in units] == ["BlockBatch", "DDLUnit", "BlockBatch"]
    first, alter, after = units
    assert rows_of(first) == [(100, 0, 0), (150, 0, 1)]
    assert isinstance(alter, DDLUnit) and alter.ddl.commit_ts == 200
    assert isinstance(after, BlockBatch) and after.schema.version == 2
    assert rows_of(after) == [(250, 0, 3), (300, 0, 4)]


def test_a_row_waiting_for_its_schema_holds_back_the_later_blocks_of_its_table() -> None:
    state = state_knowing(1, partitions=1)
    state.process(at(0, 1), row(120, version=3))  # its schema is not known yet
    state.process_blocks([block(0, [0, 2], [100, 150])])
    state.process(at(0, 3), watermark(400))
    [unit] = state.resolve()
    assert rows_of(unit) == [(100, 0, 0)]  # 150 would overtake the held row
    state.confirm(unit)
    state.process(at(0, 4), bootstrap(schema(version=3)))
    units = state.resolve()
    assert [rows_of(unit) for unit in units] == [[(120, 0, 1)], [(150, 0, 2)]]
    assert [type(unit).__name__ for unit in units] == ["RowBatch", "BlockBatch"]
    confirm_all(state, units)
    assert state.committable() == {(TOPIC, 0): 5}


def test_rows_fed_one_by_one_and_blocks_of_one_version_interleave_in_commit_order() -> None:
    state = state_knowing(1, partitions=1)
    state.process(at(0, 1), row(150))  # e.g. a row its task could not type
    state.process_blocks([block(0, [0, 2], [100, 200])])
    state.process(at(0, 3), watermark(400))
    units = state.resolve()
    assert [rows_of(unit) for unit in units] == [[(100, 0, 0)], [(150, 0, 1)], [(200, 0, 2)]]
    assert [type(unit).__name__ for unit in units] == ["BlockBatch", "RowBatch", "BlockBatch"]
    confirm_all(state, units)
    assert state.committable() == {(TOPIC, 0): 4}


def test_revoking_a_partition_drops_its_blocks_and_their_pins() -> None:
    state = state_knowing(1)
    state.process_blocks([block(0, [0, 1], [100, 150]), block(1, [0], [120])])
    assert state.schemas.pins(("shop", "orders", 1)) == 3
    state.revoke([(TOPIC, 0)])
    assert state.schemas.pins(("shop", "orders", 1)) == 1
    assert state.stats().waiting_rows == 1
    state.process(at(1, 1), watermark(400))
    [unit] = state.resolve()
    assert rows_of(unit) == [(120, 1, 0)]
