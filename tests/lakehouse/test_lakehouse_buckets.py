"""Bucketed mirrors (`sink.mirror_buckets`): a partition column `_bucket` = hash(first key column) mod N,
and MERGE predicates naming the batch's buckets and key ranges as literals. The mirror stays exactly the
truth (as of every commit ts, with DDLs, every batch or lazily MERGEd), every row sits in its key's bucket,
a MERGE of one bucket's keys leaves the others' files alone, and `maintain` compacts within buckets."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from delta_changes import KV as SCHEMA
from deltalake import DeltaTable
from test_lakehouse_asof import GROUP, TOPIC, _commit_points, _differences, _Driver

from consumer.batches.changes import table_changes
from consumer.errors import RecordLocation
from consumer.lakehouse.maintenance import maintain
from consumer.lakehouse.tables import (
    BUCKET,
    BUCKETS_PROPERTY,
    bucket_of,
    mirror_versions,
    read_mirror,
    table_uri,
    tables,
)
from consumer.protocol.model import DMLType
from consumer.protocol.table import TableCodec
from consumer.simulate.truth import arrow_table_rows, sent, truth_at
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink
from consumer.testing.messages import raw_dml


@pytest.mark.parametrize("interval_rows", [0, 30])
def test_a_bucketed_mirror_equals_the_truth_at_every_commit_ts(tmp_path: Path, interval_rows: int) -> None:
    config = WorkloadConfig(rows=150, tables=3, partitions=2, seed=21, watermark_every_txns=4)
    records = sent(Workload(config))
    sink = DeltaSink(tmp_path, mirror_buckets=4, mirror_interval_rows=interval_rows)
    driver = _Driver(sink, config.partitions, 1)
    driver.feed(records)
    last = driver.last_watermark
    sink.record_progress(CommitContext(GROUP, {(TOPIC, 0): 10**6}, last, b"", {}, stopped=()))  # the stop
    assert [d for tso in _commit_points(records) for d in _differences(tmp_path, records, tso)] == []

    checked = 0
    for entry in tables(tmp_path):
        if not entry.live or not (tmp_path / entry.location / "mirror" / "_delta_log").exists():
            continue
        mirror = DeltaTable(str(tmp_path / entry.location / "mirror"))
        assert mirror.metadata().partition_columns == [BUCKET]
        field = pa.schema(mirror.schema().to_arrow()).field(BUCKET)
        assert field.metadata == {BUCKETS_PROPERTY.encode(): b"4"}
        rows = mirror.to_pyarrow_table()
        assert rows[BUCKET].to_pylist() == bucket_of(rows["id"], 4).to_pylist()  # in its key's bucket
        # MERGEd every batch: a plain reader sees the truth now; lazily (and at the stop), as of the TSO
        # the mirror's last commit records (when it records one: an ALTER's last commit holds changes
        # newer than its complete point)
        exact_at: int | None = max(_commit_points(records))
        if interval_rows:
            last = mirror_versions(mirror)[-1]
            exact_at = (
                last.complete_ts
                if last.newest_ts is not None and last.newest_ts <= last.complete_ts
                else None
            )
        if exact_at is not None:
            expected = truth_at(records, exact_at)[".".join(entry.name)]
            assert arrow_table_rows(rows, expected.schema) == expected.rows
            checked += rows.num_rows > 0
        read = read_mirror(tmp_path, *entry.name)
        assert read is not None and BUCKET not in read.column_names
    assert checked >= 1


def _write(sink: DeltaSink, keys: list[int], kind: DMLType, ts: int, offset: int) -> int:
    located = []
    for i, key in enumerate(keys):
        data = None if kind is DMLType.DELETE else {"id": key, "v": f"v{ts}"}
        old = {"id": key, "v": "?"} if kind is not DMLType.INSERT else None
        dml = raw_dml(SCHEMA, kind, data, old, commit_ts=ts << 18)
        located.append((dml, RecordLocation(TOPIC, 0, offset + i)))
    sink.write(table_changes(TableCodec(SCHEMA), located), CommitContext(GROUP))
    return offset + len(keys)


def test_a_merge_touches_only_the_files_of_its_buckets(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mirror_buckets=8)
    offset = 0
    for ts, start in enumerate(range(0, 4000, 1000), 10):  # four batches: files in every bucket
        offset = _write(sink, list(range(start, start + 1000)), DMLType.INSERT, ts, offset)
    uri = table_uri(tmp_path, "shop", "kv")
    assert uri is not None
    files = pa.table(DeltaTable(uri).get_add_actions(flatten=True))
    assert files.num_rows >= 8 * 4

    keys = list(range(4000))
    in_bucket_3 = [k for k, b in zip(keys, bucket_of(pa.array(keys), 8).to_pylist(), strict=True) if b == 3]
    before = sink.operation_metrics()
    _write(sink, in_bucket_3[:50], DMLType.UPDATE, 20, offset)
    after = sink.operation_metrics()
    scanned = after["num_target_files_scanned"] - before["num_target_files_scanned"]
    removed = after["num_target_files_removed"] - before["num_target_files_removed"]
    bucket_3_files = files.filter(pc.equal(files[f"partition.{BUCKET}"].cast(pa.int64()), 3)).num_rows
    assert 0 < removed <= scanned <= bucket_3_files  # no other bucket's file was read or rewritten
    rows = DeltaTable(uri).to_pyarrow_table()
    assert rows.num_rows == 4000
    updated = rows.filter(pc.is_in(rows["id"], pa.array(in_bucket_3[:50])))
    assert set(updated["v"].to_pylist()) == {"v20"}
    assert rows.filter(pc.equal(rows["v"], "v20")).num_rows == 50


def test_maintain_compacts_within_buckets_and_the_layout_is_the_mirrors_own(tmp_path: Path) -> None:
    sink = DeltaSink(tmp_path, mirror_buckets=4)
    offset = 0
    for ts in range(10, 30):  # 20 small MERGEs: many small files per bucket
        offset = _write(sink, list(range((ts - 10) * 50, (ts - 9) * 50)), DMLType.INSERT, ts, offset)
    uri = table_uri(tmp_path, "shop", "kv")
    assert uri is not None
    assert len(DeltaTable(uri).file_uris()) >= 40
    report = maintain(tmp_path, vacuum=False)
    assert not [t.error for t in report.tables if t.error]
    files = pa.table(DeltaTable(uri).get_add_actions(flatten=True))
    assert sorted(files[f"partition.{BUCKET}"].cast(pa.int64()).to_pylist()) == [0, 1, 2, 3]  # one a bucket
    rows = DeltaTable(uri).to_pyarrow_table()
    assert rows.num_rows == 1000
    assert rows[BUCKET].to_pylist() == bucket_of(rows["id"], 4).to_pylist()

    # a sink configured otherwise keeps writing the mirror with its own bucket count
    other = DeltaSink(tmp_path, mirror_buckets=16)
    _write(other, [1000, 1001, 3], DMLType.INSERT, 40, offset)
    rows = DeltaTable(uri).to_pyarrow_table()
    assert rows.num_rows == 1002 and max(rows[BUCKET].to_pylist()) <= 3
    assert rows[BUCKET].to_pylist() == bucket_of(rows["id"], 4).to_pylist()


def test_bucket_of_is_stable_and_in_range() -> None:
    ints = bucket_of(pa.array([0, 1, 2, -5, 2**62, None], pa.int64()), 7).to_pylist()
    assert ints == bucket_of(pa.array([0, 1, 2, -5, 2**62, None], pa.int64()), 7).to_pylist()
    assert all(0 <= b < 7 for b in ints)
    spread = bucket_of(pa.array(range(10_000), pa.int64()), 16).to_pylist()
    counts = [spread.count(b) for b in range(16)]
    assert min(counts) > 500  # consecutive keys spread evenly (10,000 / 16 = 625)
    texts = bucket_of(pa.array(["a", "b", "é", "a"]), 5).to_pylist()
    assert texts[0] == texts[3] and all(0 <= b < 5 for b in texts)
    assert (
        bucket_of(pa.array([3], pa.int32()), 9).to_pylist()
        == bucket_of(pa.array([3], pa.int64()), 9).to_pylist()
    )
