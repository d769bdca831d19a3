"""`fresh_changes` on Arrow rows: which rows of a batch are copies of changes a table holds."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from consumer.lakehouse.resends import Frontier, Held, fresh_changes

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("v", pa.string()),
        ("_change_type", pa.string()),
        ("_commit_ts", pa.int64()),
        ("_topic", pa.string()),
        ("_partition", pa.int32()),
        ("_offset", pa.int64()),
    ]
)
Row = tuple[int, str | None, str, int, int]  # id, v, change type, commit ts, offset (partition 0 of "t")


def rows(*given: Row) -> pa.Table:
    columns = list(zip(*given, strict=True)) if given else [[] for _ in range(5)]
    ids, values, kinds, stamps, offsets = columns
    data = [ids, values, kinds, stamps, ["t"] * len(ids), [0] * len(ids), offsets]
    return pa.Table.from_arrays(
        [pa.array(c, f.type) for c, f in zip(data, SCHEMA, strict=True)], schema=SCHEMA
    )


def holding(*held: Row) -> Held:
    """A table holding `held` (every commit ts asked for is looked up in it)."""

    def read(tp: tuple[str, int], commit_ts: Sequence[int], columns: Sequence[str]) -> pa.Table:
        table = rows(*held)
        return table.filter(pc.is_in(table["_commit_ts"], pa.array(commit_ts, pa.int64())))

    return read


def offsets(fresh: pa.Table) -> list[int]:
    return fresh["_offset"].to_pylist()


def at(next_offset: int, newest_ts: int) -> dict[tuple[str, int], Frontier]:
    return {("t", 0): Frontier(next_offset, newest_ts)}


def test_a_row_equal_to_an_earlier_row_of_its_batch_is_a_copy() -> None:
    batch = rows((1, "a", "insert", 10, 5), (2, "b", "insert", 10, 6), (1, "a", "insert", 10, 7))
    fresh = fresh_changes(batch, {}, ["id"], holding())
    assert offsets(fresh.rows) == [5, 6] and fresh.resent == {("t", 0): 1}


def test_a_row_the_table_holds_is_a_copy_and_an_older_row_it_lacks_is_not() -> None:
    """Rows of a partitioned table's partitions interleave: an older commit ts alone proves nothing."""
    batch = rows((1, "a", "insert", 8, 20), (3, "c", "insert", 9, 21), (4, "d", "insert", 12, 22))
    fresh = fresh_changes(batch, at(20, 10), ["id"], holding((1, "a", "insert", 8, 3)))
    assert offsets(fresh.rows) == [21, 22] and fresh.resent == {("t", 0): 1}


def test_a_copy_with_another_image_is_conflicting_and_neither_applied_nor_counted() -> None:
    batch = rows((1, "A", "insert", 10, 20), (2, "b", "insert", 11, 21))
    fresh = fresh_changes(batch, at(20, 10), ["id"], holding((1, "a", "insert", 10, 4)))
    assert offsets(fresh.rows) == [21] and fresh.resent == {}
    assert fresh.conflicts["v"].to_pylist() == ["A"]


def test_an_update_is_two_images_of_one_record() -> None:
    held = ((1, "a", "update_preimage", 10, 4), (1, "b", "update_postimage", 10, 4))
    batch = rows((1, "a", "update_preimage", 10, 9), (1, "b", "update_postimage", 10, 9))
    fresh = fresh_changes(batch, at(5, 10), ["id"], holding(*held))
    assert fresh.rows.num_rows == 0 and fresh.resent == {("t", 0): 1}


def test_rows_before_the_next_offset_are_kept_for_the_other_tables_and_rows_of_the_batch_never_held() -> None:
    """Rows read again (before the next offset) are the table's own: kept, other tables of the lake may lack
    them; and a table that already took this very batch (a history written after its changelog) does not
    make its rows copies of themselves."""
    batch = rows((1, "a", "insert", 10, 4), (2, "b", "insert", 10, 5))
    itself = holding((1, "a", "insert", 10, 4), (2, "b", "insert", 10, 5))
    assert offsets(fresh_changes(batch, at(5, 10), ["id"], itself).rows) == [4, 5]


def test_a_commit_ts_of_0_is_never_a_copy() -> None:
    batch = rows((1, None, "delete", 0, 9))
    assert offsets(fresh_changes(batch, at(5, 10), ["id"], holding((1, None, "delete", 0, 4))).rows) == [9]


@pytest.mark.parametrize("held", [False, True])
def test_a_keyless_tables_equal_images_in_one_batch_are_kept_unless_the_table_holds_one(held: bool) -> None:
    batch = rows((1, "a", "insert", 10, 20), (1, "a", "insert", 10, 21))
    lake = holding((1, "a", "insert", 10, 3)) if held else holding()
    fresh = fresh_changes(batch, at(20, 10), [], lake)
    assert offsets(fresh.rows) == ([] if held else [20, 21])


def test_nulls_in_an_identity_are_equal() -> None:
    batch = rows((1, None, "insert", 10, 20), (2, "b", "insert", 11, 21))
    assert offsets(fresh_changes(batch, at(20, 10), [], holding((1, None, "insert", 10, 3))).rows) == [21]
