"""End to end into the lakehouse on the real broker: simulator -> Kafka -> `run` -> Delta, checked against
the simulator's ground truth (mirror) and for duplicates (changelog, by topic/partition/offset)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from lakehouse_checks import (
    RETRIED_JOIN_GRACE,
    SESSION_TIMEOUT_S,
    changelog_duplicates,
    changelog_rows,
    ddl_types,
    run_to_end,
    start_run,
    valid_at,
    versions,
)

from consumer.app import build_pipeline
from consumer.cli import EXIT_UNASSIGNED
from consumer.config import load_config
from consumer.lakehouse.maintenance import maintain
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.tables import (
    COMPLETE_TS,
    AsOfRetentionError,
    read_history,
    read_mirror,
    retained_range,
)
from consumer.pipeline.stats import PipelineStats
from consumer.protocol.model import Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka, write_ground_truth
from consumer.simulate.truth import arrow_table_rows, delta_mirror_state, differences, sent, truth_at
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.kafka import KafkaSource
from consumer.testing.broker import EmbeddedBroker


def _produce(
    broker: EmbeddedBroker, topic: str, encoding: str = "json", compression: str = "none", **options: Any
) -> Workload:
    workload = Workload(WorkloadConfig(**{"rows": 4000, "tables": 3, "partitions": 3, **options}))
    produce_to_kafka(workload, MessageEncoder(encoding, compression), broker.bootstrap_servers, topic)  # type: ignore[arg-type]
    return workload


def _start(
    broker: EmbeddedBroker,
    topic: str,
    root: Path,
    group: str,
    *,
    processes: int = 1,
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[str]:
    """A `run` command, not waited for; its log goes next to the output, to read when a test fails. The
    broker outlives tests: a group of an earlier test must not interfere, hence the topic in the group's
    name."""
    log = root.parent / f"{group}-p{processes}-{time.monotonic_ns()}.log"
    servers, sink = broker.bootstrap_servers, f"delta:{root}"
    return start_run(servers, topic, f"{topic}.{group}", sink, log, processes, env=env)


def _run(
    broker: EmbeddedBroker,
    topic: str,
    root: Path,
    group: str,
    *,
    processes: int = 1,
    mode: str = "both",
    options: tuple[str, ...] = (),
) -> None:
    """A `run` command to its end, which must be a clean one (logged like `_start`'s)."""
    log_stem = root.parent / f"{group}-p{processes}"
    flags = ["--mode", mode, *options]
    code, log = run_to_end(broker, topic, f"{topic}.{group}", f"delta:{root}", log_stem, processes, flags)
    assert code == 0, log.read_text()[-3000:]


def _newest_log(directory: Path, group: str, processes: int) -> str:
    logs = directory.glob(f"{group}-p{processes}-*.log")
    return max(logs, key=lambda path: path.stat().st_mtime).read_text()


def _summary_rows(log: str) -> int:
    """Changelog rows in a `run` log's summary line."""
    found = re.findall(r"^(\d+) records, (\d+) changelog rows", log, flags=re.MULTILINE)
    assert found, log[-2000:]
    return int(found[-1][1])


def _assignment_sizes(log: str) -> set[int]:
    """How many partitions each assignment in a `run` log gave the command's own member."""
    return {line.count("), (") + 1 for line in re.findall(r" assigned \[.*\]$", log, flags=re.MULTILINE)}


def _delta_commits(root: Path) -> int:
    """Commits of every Delta table under `root`, so far."""
    return sum(1 for _ in root.glob("**/_delta_log/*.json"))


def _mirror_state(root: Path, workload: Workload) -> dict[str, Any]:
    return delta_mirror_state(root, (table.schema for table in workload.tables))


@pytest.mark.parametrize(
    ("encoding", "compression"), [("json", "none"), ("avro", "none"), ("json", "lz4"), ("avro", "snappy")]
)
def test_mirror_equals_ground_truth_through_every_ddl_type(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path, encoding: str, compression: str
) -> None:
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, encoding, compression, dispatch="primary-key")
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    _run(kafka_broker, topic, tmp_path / "lake", "lake")
    assert differences(_mirror_state(tmp_path / "lake", workload), truth) == []
    assert changelog_duplicates(tmp_path / "lake") == 0
    assert ddl_types(tmp_path / "lake") == {"CREATE", "ALTER", "CINDEX", "TRUNCATE", "RENAME", "ERASE"}
    assert consistent_ts(tmp_path / "lake") == workload.last_watermark


