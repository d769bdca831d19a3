"""Lazy mirrors (`sink.mirror_interval_s` / `mirror_interval_rows`): the changelog is written every batch,
the mirror MERGEd on its own cadence with each key's net change since its last MERGE. As-of reads equal a
replay of the stream at every commit ts whatever the cadence (DDLs included); a plain Delta reader of the
mirror sees exactly the truth at the TSO its last commit records; a restart MERGEs what a run before it
left in the changelog, from the lake's records alone, exactly once."""

from __future__ import annotations

import dataclasses
import pickle
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pytest
from delta_changes import KV as SCHEMA
from deltalake import DeltaTable
from test_lakehouse_asof import GROUP, TOPIC, _commit_points, _differences, _Driver

from consumer import app
from consumer.batches.changes import table_changes
from consumer.config import ConfigError, load_config
from consumer.errors import RecordLocation
from consumer.lakehouse.offsets import app_id
from consumer.lakehouse.tables import mirror_versions, read_changelog, read_mirror, retained_range, table_uri
from consumer.protocol.model import DMLType
from consumer.protocol.table import TableCodec
from consumer.simulate.truth import arrow_table_rows, differences, load_truth, sent, truth_at
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig
from consumer.sinks import delta
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink, MergeJob, MergeResult, _prefix_up_to, run_merge_job
from consumer.testing.messages import raw_dml

NEVER = 10**12  # a row threshold no test reaches: MERGEs only when the run stops or restarts


def _feed(sink: DeltaSink, records: list[StreamRecord], partitions: int, progress_every: int = 1) -> None:
    _Driver(sink, partitions, progress_every).feed(records)


def _plain_mirror_exact(root: Path, records: list[StreamRecord], database: str, table: str) -> int:
    """The mirror as any Delta reader sees it equals the truth at the TSO its last commit records (its
    newest change, which its complete point covers); returns that TSO."""
    uri = table_uri(root, database, table)
    assert uri is not None
    mirror = DeltaTable(uri)
    last = mirror_versions(mirror)[-1]
    assert last.newest_ts is not None and last.complete_ts >= last.newest_ts
    expected = truth_at(records, last.newest_ts)[f"{database}.{table}"]
    rows = pa.table(mirror.to_pyarrow_table())
    assert arrow_table_rows(rows, expected.schema) == expected.rows
    return last.newest_ts


@pytest.mark.parametrize("interval_rows", [1, 25, 200, NEVER])
def test_as_of_every_commit_ts_equals_a_replay_with_lazy_mirrors(tmp_path: Path, interval_rows: int) -> None:
    """Every DML kind, key changes, ALTER ADD/DROP COLUMN, TRUNCATE, RENAME, DROP and CREATE again; the
    mirror MERGEd every batch, every 25 or 200 changelog rows, or never during the run."""
    config = WorkloadConfig(rows=150, tables=3, partitions=2, seed=11, watermark_every_txns=4)
    records = sent(Workload(config))
    _feed(DeltaSink(tmp_path, mirror_interval_rows=interval_rows), records, config.partitions)
    points = _commit_points(records)
    assert [d for tso in points for d in _differences(tmp_path, records, tso)] == []
    mirrors = [p for p in tmp_path.glob("shop/*/mirror") if (p / "_delta_log").exists()]
    assert len(mirrors) == 4  # t0, t1, t2 and t2 created again after its DROP
    merges = sum(c["operation"] == "MERGE" for p in mirrors for c in DeltaTable(str(p)).history())
    if interval_rows == 1:
        assert merges >= 30  # about every batch
    elif interval_rows == 25:
        assert 3 <= merges <= 12
    else:
        assert merges <= 3  # before the ALTERs only (a DDL is a barrier): the rest read from the changelog


