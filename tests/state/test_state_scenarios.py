"""End-to-end scenarios of the consumer state machine, one per situation TiCDC's own consumer gets wrong."""

from __future__ import annotations

from collections import Counter

import pytest

from consumer.errors import DeadLetter, MalformedMessageError, RecordLocation, SchemaNotFoundError
from consumer.protocol.model import (
    DDL,
    Bootstrap,
    Column,
    DataType,
    DDLType,
    DecodedMessage,
    DMLType,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.state import ConsumerState, DDLUnit, RowBatch, SchemaCache, Unit
from consumer.state.pending import ROW_OVERHEAD_BYTES

TOPIC = "cdc"


def schema(table: str = "orders", version: int = 1, table_id: int = 10, *columns: str) -> TableSchema:
    cols = tuple(Column(name=c, data_type=DataType(mysql_type="int")) for c in ("id", *columns))
    return TableSchema(database="shop", table=table, table_id=table_id, version=version, columns=cols)


def row(
    ts: int,
    table: str = "orders",
    version: int = 1,
    table_id: int = 10,
    kind: DMLType = DMLType.INSERT,
    size: int = 10,
) -> RawDML:
    return RawDML(
        type=kind,
        database="shop",
        table=table,
        table_id=table_id,
        commit_ts=ts,
        build_ts=0,
        schema_version=version,
        payload=b"x" * size,
        encoding="json",
    )


def watermark(ts: int) -> Watermark:
    return Watermark(commit_ts=ts, build_ts=0)


def bootstrap(table_schema: TableSchema) -> Bootstrap:
    return Bootstrap(table_schema=table_schema, build_ts=0)


def ddl(kind: DDLType, ts: int, table_schema: TableSchema | None = None, sql: str = "") -> DDL:
    return DDL(type=kind, sql=sql or f"{kind} at {ts}", commit_ts=ts, build_ts=0, table_schema=table_schema)


class Stream:
    """Feeds records to a state with consecutive offsets per (topic, partition), as Kafka would."""

    def __init__(self, state: ConsumerState, partitions: int = 2, topics: tuple[str, ...] = (TOPIC,)) -> None:
        self.state = state
        self.next: Counter[tuple[str, int]] = Counter()
        state.assign((t, p) for t in topics for p in range(partitions))

    def send(self, partition: int, message: DecodedMessage, topic: str = TOPIC) -> RecordLocation:
        location = RecordLocation(topic, partition, self.next[(topic, partition)])
        self.next[(topic, partition)] += 1
        self.state.process(location, message)
        return location

    def everywhere(self, message: DecodedMessage, partitions: int = 2, topic: str = TOPIC) -> None:
        for p in range(partitions):
            self.send(p, message, topic)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def timestamps(unit: Unit) -> list[int]:
    assert isinstance(unit, RowBatch)
    return [dml.commit_ts for dml, _ in unit.rows]


def confirm_all(state: ConsumerState, units: list[Unit]) -> None:
    for unit in units:
        state.confirm(unit)


def test_from_the_beginning_rows_merge_across_partitions_under_the_watermark() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema()))
    s.send(0, row(10))
    s.send(1, row(11))
    s.send(0, row(12))
    s.send(0, watermark(20))
    assert state.resolve() == []  # partition 1 has not reported a watermark yet

    s.send(1, watermark(20))
    [batch] = state.resolve()
    assert timestamps(batch) == [10, 11, 12]
    assert batch.schema == schema()
    assert [loc.partition for _, loc in batch.rows] == [0, 1, 0]
    assert state.committable() == {(TOPIC, 0): 1, (TOPIC, 1): 1}  # first rows not yet applied

    state.confirm(batch)
    assert state.committable() == {(TOPIC, 0): 4, (TOPIC, 1): 3}
    assert state.committable() == {}  # nothing new


def test_mid_stream_join_holds_rows_until_bootstrap_even_past_the_watermark() -> None:
    state = ConsumerState()
    s = Stream(state)
    for ts in range(10, 15):
        s.send(0, row(ts))
    s.everywhere(watermark(100))
    s.everywhere(watermark(200))
    assert state.resolve() == []
    assert state.stats().held_rows == 5
    assert state.committable() == {(TOPIC, 0): 0, (TOPIC, 1): 2}

    s.send(1, bootstrap(schema()))  # learned on partition 1, serves partition 0
    [batch] = state.resolve()
    assert timestamps(batch) == [10, 11, 12, 13, 14]
    assert (state.stats().held_rows, state.stats().held_total) == (0, 5)
    state.confirm(batch)
    assert state.committable() == {(TOPIC, 0): 7, (TOPIC, 1): 3}


