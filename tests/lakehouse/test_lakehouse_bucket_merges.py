"""A bucketed mirror's MERGE in bucket groups (`sink.mirror_split_rows`, `consumer.sinks.bucket_merges`):
the mirror equals the one a single delta-rs MERGE of the same changes makes (rows, app transactions,
the TSOs each commit claims), in one commit per MERGE, and a commit landing between the groups' writes
and their commit makes the MERGE run again, losing nothing."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from delta_changes import KV as SCHEMA
from deltalake import DeltaTable
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.batches.changes import table_changes
from consumer.errors import RecordLocation
from consumer.lakehouse.maintenance import maintain
from consumer.lakehouse.tables import BUCKET, bucket_of, table_uri
from consumer.protocol.model import DMLType
from consumer.protocol.table import TableCodec
from consumer.sinks import delta
from consumer.sinks.base import CommitContext
from consumer.sinks.bucket_merges import GROUPS_META, merge_bucket_part
from consumer.sinks.delta import DeltaSink, MergeJob, finish_split, prepare_merge_job, run_merge_job
from consumer.testing.messages import raw_dml

TOPIC, GROUP, BUCKETS = "t", "g", 4
KINDS = (DMLType.INSERT, DMLType.UPDATE, DMLType.DELETE)
# a change: key, kind, commit ts (out of order across and within batches), partition
CHANGE = st.tuples(st.integers(0, 40), st.sampled_from(KINDS), st.integers(1, 30), st.integers(0, 1))


class _Writer:
    """Writes batches of changes to a sink, each partition's offsets counted on."""

    def __init__(self, sink: DeltaSink) -> None:
        self.sink = sink
        self.offsets = {0: 0, 1: 0}

    def write(self, batch: list[tuple[int, DMLType, int, int]]) -> None:
        located = []
        for key, kind, ts, partition in batch:
            data = None if kind is DMLType.DELETE else {"id": key, "v": f"v{ts}.{partition}"}
            old = {"id": key, "v": "?"} if kind is not DMLType.INSERT else None
            located.append((raw_dml(SCHEMA, kind, data, old, commit_ts=ts << 18), self._at(partition)))
        self.sink.write(table_changes(TableCodec(SCHEMA), located), CommitContext(GROUP))

    def _at(self, partition: int) -> RecordLocation:
        self.offsets[partition] += 1
        return RecordLocation(TOPIC, partition, self.offsets[partition] - 1)


def _mirror(root: Path) -> DeltaTable:
    uri = table_uri(root, "shop", "kv")
    assert uri is not None
    return DeltaTable(uri)


def _state(root: Path) -> tuple[list[dict[str, Any]], dict[int, int | None], list[dict[str, Any]]]:
    """The mirror's rows, app transactions and what each commit claims (not who made it, nor how)."""
    mirror = _mirror(root)
    rows = sorted(mirror.to_pyarrow_table().to_pylist(), key=lambda row: row["id"])
    offsets = {p: mirror.transaction_version(f"ticdc:{GROUP}:{TOPIC}:{p}") for p in (0, 1)}
    claims = [
        {
            k: v
            for k, v in commit.items()
            if k.startswith("ticdc.") and k not in ("ticdc.process", GROUPS_META)
        }
        for commit in sorted(mirror.history(), key=lambda commit: commit["version"])
    ]
    return rows, offsets, claims


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(st.lists(CHANGE, min_size=1, max_size=30), min_size=1, max_size=5))
def test_a_split_merge_equals_one_delta_rs_merge(
    tmp_path_factory: pytest.TempPathFactory, batches: list[list[tuple[int, DMLType, int, int]]]
) -> None:
    roots = [tmp_path_factory.mktemp("merged"), tmp_path_factory.mktemp("split")]
    writers = [
        _Writer(DeltaSink(root, mirror_buckets=BUCKETS, mirror_split_rows=rows))
        for root, rows in zip(roots, (0, 1), strict=True)
    ]
    for batch in batches:
        for writer in writers:
            writer.write(batch)
    assert _state(roots[0]) == _state(roots[1])
    split = writers[1].sink.operation_metrics()
    # a batch can MERGE nothing: a key's change older than its recorded delete is not revived
    assert split["merges"] == writers[0].sink.operation_metrics()["merges"] <= len(batches)