def test_merges_run_elsewhere_from_the_job_alone_and_twice_commit_once(tmp_path: Path) -> None:
    """A merge runner (the Spark engine's executors) gets a small picklable job per due table, never rows;
    each runs in a merger made from the job alone, as in another process, and again (a task Spark ran
    twice): the second commits nothing. Without a cadence the mirrors are MERGEd at every progress record,
    and as-of reads equal a replay at every commit ts (every DDL kind: ALTERs are barriers)."""
    config = WorkloadConfig(rows=150, tables=3, partitions=2, seed=11, watermark_every_txns=4)
    records = sent(Workload(config))
    ran: list[MergeJob] = []

    def elsewhere(jobs: Sequence[MergeJob]) -> list[MergeResult]:
        results = []
        for job in jobs:
            sent_over = pickle.dumps(job)
            assert len(sent_over) < 4096  # a location and TSOs, no rows
            delta._MERGERS.clear()  # nothing of the sink's process: a merger made from the job
            results.append(run_merge_job(pickle.loads(sent_over)))
            uri = f"{tmp_path}/{job.entry.location}/mirror"
            version = DeltaTable(uri).version()
            again = run_merge_job(pickle.loads(sent_over))
            assert DeltaTable(uri).version() == version  # its rows are applied: no second commit
            assert (again.gone, again.merged_ts) == (results[-1].gone, results[-1].merged_ts)
            ran.append(job)
        return results

    sink = DeltaSink(tmp_path)
    sink.run_merges_with(elsewhere)
    assert sink.lazy_mirrors
    _feed(sink, records, config.partitions)
    assert ran
    points = _commit_points(records)
    assert [d for tso in points for d in _differences(tmp_path, records, tso)] == []
    mirrors = [p for p in tmp_path.glob("shop/*/mirror") if (p / "_delta_log").exists()]
    merges = [c for p in mirrors for c in DeltaTable(str(p)).history() if c["operation"] == "MERGE"]
    assert len(merges) >= 30  # about every batch
    assert {c["ticdc.process"] for c in merges} == {delta.process_name()}
    assert sink.operation_metrics()["merges"] >= len(
        merges
    )  # the results' metrics (a MERGE may commit nothing)
    with pytest.raises(ValueError, match="must keep the changelog"):
        DeltaSink(tmp_path / "other", mode="mirror").run_merges_with(elsewhere)


def test_a_plain_reader_sees_the_truth_at_the_recorded_tso(tmp_path: Path) -> None:
    config = WorkloadConfig(rows=200, tables=2, partitions=2, ddl=False, seed=5, watermark_every_txns=4)
    records = sent(Workload(config))
    sink = DeltaSink(tmp_path, mirror_interval_rows=60)
    _feed(sink, records, config.partitions)
    for table in ("t0", "t1"):
        exact_at = _plain_mirror_exact(tmp_path, records, "shop", table)
        assert exact_at < max(_commit_points(records))  # the mirror lags ...
        _, point = retained_range(tmp_path)
        assert point is not None
        fresh = read_mirror(tmp_path, "shop", table)  # ... a fresh read does not
        expected = truth_at(records, point)[f"shop.{table}"]
        assert fresh is not None and arrow_table_rows(fresh, expected.schema) == expected.rows


def test_the_time_interval_and_a_stop_merge_the_mirror(tmp_path: Path) -> None:
    config = WorkloadConfig(rows=120, tables=1, partitions=2, ddl=False, seed=3, watermark_every_txns=4)
    records = sent(Workload(config))
    sink = DeltaSink(tmp_path, mirror_interval_s=3600)
    driver = _Driver(sink, config.partitions, 1)
    driver.feed(records)
    uri = table_uri(tmp_path, "shop", "t0")
    assert uri is not None
    assert [c for c in DeltaTable(uri).history() if c["operation"] == "MERGE"] == []  # an hour not passed
    for lagging in sink._lagging.values():
        lagging.merged_at -= 3600  # an hour later
    driver._record(driver.last_watermark)
    assert len([c for c in DeltaTable(uri).history() if c["operation"] == "MERGE"]) == 1
    _plain_mirror_exact(tmp_path, records, "shop", "t0")

    sink = DeltaSink(tmp_path / "other", mirror_interval_s=3600)
    _Driver(sink, config.partitions, 1).feed(records)
    offsets = {(TOPIC, p): 10**6 for p in range(config.partitions)}
    sink.record_progress(CommitContext(GROUP, offsets, driver.last_watermark, b"", {}, stopped=()))
    assert _plain_mirror_exact(tmp_path / "other", records, "shop", "t0") == max(_commit_points(records))


