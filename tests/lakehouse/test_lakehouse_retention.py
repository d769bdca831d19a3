"""As-of retention: `maintain --as-of-retention` removes the changelog rows as-of reads within the retention
no longer need; every read from the oldest TSO it keeps to the consistent point stays equal to a replay of the
stream (mirrors and histories, across DDLs), an older one raises `AsOfRetentionError` naming that TSO, and
`status` reports the range."""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable
from lakehouse_checks import valid_at
from test_lakehouse_asof import _commit_points, _differences, _Driver

from consumer.cli import main, retention_span_hours
from consumer.lakehouse import maintain
from consumer.lakehouse.status import read_status
from consumer.lakehouse.tables import (
    BASES_PROPERTY,
    COMPLETE_TS,
    KNOWN_PROPERTY,
    NEWEST_TS,
    READABLE_FROM,
    RETAINED_AFTER,
    AsOfRetentionError,
    TsoOutOfRangeError,
    mirror_versions,
    read_history,
    read_mirror,
    retained_range,
    tables,
)
from consumer.protocol.model import DDL
from consumer.simulate.truth import arrow_table_rows, sent, truth_at
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig
from consumer.sinks.delta import DeltaSink

HOUR_S = 3600


def _lake(root: Path, seed: int) -> list[StreamRecord]:
    config = WorkloadConfig(rows=120, tables=2, partitions=2, seed=seed, watermark_every_txns=4)
    records = sent(Workload(config))
    _Driver(DeltaSink(root, mode="both,history"), config.partitions, 1).feed(records)
    return records


def _now_for(horizon: int, hours: float) -> float:
    """The wall-clock time at which a retention of `hours` reaches back to TSO `horizon`."""
    return (horizon >> 18) / 1000 + hours * HOUR_S


def _ddl_points(records: list[StreamRecord]) -> list[int]:
    """Each DDL's commit ts and the TSO just before it."""
    ddls = {r.message.commit_ts for r in records if isinstance(r.message, DDL)}
    return sorted(ddls | {ts - 1 for ts in ddls})