def test_schema_that_never_arrives_is_dead_lettered_after_the_timeout() -> None:
    clock = FakeClock()
    state = ConsumerState(clock=clock)
    s = Stream(state)
    s.send(0, bootstrap(schema(version=2)))
    lost = s.send(0, row(10, version=7))
    s.send(0, row(11, version=2))  # same table, later: must not overtake the held row
    s.send(0, row(12, table="other", version=1, table_id=11))
    s.send(0, bootstrap(schema("other", 1, 11)))
    s.everywhere(watermark(50))
    [other] = state.resolve()
    assert other.schema.table == "other"

    clock.now += 239
    assert state.resolve() == []
    assert state.stats().oldest_held_age == pytest.approx(239)
    clock.now += 1
    dead, batch = state.resolve()
    assert isinstance(dead, DeadLetter)
    assert dead.location == lost
    assert dead.reason == "schema (shop.orders, version 7) never arrived"
    assert dead.value == b"x" * 10
    assert timestamps(batch) == [11]

    confirm_all(state, [other, batch])
    assert state.committable()[(TOPIC, 0)] == lost.offset  # never past the dead letter until confirmed
    state.confirm(dead)
    assert state.committable()[(TOPIC, 0)] == 6


def test_fail_policy_raises_for_a_missing_schema_and_a_bad_record() -> None:
    clock = FakeClock()
    state = ConsumerState(policy="fail", clock=clock)
    s = Stream(state)
    location = s.send(0, row(10, version=7))
    clock.now += 240
    with pytest.raises(SchemaNotFoundError) as missing:
        state.resolve()
    assert missing.value.location == location
    assert "shop.orders, version 7" in str(missing.value)

    bad = RecordLocation(TOPIC, 1, 0)
    with pytest.raises(MalformedMessageError) as malformed:
        state.process_failed(bad, MalformedMessageError("not JSON"), b"{")
    assert malformed.value.location == bad


def test_undecodable_record_becomes_a_dead_letter() -> None:
    state = ConsumerState()
    bad = RecordLocation(TOPIC, 0, 0)
    state.assign([(TOPIC, 0)])
    state.process_failed(bad, MalformedMessageError("not JSON"), b"{")
    [dead] = state.resolve()
    assert isinstance(dead, DeadLetter)
    assert (dead.location, dead.reason, dead.value) == (bad, "MalformedMessageError: not JSON", b"{")
    assert state.committable() == {(TOPIC, 0): 0}
    state.confirm(dead)
    assert state.committable() == {(TOPIC, 0): 1}


def test_alter_add_column_is_a_barrier_and_later_rows_use_the_new_schema() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema(version=1)))
    s.send(0, row(10, version=1))
    s.send(1, row(11, version=1))
    alter = ddl(DDLType.ALTER, 15, schema("orders", 2, 10, "note"), "ALTER TABLE orders ADD COLUMN note int")
    s.everywhere(alter)
    s.send(0, row(16, version=2))
    s.everywhere(watermark(15))
    before, unit = state.resolve()
    assert timestamps(before) == [10, 11]
    assert before.schema.version == 1
    assert isinstance(unit, DDLUnit)
    assert unit.ddl == alter
    assert [loc.partition for loc in unit.locations] == [0, 1]

    s.everywhere(watermark(20))
    [after] = state.resolve()
    assert timestamps(after) == [16]
    assert after.schema.column("note") is not None


def test_rename_later_rows_found_under_the_new_name() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema("orders", 5)))
    s.send(0, row(10, "orders", 5))
    rename = ddl(DDLType.RENAME, 12, schema("orders_v2", 5), "RENAME TABLE orders TO orders_v2")
    s.everywhere(rename)
    s.send(1, row(13, "orders_v2", 5))  # the new name may hash to another partition
    s.everywhere(watermark(20))
    old, unit, new = state.resolve()
    assert old.schema.table == "orders"
    assert isinstance(unit, DDLUnit)
    assert unit.ddl.type is DDLType.RENAME
    assert new.schema.table == "orders_v2"
    assert state.stats().held_rows == 0


def test_rows_under_a_name_never_announced_fall_back_to_table_id_and_version() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1)
    s.send(0, bootstrap(schema("orders", 5)))
    s.send(0, row(13, "renamed", 5))  # the RENAME itself was before this consumer's start
    s.send(0, watermark(20))
    [batch] = state.resolve()
    assert (batch.schema.table, batch.schema.version, batch.schema.table_id) == ("renamed", 5, 10)
    assert ("shop", "renamed", 5) in state.schemas