def test_a_restart_merges_what_the_run_before_it_changelogged_exactly_once(tmp_path: Path) -> None:
    config = WorkloadConfig(rows=240, tables=2, partitions=3, seed=8, watermark_every_txns=4)
    records = sent(Workload(config))
    half = len(records) // 2
    driver = _Driver(DeltaSink(tmp_path, mirror_interval_rows=NEVER), config.partitions, 1)
    driver.feed(records[:half])  # then the process dies: nothing MERGEd, no stop record
    lagging = [e for e in _mirror_uris(tmp_path) if _merged_offsets(e) != _changelog_offsets(e)]
    assert lagging  # the changelog holds rows the mirror lacks

    restarted = DeltaSink(tmp_path, mirror_interval_rows=NEVER)  # nothing in memory of the run before
    restarted.record_progress(CommitContext(GROUP, {}, driver.last_watermark, b"", {}))
    for uri in _mirror_uris(tmp_path):
        assert _merged_offsets(uri) == _changelog_offsets(uri)
    half_truth = records[:half]
    for name in ("t0", "t1"):
        if table_uri(tmp_path, "shop", name) is not None:
            _plain_mirror_exact(tmp_path, half_truth, "shop", name)

    driver.sink = restarted  # the rest of the stream, with a replay of its last batches
    driver.offsets = dict.fromkeys(driver.offsets, 0)
    driver.ddls = set()
    driver.feed(records)
    points = _commit_points(records)
    assert [d for tso in points[::3] for d in _differences(tmp_path, records, tso)] == []
    changelog = read_changelog(tmp_path, "shop", "t1")
    assert changelog is not None
    images = ("_topic", "_partition", "_offset", "_change_type")  # an UPDATE's two images share an offset
    keys = list(zip(*(changelog[c].to_pylist() for c in images), strict=True))
    assert len(keys) == len(set(keys))  # the replay added nothing twice


def test_the_loop_engine_takes_over_a_lake_whose_last_merges_never_ran(tmp_path: Path) -> None:
    """The Spark engine MERGEs mirrors from the changelog after it records progress; a driver killed in
    between leaves rows in the changelogs only, past the progress a restart resumes from. The loop engine
    taking over (no cadence: it MERGEs its own batches) MERGEs those first, so nothing is missing."""
    config = WorkloadConfig(rows=200, tables=2, partitions=2, ddl=False, seed=21, watermark_every_txns=4)
    records = sent(Workload(config))
    runs = 0

    def killed_later(jobs: Sequence[MergeJob]) -> list[MergeResult]:
        nonlocal runs
        runs += 1
        if runs > 3:
            raise RuntimeError("driver killed")
        return [run_merge_job(job) for job in jobs]

    spark_like = DeltaSink(tmp_path)
    spark_like.run_merges_with(killed_later)
    driver = _Driver(spark_like, config.partitions, 1)
    with pytest.raises(RuntimeError, match="driver killed"):
        driver.feed(records)
    assert any(_merged_offsets(uri) != _changelog_offsets(uri) for uri in _mirror_uris(tmp_path))

    driver.sink = DeltaSink(tmp_path)  # the loop engine, from the progress recorded
    driver.feed(records[sum(driver.offsets.values()) :])
    for uri in _mirror_uris(tmp_path):
        assert _merged_offsets(uri) == _changelog_offsets(uri)
    final = truth_at(records, max(_commit_points(records)))
    for name in ("t0", "t1"):
        uri = table_uri(tmp_path, "shop", name)
        assert uri is not None
        expected = final[f"shop.{name}"]
        assert arrow_table_rows(DeltaTable(uri).to_pyarrow_table(), expected.schema) == expected.rows
    assert [d for tso in _commit_points(records)[::3] for d in _differences(tmp_path, records, tso)] == []


def _mirror_uris(root: Path) -> list[str]:
    return [str(p) for p in sorted(root.glob("shop/*/mirror")) if (p / "_delta_log").exists()]


def _changelog_offsets(mirror_uri: str) -> dict[int, int | None]:
    return _txns(DeltaTable(mirror_uri.removesuffix("mirror") + "changelog"))


