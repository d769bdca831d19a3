"""The state machine's building blocks on their own: schema cache, pending buffer, watermarks, offsets."""

from __future__ import annotations

from consumer.errors import RecordLocation
from consumer.protocol.model import DMLType, RawDML, TableSchema
from consumer.state import PartitionWatermarks, PendingBuffer, SchemaCache
from consumer.state.offsets import PartitionOffsets
from consumer.state.pending import ROW_OVERHEAD_BYTES


def schema(table: str, version: int, table_id: int = 1) -> TableSchema:
    return TableSchema(database="db", table=table, table_id=table_id, version=version)


def row(table: str, version: int, ts: int, table_id: int = 1) -> RawDML:
    return RawDML(
        type=DMLType.INSERT,
        database="db",
        table=table,
        table_id=table_id,
        commit_ts=ts,
        build_ts=0,
        schema_version=version,
        payload=b"p" * 4,
        encoding="json",
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_schema_cache_evicts_least_recently_used_but_never_pinned() -> None:
    cache = SchemaCache(maxsize=2)
    cache.pin(("db", "a", 1))  # a row waits for it before it is known
    for name in "abcd":
        cache.add(schema(name, 1, table_id=ord(name)))
    assert ("db", "a", 1) in cache
    assert ("db", "b", 1) not in cache
    assert len(cache) == 3

    cache.unpin(("db", "a", 1))
    cache.add(schema("e", 1, table_id=ord("e")))
    assert len(cache) == 2
    assert ("db", "e", 1) in cache


def test_schema_cache_dedupes_and_falls_back_to_table_id_and_version() -> None:
    cache = SchemaCache()
    assert cache.add(schema("t", 3, 7))
    assert not cache.add(schema("t", 3, 7))  # the same DDL's copy from another partition
    found = cache.lookup(("db", "renamed", 3), 7)
    assert found is not None
    assert (found.table, found.table_id, found.version) == ("renamed", 7, 3)
    assert cache.get(("db", "renamed", 3)) is found
    assert cache.lookup(("db", "renamed", 4), 7) is None
    assert cache.lookup(("db", "other", 3), 8) is None


def test_schema_cache_eviction_forgets_the_table_id_fallback() -> None:
    cache = SchemaCache(maxsize=1)
    cache.add(schema("t", 3, 7))
    cache.add(schema("u", 3, 8))
    assert cache.lookup(("db", "other", 3), 7) is None


def test_schema_cache_snapshot_round_trips_pinned_and_unpinned() -> None:
    cache = SchemaCache()
    cache.add(schema("a", 1))
    cache.add(schema("b", 2, 2))
    cache.pin(("db", "b", 2))
    restored = SchemaCache.restore(cache.snapshot())
    assert restored.get(("db", "a", 1)) == schema("a", 1)
    assert restored.get(("db", "b", 2)) == schema("b", 2, 2)


def test_pending_buffer_releases_in_arrival_order_by_key_or_table_id() -> None:
    buffer = PendingBuffer()
    for ts, partition in [(5, 0), (3, 1), (7, 0)]:
        buffer.hold(row("t", 1, ts), RecordLocation("x", partition, ts))
    buffer.hold(row("renamed", 1, 9), RecordLocation("x", 0, 9))
    buffer.hold(row("t", 2, 8), RecordLocation("x", 0, 8))
    assert buffer.floors() == {("db", "t"): 3, ("db", "renamed"): 9}

    released = buffer.release(schema("t", 1))
    assert sorted(r.dml.commit_ts for r in released) == [3, 5, 7, 9]
    assert [r.dml.commit_ts for r in released if r.dml.table == "t"] == [5, 3, 7]
    assert buffer.floors() == {("db", "t"): 8}
    assert buffer.rows == 1
    assert buffer.bytes == 4 + ROW_OVERHEAD_BYTES


def test_pending_buffer_expires_oldest_first_and_refreshes_the_floor() -> None:
    clock = FakeClock()
    buffer = PendingBuffer(timeout=10, clock=clock)
    buffer.hold(row("t", 1, 4), RecordLocation("x", 0, 0))
    clock.now = 5
    buffer.hold(row("t", 1, 2), RecordLocation("x", 1, 0))
    clock.now = 10
    assert buffer.oldest_age() == 10
    [expired] = buffer.expire()
    assert expired.dml.commit_ts == 4
    assert buffer.floors() == {("db", "t"): 2}
    assert buffer.earliest(lambda table, ids: 1 in ids) == 2
    assert buffer.earliest(lambda table, ids: table == ("db", "u")) is None


def test_pending_buffer_pauses_partitions_holding_rows_near_the_budget() -> None:
    size = 4 + ROW_OVERHEAD_BYTES
    buffer = PendingBuffer(budget_bytes=10 * size)
    for offset in range(9):
        assert buffer.paused() == set()
        buffer.hold(row("t", 1, offset), RecordLocation("x", offset % 2, offset))
    assert buffer.paused() == {("x", 0), ("x", 1)}
    buffer.drop_partition(("x", 0))
    assert buffer.paused() == set()
    assert buffer.rows == 4


def test_watermarks_cover_owned_partitions_only() -> None:
    marks = PartitionWatermarks()
    marks.assign(("a", 0))
    marks.assign(("b", 0))
    assert marks.global_watermark() is None
    marks.advance(("a", 0), 10)
    marks.advance(("b", 0), 7)
    marks.advance(("b", 0), 5)  # a regression is ignored
    assert marks.global_watermark() == 7
    assert marks.ahead() == {("a", 0)}
    marks.revoke(("b", 0))
    assert marks.global_watermark() == 10


def test_partition_offsets_commit_the_lowest_unapplied() -> None:
    offsets = PartitionOffsets()
    assert offsets.committable() is None
    for offset in (3, 4, 6):
        assert offsets.admit(offset)
        offsets.hold(offset)
    assert not offsets.admit(5)  # below the next expected offset: a redelivery
    offsets.apply([4])
    assert offsets.committable() == 3
    offsets.apply([3])
    assert offsets.committable() == 6
    offsets.apply([6])
    assert offsets.committable() == 7