def test_truncate_new_table_id_and_version() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema("orders", 1, 10)))
    s.send(0, row(10, version=1, table_id=10))
    truncate = ddl(DDLType.TRUNCATE, 12, schema("orders", 2, 11), "TRUNCATE TABLE orders")
    s.everywhere(truncate)
    s.send(0, row(13, version=2, table_id=11))
    s.everywhere(watermark(20))
    before, unit, after = state.resolve()
    assert (before.schema.table_id, unit.ddl.type, after.schema.table_id) == (10, DDLType.TRUNCATE, 11)


def test_create_and_drop_database_are_surfaced_and_order_every_table() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema()))
    s.send(0, row(10))
    s.everywhere(ddl(DDLType.QUERY, 11, sql="CREATE DATABASE crm"))
    s.send(1, row(12))
    s.everywhere(ddl(DDLType.QUERY, 13, sql="DROP DATABASE crm"))
    s.everywhere(watermark(20))
    units = state.resolve()
    kinds = [u.ddl.sql if isinstance(u, DDLUnit) else timestamps(u) for u in units]
    assert kinds == [[10], "CREATE DATABASE crm", [12], "DROP DATABASE crm"]


def test_every_ddl_type_is_surfaced_in_commit_order() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1)
    kinds = list(DDLType)
    for ts, kind in enumerate(reversed(kinds), start=1):  # arrival order differs from commit order
        s.send(0, ddl(kind, 100 - ts, schema(version=ts) if kind is not DDLType.QUERY else None))
    s.send(0, watermark(100))
    units = state.resolve()
    assert [u.ddl.type for u in units] == kinds
    assert [u.ddl.commit_ts for u in units] == sorted(u.ddl.commit_ts for u in units)


def test_two_topics_with_the_same_partition_numbers_stay_apart() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1, topics=("a", "b"))
    s.send(0, bootstrap(schema("orders")), topic="a")
    s.send(0, bootstrap(schema("users", 1, 20)), topic="b")
    s.send(0, row(10, "orders"), topic="a")
    s.send(0, row(50, "users", table_id=20), topic="b")
    s.send(0, watermark(100), topic="a")
    s.send(0, watermark(20), topic="b")
    [orders] = state.resolve()
    assert orders.schema.table == "orders"
    assert state.stats().global_watermark == 20
    s.send(0, watermark(60), topic="b")
    [users] = state.resolve()
    assert users.rows[0][1] == RecordLocation("b", 0, 1)
    confirm_all(state, [orders, users])
    assert state.committable() == {("a", 0): 3, ("b", 0): 4}


def test_bootstrap_only_on_partition_zero_serves_every_partition() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=3)
    s.send(2, row(10))
    s.send(1, row(11))
    s.send(0, bootstrap(schema()))  # send-bootstrap-to-all-partition = false
    s.everywhere(watermark(20), partitions=3)
    [batch] = state.resolve()
    assert timestamps(batch) == [10, 11]


def test_primary_key_update_keeps_delete_before_insert() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema()))
    s.send(1, row(10, kind=DMLType.DELETE))
    s.send(1, row(10, kind=DMLType.INSERT))
    s.send(0, row(10, kind=DMLType.UPDATE))
    s.everywhere(watermark(10))
    [batch] = state.resolve()
    assert [(dml.type, loc.partition) for dml, loc in batch.rows] == [
        (DMLType.UPDATE, 0),
        (DMLType.DELETE, 1),
        (DMLType.INSERT, 1),
    ]


def test_redelivered_records_are_never_emitted_twice() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1)
    s.send(0, bootstrap(schema()))
    first = s.send(0, row(10))
    state.process(first, row(10))  # the same offset again
    s.send(0, watermark(20))
    [batch] = state.resolve()
    assert len(batch.rows) == 1
    state.confirm(batch)
    state.process(first, row(10))  # a rewind after it was applied
    state.process(RecordLocation(TOPIC, 0, 2), watermark(20))
    assert state.resolve() == []


def test_ddl_copies_hold_their_offsets_until_the_ddl_is_confirmed() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=3)
    s.everywhere(ddl(DDLType.CREATE, 5, schema()), partitions=3)
    s.everywhere(watermark(5), partitions=3)
    [unit] = state.resolve()
    assert isinstance(unit, DDLUnit)
    assert len(unit.locations) == 3
    assert state.committable() == {(TOPIC, p): 0 for p in range(3)}
    state.confirm(unit)
    assert state.committable() == {(TOPIC, p): 2 for p in range(3)}