@pytest.mark.slow
def test_sigkill_at_several_points_then_restart_ends_exact(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=15000, dispatch="primary-key")
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    # kill points, each an observable state of the run: assigned with nothing committed yet; right after
    # its first Delta commit (its batch's other tables still committing); several batches in
    kill_points = {"assigned": 0, "its first commit": 1, "several batches in": 25}
    for point, commits in kill_points.items():
        before = _delta_commits(root)
        process = _start(kafka_broker, topic, root, "killed")
        log = max(tmp_path.glob("killed-p1-*.log"), key=lambda path: path.stat().st_mtime)
        deadline = time.monotonic() + 120
        while " assigned [" not in log.read_text() or _delta_commits(root) < before + commits:
            tail = log.read_text()[-3000:]
            assert process.poll() is None, f"the run ended before the kill point {point!r}: {tail}"
            assert time.monotonic() < deadline, f"the kill point {point!r} never came: {tail}"
            time.sleep(0.01)
        process.send_signal(signal.SIGKILL)
        process.wait()
    # by design, not a race: the last killed member keeps its partitions until its session expires; a
    # restart joining before that owns only the others and, with --until-idle, would stop without them
    time.sleep(SESSION_TIMEOUT_S + 1.5)
    # a partition the killed runs applied to its end has no WATERMARK after the resume offset: the
    # watermark recorded with its progress resolves it (no TiCDC heartbeat is produced here)
    _run(kafka_broker, topic, root, "killed")
    assert differences(_mirror_state(root, workload), truth) == []
    assert changelog_duplicates(root) == 0
    assert consistent_ts(root) == workload.last_watermark


