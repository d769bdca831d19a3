"""Applying a changelog window to a mirror version (`_applied`, the heart of an as-of read) against a
plain model of the MERGE's rules, for the bases it treats differently: one integer key in key order (placed
by binary search), out of order, text keys and composite keys (joined and sorted); bases in several files
(chunks), changes to some of them only."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.lakehouse.tables import _applied, _latest, _workers

KEYS = {
    "integer": [pa.field("id", pa.int64())],
    "text": [pa.field("code", pa.string())],
    "composite": [pa.field("id", pa.int64()), pa.field("code", pa.string())],
}
KINDS = ["insert", "update_preimage", "update_postimage", "delete"]


def _schema(kind: str) -> pa.Schema:
    meta = [pa.field("_commit_ts", pa.int64(), False), pa.field("_schema_version", pa.int64(), False)]
    return pa.schema([*KEYS[kind], pa.field("v", pa.string()), *meta])


def _key(kind: str, number: int) -> tuple[Any, ...]:
    return {"integer": (number,), "text": (f"k{number:03}",), "composite": (number // 3, f"c{number % 3}")}[
        kind
    ]


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    kind = draw(st.sampled_from(sorted(KEYS)))
    stored = sorted(draw(st.sets(st.integers(0, 30), max_size=20)))
    if draw(st.booleans()):
        stored = draw(st.permutations(stored))
    base = [(n, draw(st.integers(1, 6))) for n in stored]
    hot = draw(st.integers(0, 30))  # changes near one key: some files untouched, or spread over all
    spread = draw(st.integers(1, 35))
    changes = draw(
        st.lists(
            st.tuples(
                st.integers(max(0, hot - spread), hot + spread), st.integers(2, 8), st.sampled_from(KINDS)
            ),
            max_size=40,
        )
    )
    if draw(st.booleans()):  # as a changelog written in order reads back: its sort is skipped
        changes = sorted(changes, key=lambda change: change[1])
    files = draw(st.integers(1, 4))
    floor = draw(st.sampled_from([0, 0, 4, 7]))
    partitions = draw(st.integers(1, 2))
    return {
        "kind": kind,
        "base": base,
        "changes": changes,
        "files": files,
        "floor": floor,
        "partitions": partitions,
    }


def _base_table(kind: str, base: list[tuple[int, int]], files: int) -> pa.Table:
    rows = [
        {**dict(zip(_schema(kind).names, _key(kind, n), strict=False)), "v": f"base{n}", "_commit_ts": ts}
        | {"_schema_version": 1}
        for n, ts in base
    ]
    table = pa.Table.from_pylist(rows, schema=_schema(kind))
    size = -(-len(rows) // files) if rows else 1
    return pa.concat_tables([table.slice(start, size) for start in range(0, max(len(rows), 1), size)])


def _window(kind: str, changes: list[tuple[int, int, str]], partitions: int = 2) -> pa.Table:
    schema = _schema(kind)
    order = [
        pa.field("_change_type", pa.string()),
        pa.field("_partition", pa.int32()),
        pa.field("_offset", pa.int64()),
    ]
    rows = [
        {
            **dict(zip(schema.names, _key(kind, n), strict=False)),
            "v": f"{change}{n}@{offset}",
            "_commit_ts": ts,
            "_schema_version": 1,
            "_change_type": change,
            "_partition": offset % partitions,
            "_offset": offset,
        }
        for offset, (n, ts, change) in enumerate(changes)
    ]
    return pa.Table.from_pylist(rows, schema=pa.schema([*schema, *order]))


def _model(case: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Each key's newest image by (commit ts, partition, offset), a base row losing to a change as new;
    deletes remove; nothing older than the floor; in key order."""
    kind = case["kind"]
    newest: dict[tuple[Any, ...], tuple[tuple[int, int, int, int], str, str]] = {}
    for n, ts in case["base"]:
        newest[_key(kind, n)] = ((ts, 0, -1, -1), "base", f"base{n}")
    for offset, (n, ts, change) in enumerate(case["changes"]):
        rank = (ts, 1, offset % case["partitions"], offset)
        if change != "update_preimage" and (_key(kind, n) not in newest or rank > newest[_key(kind, n)][0]):
            newest[_key(kind, n)] = (rank, change, f"{change}{n}@{offset}")
    return sorted(
        (*key, value, rank[0])
        for key, (rank, change, value) in newest.items()
        if change != "delete" and rank[0] >= case["floor"]
    )


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_a_window_applied_to_a_base_equals_the_merge_rules(case: dict[str, Any]) -> None:
    kind = case["kind"]
    key = [f.name for f in KEYS[kind]]
    base = _base_table(kind, case["base"], case["files"]) if case["base"] or case["files"] > 1 else None
    window = _window(kind, case["changes"], case["partitions"])
    rows = _applied(_schema(kind), base, _latest(window, _schema(kind), key), key, case["floor"])
    got = [(*(row[k] for k in key), row["v"], row["_commit_ts"]) for row in rows.to_pylist()]
    assert got == _model(case)
    assert rows.column_names == _schema(kind).names