def _merged_offsets(mirror_uri: str) -> dict[int, int | None]:
    return _txns(DeltaTable(mirror_uri))


def _txns(table: DeltaTable) -> dict[int, int | None]:
    return {p: table.transaction_version(app_id(GROUP, TOPIC, p)) for p in range(3)}


# -- net change per key ---------------------------------------------------------------------------------


def _write(sink: DeltaSink, changes: list[tuple[DMLType, int, str | None, int]], first_offset: int) -> None:
    located = []
    for i, (kind, key, value, ts) in enumerate(changes):
        data = None if kind is DMLType.DELETE else {"id": key, "v": value}
        old = {"id": key, "v": "?"} if kind is not DMLType.INSERT else None
        dml = raw_dml(SCHEMA, kind, data, old, commit_ts=ts << 18)
        located.append((dml, RecordLocation(TOPIC, 0, first_offset + i)))
    sink.write(table_changes(TableCodec(SCHEMA), located), CommitContext(GROUP))


def test_one_merge_applies_each_keys_net_change(tmp_path: Path) -> None:
    """Across batches between MERGEs: updated twice -> the last image; inserted then deleted -> absent;
    deleted then inserted again -> present; a delete at the same commit ts as an update (later offset)
    wins; a key untouched keeps its row."""
    sink = DeltaSink(tmp_path, mirror_interval_rows=100)
    ins, upd, rm = DMLType.INSERT, DMLType.UPDATE, DMLType.DELETE
    _write(sink, [(ins, 1, "a", 10), (ins, 2, "b", 10), (ins, 3, "c", 10), (ins, 4, "d", 10)], 0)
    _write(sink, [(upd, 1, "a2", 11), (ins, 5, "e", 11), (rm, 2, None, 12)], 4)
    _write(
        sink,
        [(upd, 1, "a3", 13), (rm, 5, None, 14), (ins, 2, "b2", 15), (upd, 3, "c2", 16), (rm, 3, None, 16)],
        7,
    )
    progress = CommitContext(GROUP, {(TOPIC, 0): 12}, 20 << 18, b"", {(TOPIC, 0): 20 << 18})
    sink.record_progress(progress)
    uri = table_uri(tmp_path, "shop", "kv")
    assert uri is not None
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 0  # 15 changelog rows, fewer than 100: no MERGE
    sink.record_progress(dataclasses.replace(progress, stopped=()))  # the run stops: MERGE
    rows = DeltaTable(uri).to_pyarrow_table().sort_by("id")
    assert rows.select(["id", "v"]).to_pylist() == [
        {"id": 1, "v": "a3"},
        {"id": 2, "v": "b2"},
        {"id": 4, "v": "d"},
    ]
    merges = [c for c in DeltaTable(uri).history() if c["operation"] == "MERGE"]
    assert len(merges) == 1
    assert merges[0]["operationMetrics"]["num_source_rows"] == 5  # one row per key touched


# -- settings that cannot work ------------------------------------------------------------------------
def test_lazy_mirrors_need_the_changelog(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must keep the changelog"):
        DeltaSink(tmp_path, mode="mirror", mirror_interval_rows=10)
    with pytest.raises(ValueError, match=">= 0"):
        DeltaSink(tmp_path, mirror_interval_s=-1)
    with pytest.raises(ValueError, match=">= 0"):
        DeltaSink(tmp_path, mirror_buckets=-2)
    overrides = {"source": {"url": "kafka://h:9/t"}, "sink": {"url": f"delta:{tmp_path}", "mode": "mirror"}}
    overrides["sink"]["mirror_interval_s"] = 5  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="must keep the changelog"):
        load_config(environ={}, overrides=overrides)
    overrides["sink"] = {"url": f"delta:{tmp_path}", "mirror_interval_rows": -3}
    with pytest.raises(ConfigError, match=">= 0"):
        load_config(environ={}, overrides=overrides)
    assert DeltaSink(tmp_path, mode="changelog", mirror_interval_rows=10).lazy_mirrors is False