def test_a_split_merge_is_one_commit_of_several_groups(tmp_path: Path) -> None:
    writer = _Writer(DeltaSink(tmp_path, mirror_buckets=8, mirror_split_rows=100))
    writer.write([(key, DMLType.INSERT, 5, key % 2) for key in range(1000)])
    before = _mirror(tmp_path).version()
    writer.write([(key, DMLType.UPDATE, 6, key % 2) for key in range(0, 1000, 3)])
    writer.write([(key, DMLType.DELETE, 7, 0) for key in range(0, 1000, 5)])
    mirror = _mirror(tmp_path)
    assert mirror.version() == before + 2
    commits = [c for c in mirror.history() if c["version"] > before]
    assert all(int(c[GROUPS_META]) >= 2 and c["operation"] == "WRITE" for c in commits)
    rows = mirror.to_pyarrow_table()
    assert sorted(rows["id"].to_pylist()) == [k for k in range(1000) if k % 5]
    for row in rows.to_pylist():
        assert row["v"] == (f"v6.{row['id'] % 2}" if row["id"] % 3 == 0 else f"v5.{row['id'] % 2}")
    assert rows[BUCKET].combine_chunks().equals(bucket_of(rows["id"], 8))


def test_a_commit_between_the_groups_writes_and_their_commit_reruns_the_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another member commits a newer change of a key the split MERGE also changes, after the groups read
    and wrote and before their commit: the commit conflicts, the MERGE runs again, and both changes land."""
    mine = _Writer(DeltaSink(tmp_path, mirror_buckets=4, mirror_split_rows=10))
    mine.write([(key, DMLType.INSERT, 5, 0) for key in range(100)])
    other = _Writer(DeltaSink(tmp_path, mirror_buckets=4, mirror_split_rows=0))
    other.offsets = {0: 1000, 1: 0}
    real, calls = delta.merge_bucket_part, []

    def part_then_another_commit(part: Any) -> Any:
        outcome = real(part)
        calls.append(part)
        if len(calls) == 1:
            other.write([(7, DMLType.UPDATE, 9, 1)])  # newer than the split's change of key 7
        return outcome

    monkeypatch.setattr(delta, "merge_bucket_part", part_then_another_commit)
    mine.write([(key, DMLType.UPDATE, 6, 0) for key in range(100)])
    assert len(calls) > 2  # the groups ran twice
    rows = {row["id"]: row["v"] for row in _mirror(tmp_path).to_pyarrow_table().to_pylist()}
    assert rows == {key: "v9.1" if key == 7 else "v6.0" for key in range(100)}
    mirror = _mirror(tmp_path)
    assert mirror.transaction_version(f"ticdc:{GROUP}:{TOPIC}:0") == 200
    assert pc.sum(pc.equal(mirror.to_pyarrow_table()["id"], 7)).as_py() == 1
    assert pa.table(mirror.get_add_actions(flatten=True)).num_rows > 0


def test_a_prepared_split_whose_commit_conflicts_is_prepared_again(tmp_path: Path) -> None:
    """The Spark engine's path (`prepare_merge_job`, the groups elsewhere, `finish_split`): a commit that
    changed a touched bucket's file after the preparation makes `finish_split` refuse (the spool files
    go all the same); prepared again, the MERGE commits once, exact, over the other commit's rows."""
    sink = DeltaSink(tmp_path, mirror_buckets=4, mirror_interval_rows=10**12)  # changelog only until run
    codec, context = (
        TableCodec(SCHEMA),
        CommitContext(GROUP, {(TOPIC, 0): 200}, 40 << 18, b"", {(TOPIC, 0): 40 << 18}),
    )
    for ts, first in ((5, 0), (6, 100)):
        located = [
            (
                raw_dml(
                    SCHEMA,
                    DMLType.INSERT if ts == 5 else DMLType.UPDATE,
                    {"id": k, "v": f"v{ts}"},
                    {"id": k, "v": "?"} if ts == 6 else None,
                    commit_ts=ts << 18,
                ),
                RecordLocation(TOPIC, 0, first + k),
            )
            for k in range(100)
        ]
        sink.write(table_changes(codec, located), context)
        sink.record_progress(context)
        entry = next(iter(sink._lagging.values())).entry
        job = MergeJob(sink.root.uri, {}, entry, GROUP, ts << 18, ts << 18, None, None, split_rows=10)
        if ts == 5:
            run_merge_job(dataclasses.replace(job, split_rows=0))  # one delta-rs MERGE: the first rows
    prepared = prepare_merge_job(job)
    assert prepared.split is not None and len(prepared.split.parts) >= 2
    spooled = [part.source for part in prepared.split.parts]
    assert all(isinstance(path, str) and Path(path).exists() for path in spooled)
    outcomes = [merge_bucket_part(part) for part in prepared.split.parts]
    _mirror(tmp_path).update({"v": "'other'"}, predicate="id = 3")  # another writer, between the two
    assert finish_split(job, prepared, outcomes) is None
    assert not any(Path(str(path)).exists() for path in spooled)

    again = prepare_merge_job(job)
    assert again.split is not None
    done = finish_split(job, again, [merge_bucket_part(part) for part in again.split.parts])
    assert done is not None and done.split is None and done.metrics["merges"] == 1
    assert done.metrics["num_target_rows_updated"] == 100
    mirror = _mirror(tmp_path)
    assert done.version is not None and done.version.version == mirror.version()
    assert {row["id"]: row["v"] for row in mirror.to_pyarrow_table().to_pylist()} == {
        k: "v6" for k in range(100)
    }
    assert mirror.transaction_version(f"ticdc:{GROUP}:{TOPIC}:0") == 200
    assert sum(GROUPS_META in c for c in mirror.history()) == 1