def test_held_rows_block_later_rows_of_their_table_only() -> None:
    clock = FakeClock()
    state = ConsumerState(clock=clock)
    s = Stream(state, partitions=1)
    s.send(0, bootstrap(schema("orders", 2)))
    s.send(0, bootstrap(schema("other", 1, 11)))
    s.send(0, row(10, "orders", 1))  # version 1 unknown
    s.send(0, row(11, "orders", 2))
    s.send(0, row(12, "other", 1, 11))
    s.send(0, watermark(20))
    [other] = state.resolve()
    assert other.schema.table == "other"
    assert state.stats().waiting_rows == 1

    s.send(0, bootstrap(schema("orders", 1)))
    first, second = state.resolve()
    assert (timestamps(first), timestamps(second)) == ([10], [11])


def test_ddl_waits_for_held_rows_of_its_table() -> None:
    clock = FakeClock()
    state = ConsumerState(clock=clock)
    s = Stream(state, partitions=1)
    s.send(0, row(10, "orders", 1))  # joined mid-stream: version 1 is never announced again
    s.send(0, ddl(DDLType.ALTER, 12, schema("orders", 2)))
    s.send(0, row(13, "orders", 2))
    s.send(0, ddl(DDLType.CREATE, 14, schema("other", 1, 11)))
    s.send(0, watermark(20))
    assert state.resolve() == []  # DDLs go out in order: the CREATE waits behind the ALTER

    clock.now += 240
    dead, alter, after, create = state.resolve()
    assert isinstance(dead, DeadLetter)
    assert (alter.ddl.type, timestamps(after), create.ddl.type) == (DDLType.ALTER, [13], DDLType.CREATE)


def test_committable_never_passes_an_unconfirmed_unit() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1)
    s.send(0, bootstrap(schema("a", 1, 1)))
    s.send(0, bootstrap(schema("b", 1, 2)))
    s.send(0, row(10, "a", table_id=1))
    s.send(0, row(11, "b", table_id=2))
    s.send(0, watermark(20))
    a, b = state.resolve()
    state.confirm(b)
    assert state.committable() == {(TOPIC, 0): 2}
    state.confirm(a)
    assert state.committable() == {(TOPIC, 0): 5}


def test_revoke_forgets_the_partition_and_assign_starts_fresh() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema()))
    s.send(0, row(10))
    s.send(1, row(11))
    s.send(1, row(12, version=9))
    s.send(0, watermark(5))
    state.revoke([(TOPIC, 1)])
    assert (state.stats().waiting_rows, state.stats().held_rows) == (1, 0)
    assert state.stats().global_watermark == 5
    s.send(0, watermark(20))
    [batch] = state.resolve()
    assert timestamps(batch) == [10]

    state.assign([(TOPIC, 1)])  # redelivered from the committed offset
    assert state.stats().global_watermark is None
    state.process(RecordLocation(TOPIC, 1, 1), row(11))
    state.process(RecordLocation(TOPIC, 1, 3), watermark(20))
    [again] = state.resolve()
    assert [loc for _, loc in again.rows] == [RecordLocation(TOPIC, 1, 1)]


def test_confirm_after_revoke_does_not_touch_a_later_assignment() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1)
    s.send(0, bootstrap(schema()))
    s.send(0, row(10))
    s.send(0, watermark(20))
    [batch] = state.resolve()
    state.revoke([(TOPIC, 0)])
    state.assign([(TOPIC, 0)])
    state.process(RecordLocation(TOPIC, 0, 1), row(10))
    state.confirm(batch)
    assert state.committable() == {(TOPIC, 0): 1}


def test_backpressure_pauses_partitions_holding_rows_and_resumes_on_release() -> None:
    budget = 10 * (100 + ROW_OVERHEAD_BYTES)
    state = ConsumerState(budget_bytes=budget)
    s = Stream(state, partitions=3)
    for ts in range(8):
        s.send(ts % 2, row(ts, size=100))
    assert state.paused() == set()
    s.send(0, row(8, size=100))  # 9 rows = 90% of the budget
    assert state.paused() == {(TOPIC, 0), (TOPIC, 1)}
    assert state.stats().held_bytes == 9 * (100 + ROW_OVERHEAD_BYTES)

    s.send(2, bootstrap(schema()))  # partition 2 holds nothing, so it still flows
    assert state.paused() == set()
    assert state.stats().waiting_rows == 9