def test_a_change_as_new_as_the_base_row_wins_and_an_older_one_loses() -> None:
    for kind in KEYS:
        case = {
            "kind": kind,
            "base": [(1, 5), (2, 6), (3, 5)],
            "changes": [(1, 5, "update_postimage"), (2, 5, "update_postimage"), (3, 5, "delete")],
            "files": 2,
            "floor": 0,
            "partitions": 2,
        }
        key = [f.name for f in KEYS[kind]]
        window = _window(kind, case["changes"])
        rows = _applied(
            _schema(kind), _base_table(kind, case["base"], 2), _latest(window, _schema(kind), key), key, 0
        )
        assert [row["v"] for row in rows.to_pylist()] == ["update_postimage1@0", "base2"], kind
        assert [(*(row[k] for k in key), row["v"], row["_commit_ts"]) for row in rows.to_pylist()] == _model(
            case
        )


def test_a_large_base_merged_in_key_ranges_equals_the_joined_and_sorted_merge() -> None:
    """A base large enough to be cut in key ranges merged on threads: changes at the cuts, in the gaps
    before them, below and above every key, as the same base out of order (joined and sorted) gives."""
    rng = np.random.default_rng(3)
    stored = np.sort(rng.choice(np.arange(0, 1_000_000, 2), 200_000, replace=False))
    ts = rng.integers(2, 6, stored.size)
    base = pa.table(
        {"id": stored, "v": pa.array([f"base{n}" for n in stored.tolist()]), "_commit_ts": ts}
        | {"_schema_version": np.ones(stored.size, dtype=np.int64)},
        schema=_schema("integer"),
    )
    cuts = stored[[stored.size // 4, stored.size // 2, 3 * stored.size // 4]]
    near = np.concatenate([cuts, cuts - 1, cuts + 1, [stored[0], stored[-1], -5, 2_000_001]])
    numbers = np.concatenate([near, rng.integers(-10, 1_000_010, 30_000)])
    kinds = rng.choice(np.array(KINDS), numbers.size)
    changes = [
        (int(n), int(t), str(k))
        for n, t, k in zip(numbers, rng.integers(1, 8, numbers.size), kinds, strict=True)
    ]
    window = _latest(_window("integer", changes), _schema("integer"), ["id"])
    shuffled = base.take(rng.permutation(base.num_rows))
    in_order = _applied(
        _schema("integer"), pa.concat_tables([base.slice(0, 70_000), base.slice(70_000)]), window, ["id"], 3
    )
    assert in_order.equals(_applied(_schema("integer"), shuffled, window, ["id"], 3))
    assert in_order.num_rows > 150_000


def test_a_forked_child_merges_on_threads_of_its_own() -> None:
    """The as-of reads' threads are kept for the process; a child forked after a read (a process pool's
    fork) inherits the pool without its threads, and its work must still run."""
    _workers().submit(int).result()
    child = os.fork()
    if child == 0:  # the child's verdict is its exit code; it never returns into pytest
        code = 1
        try:
            code = 0 if _workers().submit(int, "7").result(timeout=60) == 7 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