def test_maintain_removes_the_group_files_of_a_split_nothing_committed(tmp_path: Path) -> None:
    """A driver killed between preparing a split and committing it leaves its groups' rows beside the
    mirror (`SPLIT_PARTS`, which Delta's VACUUM skips): `maintain` deletes those older than the retention,
    and keeps a live MERGE's fresh ones."""
    sink = DeltaSink(tmp_path, mirror_buckets=4, mirror_interval_rows=10**12)
    context = CommitContext(GROUP, {(TOPIC, 0): 200}, 40 << 18, b"", {(TOPIC, 0): 40 << 18})
    for ts, kind, first in ((5, DMLType.INSERT, 0), (6, DMLType.UPDATE, 100)):
        before = {"id": 0, "v": "a"} if kind == DMLType.UPDATE else None
        located = [
            (
                raw_dml(
                    SCHEMA, kind, {"id": k, "v": f"v{ts}"}, before and {**before, "id": k}, commit_ts=ts << 18
                ),
                RecordLocation(TOPIC, 0, first + k),
            )
            for k in range(100)
        ]
        sink.write(table_changes(TableCodec(SCHEMA), located), context)
        sink.record_progress(context)
        entry = next(iter(sink._lagging.values())).entry
        job = MergeJob(sink.root.uri, {}, entry, GROUP, ts << 18, ts << 18, None, None, split_rows=10)
        if ts == 5:
            run_merge_job(dataclasses.replace(job, split_rows=0))  # the bucketed mirror, its first rows
    abandoned, live = (prepare_merge_job(job).split for _ in range(2))
    assert abandoned is not None and live is not None and len(abandoned.parts) >= 2
    abandoned_files = [Path(str(part.source)) for part in abandoned.parts]
    live_files = [Path(str(part.source)) for part in live.parts]
    assert all(path.exists() for path in abandoned_files + live_files)
    old = time.time() - 8 * 24 * 3600  # past the default retention (a week)
    for path in abandoned_files:
        os.utime(path, (old, old))
    report = maintain(tmp_path)
    assert [done.error for done in report.tables if done.error] == []
    assert not any(path.exists() for path in abandoned_files)
    assert all(path.exists() for path in live_files)
    mirror = next(done for done in report.tables if done.uri.endswith("/mirror"))
    assert mirror.files_vacuumed >= len(abandoned_files)