@pytest.mark.slow
def test_three_members_of_one_group_end_at_the_truth(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Three members of one group into one lakehouse: a `run --processes 2` command (two processes) and a
    plain `run` beside it: their lake equals the truth, as one process's does."""
    topic = kafka_topic(6)
    # every DDL type, RENAME included: it re-hashes keys to other partitions, so members apply both sides
    # of it at different times (the mirror's tombstones and the rename log keep that exact)
    workload = _produce(kafka_broker, topic, rows=9000, partitions=6, dispatch="primary-key")
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    shared = tmp_path / "shared"
    members = [
        _start(kafka_broker, topic, shared, "trio", processes=2),
        _start(kafka_broker, topic, shared, "trio", env=RETRIED_JOIN_GRACE),  # never assigned: run again
    ]
    pair_code, alone_code = (member.wait(300) for member in members)
    assert pair_code == 0, _newest_log(tmp_path, "trio", 2)[-3000:]
    # the embedded broker wedges a group whose last two members (the pair's) leave within one rebalance: a
    # member joining then (the third) or later (the runs below) never gets a partition
    kafka_broker.reset_group(f"{topic}.trio", topic)
    if alone_code == EXIT_UNASSIGNED:
        _run(kafka_broker, topic, shared, "trio")
    else:
        assert alone_code == 0, _newest_log(tmp_path, "trio", 1)[-3000:]
        # the pair's own member held a third of the 6 partitions: 3 members shared them
        assert 2 in _assignment_sizes(_newest_log(tmp_path, "trio", 2))
    written = changelog_rows(shared)
    # every row was applied by one of the commands, whose summaries add up their members (a rebalance may
    # have had two members apply a row, which the sinks skipped the second time)
    applied = sum(_summary_rows(log.read_text()) for log in tmp_path.glob("trio-p*.log"))
    assert applied >= written > 0
    assert differences(_mirror_state(shared, workload), truth) == []
    assert changelog_duplicates(shared) == 0
    assert consistent_ts(shared) == workload.last_watermark  # exact with three members
    written = versions(shared)
    _run(kafka_broker, topic, shared, "trio")  # the group again: it resumes at the end, commits nothing
    assert versions(shared) == written


LAZY_BUCKETED = ("--mirror-interval-rows", "400", "--mirror-buckets", "4")


@pytest.mark.parametrize(
    ("processes", "options"), [(1, ()), (2, LAZY_BUCKETED)], ids=["every-batch", "two-members-lazy-bucketed"]
)
def test_as_of_every_watermark_equals_the_truth_then(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path, processes: int, options: tuple[str, ...]
) -> None:
    """Also with two members MERGEing their mirrors lazily (every 400 changelog rows) into bucketed
    mirrors: as-of reads combine each mirror version with the changelog after it."""
    topic = kafka_topic(3)
    config = {"rows": 1200, "dispatch": "primary-key", "start_physical_ms": int(time.time() * 1000)}
    _produce(kafka_broker, topic, **config)
    records = sent(Workload(WorkloadConfig(**{"tables": 3, "partitions": 3, **config})))  # the same stream
    _run(kafka_broker, topic, tmp_path / "lake", "asof", processes=processes, options=options)
    if options:  # lazily MERGEd, several times: the run's members stopped with their mirrors complete
        merges = [
            c
            for mirror in (tmp_path / "lake").glob("*/*/mirror")
            for c in DeltaTable(str(mirror)).history()
            if c["operation"] == "MERGE"
        ]
        assert len(merges) >= 3
        mirrors = [m for m in (tmp_path / "lake").glob("*/*/mirror") if (m / "_delta_log").exists()]
        assert {tuple(DeltaTable(str(m)).metadata().partition_columns) for m in mirrors} == {("_bucket",)}
    watermarks = sorted({r.message.commit_ts for r in records if isinstance(r.message, Watermark)})
    for watermark in watermarks:
        for name, expected in truth_at(records, watermark).items():
            database, table = name.split(".")
            rows = read_mirror(tmp_path / "lake", database, table, as_of_tso=watermark)
            assert rows is not None, f"{name} at {watermark}"
            columns = [c.name for c in expected.schema.columns]
            assert rows.column_names == [*columns, "_commit_ts", "_schema_version"], f"{name} at {watermark}"
            assert arrow_table_rows(rows, expected.schema) == expected.rows, f"{name} at {watermark}"


def _member(broker: EmbeddedBroker, topic: str, root: Path, partitions: list[int]) -> PipelineStats:
    """A member of the group `topic`.late reading `partitions` to their end, MERGEing its mirrors lazily."""
    sink = {"url": f"delta:{root}", "mirror_interval_rows": 400, "mirror_buckets": 4}
    source = {"url": f"kafka://{broker.bootstrap_servers}/{topic}", "group": f"{topic}.late"}
    config = load_config(overrides={"source": source, "sink": sink}, environ={})
    pipeline = build_pipeline(config)
    chosen = [(topic, partition) for partition in partitions]
    try:
        with KafkaSource(
            broker.bootstrap_servers, [topic], config.source.group, partitions=chosen, listener=pipeline
        ) as kafka:
            return pipeline.run(kafka, until_idle=1.0)
    finally:
        pipeline.close()


def test_a_member_that_starts_late_leaves_no_false_consistent_point(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """The first member of a group reads its partition to the stream's end before the second records
    anything: the lake has no consistent point until the second one recorded its partitions (it claimed
    the first one's, and a lazy MERGE then claimed the mirrors complete with a third of their rows, for
    good), and in the end every mirror, as of every watermark too, equals the truth."""
    topic = kafka_topic(3)
    config = {"rows": 900, "dispatch": "primary-key", "start_physical_ms": int(time.time() * 1000)}
    workload = _produce(kafka_broker, topic, **config)
    records = sent(Workload(WorkloadConfig(**{"tables": 3, "partitions": 3, **config})))
    root = tmp_path / "lake"
    early = _member(kafka_broker, topic, root, [2])
    assert early.rows > 0 and not early.unapplied
    assert consistent_ts(root) is None
    progress = DeltaTable(str(root / "_progress")).to_pyarrow_table()
    assert set(progress["topic_partitions"].to_pylist()) == {3}
    commits = [c for mirror in root.glob("*/*/mirror") for c in DeltaTable(str(mirror)).history()]
    assert {int(str(c[COMPLETE_TS])) for c in commits if COMPLETE_TS in c} <= {0}  # nothing it may lack
    _member(kafka_broker, topic, root, [0, 1])
    assert consistent_ts(root) == workload.last_watermark
    assert differences(_mirror_state(root, workload), write_ground_truth(workload, tmp_path / "t.json")) == []
    for watermark in sorted({r.message.commit_ts for r in records if isinstance(r.message, Watermark)}):
        for name, expected in truth_at(records, watermark).items():
            rows = read_mirror(root, *name.split("."), as_of_tso=watermark)  # type: ignore[arg-type]
            assert rows is not None and arrow_table_rows(rows, expected.schema) == expected.rows, name


def test_as_of_retention_after_two_members_keeps_every_later_watermark_exact(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """Two members keep mirrors, changelogs and histories; `maintain` with an as-of retention reaching
    back to the middle of the stream removes the changes it no longer needs: as of every watermark it
    still answers the mirrors and histories equal the truth, an earlier one raises AsOfRetentionError
    naming the oldest TSO."""
    topic = kafka_topic(3)
    config = {"rows": 1000, "dispatch": "primary-key", "start_physical_ms": int(time.time() * 1000)}
    _produce(kafka_broker, topic, **config)
    records = sent(Workload(WorkloadConfig(**{"tables": 3, "partitions": 3, **config})))
    root = tmp_path / "lake"
    _run(kafka_broker, topic, root, "retention", processes=2, mode="both,history")
    watermarks = sorted({r.message.commit_ts for r in records if isinstance(r.message, Watermark)})
    horizon = watermarks[len(watermarks) // 2]
    earliest = retained_range(root)[0]
    assert earliest is not None
    changelog = changelog_rows(root)
    report = maintain(root, as_of_retention_hours=1, now=(horizon >> 18) / 1000 + 3600, vacuum=False)
    assert all(done.error is None for done in report.tables)
    oldest = report.as_of_from
    # The run is too short for its mirror commits to claim any consistent point (its members record one only
    # as they stop); maintain finds what each version holds from its app transactions: mid-stream versions
    # are bases, changelog rows are actually removed and the oldest readable TSO moves up to the horizon.
    removed = sum(done.changes_removed for done in report.tables)
    assert 0 < removed < changelog
    assert changelog_rows(root) == changelog - removed
    assert oldest is not None and earliest < oldest <= horizon
    for watermark in watermarks:
        for name, expected in truth_at(records, watermark).items():
            database, table = name.split(".")
            if watermark < oldest:
                with pytest.raises(AsOfRetentionError, match=str(oldest)):
                    read_mirror(root, database, table, as_of_tso=watermark)
                continue
            rows = read_mirror(root, database, table, as_of_tso=watermark)
            assert rows is not None, f"{name} at {watermark}"
            assert arrow_table_rows(rows, expected.schema) == expected.rows, f"{name} at {watermark}"
            history = read_history(root, database, table, as_of_tso=watermark)
            assert history is not None, f"{name} at {watermark}"
            current = arrow_table_rows(valid_at(history, watermark), expected.schema)
            assert current == expected.rows, f"history of {name} at {watermark}"


def test_history_of_two_members_ends_at_the_truth(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """`--mode both,history` with two members: the versions open at the end are the truth; a run of the
    group again commits nothing."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=1500, dispatch="primary-key")
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    _run(kafka_broker, topic, root, "history", processes=2, mode="both,history")
    state = {}
    for table in workload.tables:
        history = read_history(root, table.schema.database, table.schema.table)
        current = {} if history is None else arrow_table_rows(valid_at(history, 2**62), table.schema)
        state[f"{table.schema.database}.{table.schema.table}"] = current
    assert differences(state, truth) == []
    assert state == _mirror_state(root, workload)
    written = versions(root)
    _run(kafka_broker, topic, root, "history", mode="both,history")
    assert versions(root) == written