# -- the loop engine end to end ---------------------------------------------------------------------------
def test_run_with_lazy_bucketed_mirrors_leaves_them_exact_when_it_stops(tmp_path: Path) -> None:
    """`run` over a capture with `[sink] mirror_interval_rows` and `mirror_buckets`: the changelog is
    committed batch by batch, the mirrors are MERGEd when the run stops, and a plain Delta reader then sees
    the ground truth."""
    capture, truth_path = tmp_path / "capture.jsonl", tmp_path / "truth.json"
    command = [
        sys.executable, "-m", "consumer", "simulate", "--topic", "shop", "--out", str(capture), "--truth",
        str(truth_path), "--rows", "1500", "--tables", "2", "--no-ddl",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    config = tmp_path / "run.toml"
    settings = (
        "[sink]\nmirror_interval_rows = 1000000\nmirror_buckets = 4\n[budget]\nmax_batch_records = 200\n"
    )
    config.write_text(settings)
    root = tmp_path / "lake"
    overrides = {"source": {"url": f"file:{capture}"}, "sink": {"url": f"delta:{root}"}}
    app.run(load_config(config, overrides=overrides, environ={}), until_idle=0.5)

    workload = Workload(WorkloadConfig(rows=1500, tables=2, ddl=False))
    for _ in workload.records():
        pass
    plain = {}
    for table in workload.tables:
        uri = table_uri(root, table.schema.database, table.schema.table)
        assert uri is not None
        mirror = DeltaTable(uri)
        assert mirror.metadata().partition_columns == ["_bucket"]
        operations = [c["operation"] for c in mirror.history()]
        assert operations.count("MERGE") == 1  # once, as the run stopped
        changelog = DeltaTable(uri.removesuffix("mirror") + "changelog")
        assert len(changelog.history()) > 3  # batch by batch
        plain[f"{table.schema.database}.{table.schema.table}"] = arrow_table_rows(
            pa.table(mirror.to_pyarrow_table()), table.schema
        )
    assert differences(plain, load_truth(truth_path)) == []


# -- two members ------------------------------------------------------------------------------------------
class _TwoMembers(_Driver):
    """Batches written by two members (sinks) of one group in turn; both record progress."""

    def __init__(self, members: list[DeltaSink], partitions: int) -> None:
        super().__init__(members[0], partitions, 1)
        self.members, self.turn = members, 0

    def _flush(self, resolved_ts: int) -> None:
        self.sink = self.members[self.turn % 2]
        self.turn += 1
        super()._flush(resolved_ts)

    def _record(self, watermark: int) -> None:
        for member in self.members:
            self.sink = member
            super()._record(watermark)


def test_two_lazy_members_merge_each_others_changes_exactly_once(tmp_path: Path) -> None:
    config = WorkloadConfig(rows=200, tables=2, partitions=2, ddl=False, seed=9, watermark_every_txns=3)
    records = sent(Workload(config))
    members = [DeltaSink(tmp_path, mirror_interval_rows=40), DeltaSink(tmp_path, mirror_interval_rows=40)]
    driver = _TwoMembers(members, config.partitions)
    driver.feed(records)
    assert [d for tso in _commit_points(records) for d in _differences(tmp_path, records, tso)] == []
    for member in members:  # both stop
        member.record_progress(CommitContext(GROUP, {}, driver.last_watermark, b"", {}, stopped=()))
    for uri in _mirror_uris(tmp_path):
        assert _merged_offsets(uri) == _changelog_offsets(uri)
        merges = [c for c in DeltaTable(uri).history() if c["operation"] == "MERGE"]
        assert {c["ticdc.group"] for c in merges} == {GROUP} and len(merges) >= 2
    for table in ("t0", "t1"):
        _plain_mirror_exact(tmp_path, records, "shop", table)


# -- attacks ------------------------------------------------------------------------------------------------
def _rows(partition: int, offsets: list[int], ts: list[int]) -> pa.Table:
    return pa.table(
        {
            "_topic": [TOPIC] * len(offsets),
            "_partition": pa.array([partition] * len(offsets), pa.int32()),
            "_offset": offsets,
            "_commit_ts": ts,
        }
    )


def test_a_merge_takes_a_prefix_of_offsets_and_claims_only_what_it_holds() -> None:
    """A partition whose commit ts go back (a changefeed resending): only the offsets before the first
    change after the point are MERGEd (app transactions record one offset per partition), and the claimed
    complete point stops before the oldest change left out; unknown commit ts (0) never counts as later."""
    rows = pa.concat_tables([_rows(0, [0, 1, 2, 3], [5, 9, 7, 6]), _rows(1, [0, 1, 2], [4, 0, 8])])
    merged, complete, left = _prefix_up_to(rows, upto=8, point=8)
    assert list(zip(merged["_partition"].to_pylist(), merged["_offset"].to_pylist(), strict=True)) == [
        (0, 0),
        (1, 0),
        (1, 1),
        (1, 2),
    ]
    assert (complete, left) == (5, 3)  # offsets 1-3 of partition 0 wait; the oldest of them has ts 6
    merged, complete, left = _prefix_up_to(rows, upto=10, point=8)  # a DDL barrier at 11
    assert (merged.num_rows, complete, left) == (7, 8, 0)
    assert _prefix_up_to(rows.slice(0, 0), upto=8, point=8)[1:] == (8, 0)


def test_a_lagging_members_older_change_waits_for_the_consistent_point_and_loses_to_a_delete(
    tmp_path: Path,
) -> None:
    """A member's lazy MERGE takes only changes up to the consistent point: a delete after it waits while
    another member lags behind it on another partition; once that member's older update arrives, one MERGE
    orders both and the delete wins (the row is not revived)."""
    sink = DeltaSink(tmp_path, mirror_interval_rows=NEVER)
    ins, upd, rm = DMLType.INSERT, DMLType.UPDATE, DMLType.DELETE
    _write(sink, [(ins, 1, "a", 10), (ins, 2, "b", 10), (rm, 1, None, 20)], 0)
    applied = {(TOPIC, 0): 30 << 18, (TOPIC, 1): 12 << 18}  # partition 1's member is behind, at 12
    resume = {(TOPIC, 0): 3, (TOPIC, 1): 0}
    sink.record_progress(CommitContext(GROUP, resume, 30 << 18, b"", applied, stopped=()))
    uri = table_uri(tmp_path, "shop", "kv")
    assert uri is not None
    rows = DeltaTable(uri).to_pyarrow_table().sort_by("id").select(["id", "v"]).to_pylist()
    assert rows == [{"id": 1, "v": "a"}, {"id": 2, "v": "b"}]  # the delete at 20 is after the point, 12
    assert mirror_versions(DeltaTable(uri))[-1].complete_ts == 12 << 18
    at_12 = read_mirror(tmp_path, "shop", "kv", as_of_tso=12 << 18)
    assert at_12 is not None and at_12.select(["id", "v"]).to_pylist() == rows

    lagging = DeltaSink(tmp_path, mirror_interval_rows=NEVER)  # the member behind, on partition 1
    located = [
        (raw_dml(SCHEMA, upd, {"id": 1, "v": "old"}, {"id": 1, "v": "a"}, commit_ts=15 << 18), 0),
        (raw_dml(SCHEMA, upd, {"id": 2, "v": "b2"}, {"id": 2, "v": "b"}, commit_ts=25 << 18), 1),
    ]
    changes = table_changes(TableCodec(SCHEMA), [(d, RecordLocation(TOPIC, 1, o)) for d, o in located])
    lagging.write(changes, CommitContext(GROUP))
    applied = {(TOPIC, 1): 30 << 18}
    lagging.record_progress(CommitContext(GROUP, {(TOPIC, 1): 2}, 30 << 18, b"", applied, stopped=()))
    rows = DeltaTable(uri).to_pyarrow_table().sort_by("id").select(["id", "v"]).to_pylist()
    assert rows == [{"id": 2, "v": "b2"}]  # key 1 stays deleted; key 2 takes the newer change
    assert mirror_versions(DeltaTable(uri))[-1].complete_ts == 30 << 18
    at_16 = read_mirror(tmp_path, "shop", "kv", as_of_tso=16 << 18)
    assert at_16 is not None and at_16.select(["id", "v"]).to_pylist() == [
        {"id": 1, "v": "old"},
        {"id": 2, "v": "b"},
    ]