def test_retention_keeps_every_as_of_read_within_it_exact_and_refuses_older_ones(tmp_path: Path) -> None:
    records = _lake(tmp_path, seed=3)
    points = _commit_points(records)
    earliest, point = retained_range(tmp_path)
    assert earliest == points[0] and point is not None
    horizon = points[len(points) // 2]

    report = maintain(tmp_path, as_of_retention_hours=2, now=_now_for(horizon, 2), vacuum=False)
    assert all(done.error is None for done in report.tables)
    oldest = report.as_of_from
    assert oldest is not None and earliest < oldest <= horizon
    assert sum(done.changes_removed for done in report.tables) > 0
    assert retained_range(tmp_path) == (oldest, point)
    assert read_status(tmp_path).as_of_from == oldest

    for entry in tables(tmp_path):  # the changelog holds exactly the changes after what it recorded
        changelog = DeltaTable(str(tmp_path / entry.location / "changelog"))
        retained = changelog.metadata().configuration.get(RETAINED_AFTER)
        if retained is not None:
            ts = changelog.to_pyarrow_table(columns=["_commit_ts"])["_commit_ts"]
            assert pc.min(ts).as_py() is None or pc.min(ts).as_py() > int(retained)

    kept = [tso for tso in sorted({*points, *_ddl_points(records)}) if oldest <= tso <= point]
    assert kept and [d for tso in kept for d in _differences(tmp_path, records, tso)] == []
    for tso in kept[:: max(1, len(kept) // 8)]:  # histories too, across the DDLs
        for name, truth in truth_at(records, tso).items():
            history = read_history(tmp_path, *name.split("."), as_of_tso=tso)
            assert history is not None
            assert arrow_table_rows(valid_at(history, tso), truth.schema) == truth.rows

    for older in (oldest - 1, earliest, points[1]):  # inside what was retained before, not now
        if older >= oldest:
            continue
        with pytest.raises(AsOfRetentionError, match=f"oldest TSO this lakehouse answers as of is {oldest}"):
            read_mirror(tmp_path, "shop", "t1", as_of_tso=older)
        with pytest.raises(AsOfRetentionError) as raised:
            read_history(tmp_path, "shop", "t1", as_of_tso=older)
        assert raised.value.oldest == oldest and isinstance(raised.value, TsoOutOfRangeError)
    with pytest.raises(TsoOutOfRangeError):  # before any data: still out of range
        read_mirror(tmp_path, "shop", "t1", as_of_tso=0)

    again = maintain(tmp_path, as_of_retention_hours=2, now=_now_for(horizon, 2), vacuum=False)
    assert again.as_of_from == oldest and sum(done.changes_removed for done in again.tables) == 0
    assert [d for tso in kept[-3:] for d in _differences(tmp_path, records, tso)] == []


def test_a_short_runs_versions_become_bases_by_what_their_offsets_say_they_hold(tmp_path: Path) -> None:
    """A run whose every mirror commit came before its first progress record claims no consistent point
    in them (nothing was known yet, and nothing is claimed that was not); `maintain` finds what a version
    holds from its app transactions and the changelog, records it on the mirror (`ticdc.mirror.bases`),
    and removes the changes it holds: every read from the oldest kept TSO on stays exact."""
    config = WorkloadConfig(rows=120, tables=2, partitions=2, seed=8, watermark_every_txns=4)
    records = sent(Workload(config))
    _Driver(DeltaSink(tmp_path), config.partitions, progress_every=10**6).feed(records)  # one record, last
    for entry in tables(tmp_path):
        mirror = DeltaTable(str(tmp_path / entry.location / "mirror"))
        assert {v.complete_ts for v in mirror_versions(mirror)} == {0}
    points = _commit_points(records)
    earliest, point = retained_range(tmp_path)
    assert earliest is not None and point is not None
    horizon = points[len(points) // 2]

    report = maintain(tmp_path, as_of_retention_hours=2, now=_now_for(horizon, 2), vacuum=False)
    assert all(done.error is None for done in report.tables)
    assert sum(done.changes_removed for done in report.tables) > 0
    oldest = report.as_of_from
    assert oldest is not None and earliest < oldest <= horizon
    found = [
        DeltaTable(str(tmp_path / e.location / "mirror")).metadata().configuration.get(BASES_PROPERTY)
        for e in tables(tmp_path)
    ]
    assert any(found)
    kept = [tso for tso in sorted({*points, *_ddl_points(records)}) if oldest <= tso <= point]
    assert kept and [d for tso in kept for d in _differences(tmp_path, records, tso)] == []
    with pytest.raises(AsOfRetentionError):
        read_mirror(tmp_path, "shop", "t1", as_of_tso=oldest - 1)


def test_a_lost_base_version_is_an_error_never_a_wrong_answer(tmp_path: Path) -> None:
    """Older mirror versions vacuumed away: a read passes over an unreadable version for an older one the
    changelog can still complete, and fails with AsOfRetentionError when none is left."""
    records = _lake(tmp_path, seed=5)
    points = _commit_points(records)
    horizon = points[len(points) // 2]
    report = maintain(tmp_path, as_of_retention_hours=1, now=_now_for(horizon, 1), vacuum=False)
    oldest = report.as_of_from
    assert oldest is not None
    entry = next(
        e
        for e in tables(tmp_path)
        if DeltaTable(str(tmp_path / e.location / "changelog")).metadata().configuration.get(READABLE_FROM)
        == str(oldest)
    )
    mirror = tmp_path / entry.location / "mirror"
    current = {p.removeprefix("file://") for p in DeltaTable(str(mirror)).file_uris()}
    data = [path for path in mirror.rglob("*.parquet") if "_delta_log" not in path.parts]
    removed = [path for path in data if str(path) not in current]
    for path in removed:  # every older version's files, as a VACUUM with no retention would
        path.unlink()
    assert removed
    errors = 0
    for tso in [tso for tso in points if oldest <= tso]:
        name = entry.name_at(tso)
        if name is None:
            continue
        try:
            rows = read_mirror(tmp_path, *name, as_of_tso=tso)
        except AsOfRetentionError as exc:
            assert exc.oldest == oldest
            errors += 1
            continue
        truth = truth_at(records, tso).get(".".join(name))
        assert rows is not None and truth is not None
        assert arrow_table_rows(rows, truth.schema) == truth.rows
    assert errors


def test_the_maintain_command_takes_a_retention_and_status_reports_the_range(tmp_path: Path) -> None:
    _lake(tmp_path, seed=8)
    earliest, point = retained_range(tmp_path)
    result = CliRunner().invoke(
        main, ["maintain", "--sink", f"delta:{tmp_path}", "--no-vacuum", "--as-of-retention", "all"]
    )
    assert result.exit_code == 0, result.output
    assert f"as-of reads answer from TSO {earliest}" in result.output
    assert retained_range(tmp_path) == (earliest, point)  # the stream is fresh: nothing is older than 7 days
    result = CliRunner().invoke(main, ["maintain", "--sink", f"delta:{tmp_path}"])  # VACUUM too
    assert result.exit_code == 0, result.output
    assert retained_range(tmp_path) == (earliest, point)
    result = CliRunner().invoke(main, ["status", "--sink", str(tmp_path)])
    assert result.exit_code == 0 and f"as-of reads answer from TSO {earliest} to {point}" in result.output
    bad = CliRunner().invoke(main, ["maintain", "--sink", f"delta:{tmp_path}", "--as-of-retention", "7x"])
    assert bad.exit_code == 2 and "--as-of-retention" in bad.output
    assert retention_span_hours("7d") == 168 and retention_span_hours("90m") == 1.5
    assert retention_span_hours("36h") == 36 and retention_span_hours("all") is None


class _CleanedLog:
    """A mirror whose log lost its first commits (cleanup_metadata), with what maintain recorded."""

    def __init__(self, commits: list[dict[str, object]], known: str | None) -> None:
        self.commits, self.configuration = commits, {} if known is None else {KNOWN_PROPERTY: known}

    def history(self) -> list[dict[str, object]]:
        return self.commits

    def metadata(self) -> _CleanedLog:
        return self


def test_mirror_versions_resume_from_what_maintain_recorded_once_the_log_is_cleaned() -> None:
    commits: list[dict[str, object]] = [
        {"version": 6, "operation": "SET TBLPROPERTIES"},
        {"version": 7, "operation": "MERGE", COMPLETE_TS: "40", NEWEST_TS: "45"},
    ]
    unknown = mirror_versions(_CleanedLog(commits, None))  # type: ignore[arg-type]
    assert [v.newest_ts for v in unknown] == [None, None]
    seeded = mirror_versions(_CleanedLog(commits, "5:30:35"))  # type: ignore[arg-type]
    assert [(v.version, v.complete_ts, v.newest_ts) for v in seeded] == [(6, 30, 35), (7, 40, 45)]
    assert [v.newest_ts for v in mirror_versions(_CleanedLog(commits, "3:30:35"))] == [None, None]  # type: ignore[arg-type]