def test_backpressure_pauses_partitions_ahead_of_the_watermark() -> None:
    budget = 10 * (100 + ROW_OVERHEAD_BYTES)
    state = ConsumerState(budget_bytes=budget)
    s = Stream(state, partitions=2)
    s.everywhere(bootstrap(schema()))
    s.send(1, watermark(5))
    for ts in range(10, 20):
        s.send(0, row(ts, size=100))
    s.send(0, watermark(30))
    assert state.paused() == {(TOPIC, 0)}  # partition 1 is what holds the watermark back
    s.send(1, watermark(30))
    assert len(state.resolve()) == 1
    assert state.paused() == set()


def test_schema_cache_snapshot_lets_a_restarted_consumer_skip_the_bootstrap_wait() -> None:
    state = ConsumerState()
    s = Stream(state, partitions=1)
    s.send(0, bootstrap(schema("orders", 1)))
    s.send(0, ddl(DDLType.ALTER, 5, schema("orders", 2, 10, "note")))
    snapshot = state.schemas.snapshot()

    restarted = ConsumerState(schemas=SchemaCache.restore(snapshot))
    r = Stream(restarted, partitions=1)
    r.send(0, row(10, version=2))
    r.send(0, watermark(20))
    [batch] = restarted.resolve()
    assert batch.schema == schema("orders", 2, 10, "note")


def test_records_of_unassigned_partitions_are_rejected() -> None:
    state = ConsumerState()
    with pytest.raises(ValueError, match="not assigned"):
        state.process(RecordLocation(TOPIC, 0, 0), watermark(1))


def test_ddl_waits_for_rows_whose_schema_comes_from_a_partition_assigned_later() -> None:
    state = ConsumerState()
    state.assign([(TOPIC, 1)])  # partition 0, where the BOOTSTRAPs go, belongs to someone else for now
    state.process(RecordLocation(TOPIC, 1, 0), row(10))
    state.process(RecordLocation(TOPIC, 1, 1), ddl(DDLType.QUERY, 11, sql="CREATE DATABASE crm"))
    state.process(RecordLocation(TOPIC, 1, 2), watermark(20))
    assert state.resolve() == []  # a schema-less DDL orders every table, held rows included

    state.assign([(TOPIC, 0)])
    state.process(RecordLocation(TOPIC, 0, 0), bootstrap(schema()))
    state.process(RecordLocation(TOPIC, 0, 1), ddl(DDLType.QUERY, 11, sql="CREATE DATABASE crm"))
    state.process(RecordLocation(TOPIC, 0, 2), watermark(20))
    batch, unit = state.resolve()
    assert timestamps(batch) == [10]
    assert isinstance(unit, DDLUnit)
    assert len(unit.locations) == 2


def test_partitioned_table_rows_carry_physical_ids_and_resolve_by_name() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(bootstrap(schema("sales", 3, 300)))  # the schema has the logical table id
    s.send(0, row(10, "sales", 3, table_id=301))
    s.send(1, row(11, "sales", 3, table_id=302))
    s.everywhere(ddl(DDLType.ALTER, 12, schema("sales", 4, 300), "ALTER TABLE sales ADD PARTITION"))
    s.send(0, row(13, "sales", 4, table_id=301))
    s.everywhere(watermark(20))
    before, unit, after = state.resolve()
    assert timestamps(before) == [10, 11]
    assert [dml.table_id for dml, _ in before.rows] == [301, 302]
    assert isinstance(unit, DDLUnit)
    assert (timestamps(after), after.schema.version) == ([13], 4)


def test_ddl_copy_redelivered_after_a_rebalance_is_not_emitted_again() -> None:
    state = ConsumerState()
    s = Stream(state)
    s.everywhere(ddl(DDLType.CREATE, 5, schema()))
    s.everywhere(watermark(5))
    [unit] = state.resolve()
    state.revoke([(TOPIC, 1)])
    state.assign([(TOPIC, 1)])
    state.process(RecordLocation(TOPIC, 1, 0), ddl(DDLType.CREATE, 5, schema()))  # in flight: joins it
    state.process(RecordLocation(TOPIC, 1, 1), watermark(5))
    assert state.resolve() == []
    assert state.committable() == {(TOPIC, 0): 0, (TOPIC, 1): 0}
    state.confirm(unit)
    assert state.committable() == {(TOPIC, 0): 2, (TOPIC, 1): 2}

    state.revoke([(TOPIC, 1)])
    state.assign([(TOPIC, 1)])
    state.process(RecordLocation(TOPIC, 1, 0), ddl(DDLType.CREATE, 5, schema()))  # confirmed: applied
    assert state.resolve() == []
    assert state.committable() == {(TOPIC, 1): 1}
