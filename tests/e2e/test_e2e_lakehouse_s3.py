"""Several group members on an object store: simulator -> Kafka -> `run` processes -> Delta on `s3://` (the
moto server), checked with a plain Delta reader that finds each table through the catalog as the README
says, against the simulator's ground truth; the changelog is complete and duplicate-free; a replay commits
nothing; members killed with SIGKILL at random points still end exact; as-of reads at every watermark equal
the truth then, and the catalog's record of each mirror is what its commits claim."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake.query import QueryBuilder
from lakehouse_checks import (
    SESSION_TIMEOUT_S,
    changelog_duplicates,
    ddl_types,
    run_to_end,
    start_run,
    versions,
)
from pyarrow.fs import FileSelector

from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import mirror_versions, read_mirror, tables
from consumer.protocol.model import Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import SimulationReport, produce_to_kafka, write_ground_truth
from consumer.simulate.truth import arrow_table_rows, differences, sent, truth_at
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.s3 import LocalS3Server

EVERY_DDL = {"CREATE", "ALTER", "CINDEX", "TRUNCATE", "RENAME", "ERASE"}


def _produce(
    broker: EmbeddedBroker, topic: str, rows: int, partitions: int
) -> tuple[Workload, SimulationReport]:
    workload = Workload(WorkloadConfig(rows=rows, tables=3, partitions=partitions, dispatch="primary-key"))
    return workload, produce_to_kafka(workload, MessageEncoder(), broker.bootstrap_servers, topic)


def _start(
    broker: EmbeddedBroker, topic: str, root: str, logs: Path, *, processes: int = 1
) -> subprocess.Popen[str]:
    """A `run` command writing `root`, not waited for, reaching the store through the standard AWS_*
    variables (set by the `s3_lake` fixture), logging to `logs/run-*.log`."""
    log = logs / f"run-p{processes}-{time.monotonic_ns()}.log"
    return start_run(broker.bootstrap_servers, topic, f"{topic}.lake", f"delta:{root}", log, processes)


def _run(
    broker: EmbeddedBroker, topic: str, root: str, logs: Path, *, processes: int = 1, spark: bool = False
) -> None:
    """A `run` command to its clean end (logged like `_start`'s). `spark`: on the Spark engine (checkpoint
    in `logs`)."""
    engine = ["--engine", "spark", "--checkpoint", str(logs / "checkpoint")] if spark else []
    sink, stem = f"delta:{root}", logs / f"run-p{processes}"
    code, log = run_to_end(broker, topic, f"{topic}.lake", sink, stem, processes, engine, timeout=600)
    assert code == 0, log.read_text()[-3000:]


def _plain_table(root: str, location: str, kind: str) -> pa.Table:
    return pa.table(
        QueryBuilder()
        .register("t", DeltaTable(f"{root}/{location}/{kind}"))
        .execute("SELECT * FROM t")
        .read_all()
    )


def _plain_state(root: str, workload: Workload) -> dict[str, Any]:
    """Every live table's mirror as a plain Delta reader sees it: the location from `<root>/_catalog`."""
    catalog = QueryBuilder().register("catalog", DeltaTable(f"{root}/_catalog"))
    live = pa.table(
        catalog.execute('SELECT database, "table", location FROM catalog WHERE dropped_ts IS NULL').read_all()
    ).to_pylist()
    locations = {(row["database"], row["table"]): row["location"] for row in live}
    state = {}
    for table in workload.tables:
        schema = table.schema
        location = locations.get((schema.database, schema.table))
        mirror = None if location is None else _plain_table(root, location, "mirror")
        state[f"{schema.database}.{schema.table}"] = (
            {} if mirror is None else arrow_table_rows(mirror, schema)
        )
    return state


def _changelog_offsets(root: str) -> set[tuple[int, int]]:
    """(partition, offset) of every DML record in any table's changelog (dropped tables included)."""
    catalog = QueryBuilder().register("catalog", DeltaTable(f"{root}/_catalog"))
    locations = pa.table(catalog.execute("SELECT location FROM catalog").read_all())["location"].to_pylist()
    found: set[tuple[int, int]] = set()
    for location in locations:
        rows = _plain_table(root, location, "changelog")
        found.update(zip(rows["_partition"].to_pylist(), rows["_offset"].to_pylist(), strict=True))
    return found


def _dml_offsets(report: SimulationReport) -> set[tuple[int, int]]:
    return {
        (partition, offset)
        for (kind, partition), offsets in report.offsets.items()
        if kind == "DML"
        for offset in offsets
    }


def _check(root: str, workload: Workload, report: SimulationReport, truth: dict[str, Any]) -> None:
    assert differences(_plain_state(root, workload), truth) == []
    assert _changelog_offsets(root) == _dml_offsets(report)  # complete: every DML record, no other
    assert changelog_duplicates(root) == 0
    assert ddl_types(root) == EVERY_DDL


@pytest.mark.slow
def test_two_members_on_s3_every_ddl_type_a_plain_reader_equals_the_truth_and_a_replay_commits_nothing(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, s3_lake: str, tmp_path: Path
) -> None:
    topic = kafka_topic(4)
    workload, report = _produce(kafka_broker, topic, rows=3000, partitions=4)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    _run(kafka_broker, topic, s3_lake, tmp_path, processes=2)
    _check(s3_lake, workload, report, truth)
    assert consistent_ts(LakeRoot.of(s3_lake)) == workload.last_watermark
    written = versions(s3_lake)
    _run(kafka_broker, topic, s3_lake, tmp_path)  # the same group again: resumes at the end
    assert versions(s3_lake) == written


def _changelog_commits(root: str) -> int:
    """Delta commits to the lake's changelogs so far: one listing of the store."""
    filesystem, path = LakeRoot.of(root).filesystem()
    listing = filesystem.get_file_info(FileSelector(path, recursive=True, allow_not_found=True))
    return sum(1 for info in listing if "/changelog/_delta_log/" in info.path and info.path.endswith(".json"))


def _working(root: str, members: list[subprocess.Popen[str]], timeout: float = 120) -> None:
    """Wait until the members commit changes to the lake (their logs can't tell: progress is printed
    between cycles, and one cycle applying thousands of rows across DDLs on S3 takes a minute), or until
    they have all ended, idle: earlier rounds left them nothing to apply."""
    before, deadline = _changelog_commits(root), time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _changelog_commits(root) > before or all(m.poll() is not None for m in members):
            return
        time.sleep(0.5)
    raise AssertionError("no member applied any row")


def _unapplied_below_commits(
    broker: EmbeddedBroker, topic: str, root: str, group: str, report: SimulationReport
) -> set[tuple[int, int]]:
    """(partition, offset) of each DML record below the group's committed offset that no changelog holds:
    Kafka commits that ran ahead of the lake."""
    partitions = sorted({partition for _, partition in report.offsets})
    with KafkaSource(broker.bootstrap_servers, [topic], group, partitions=ALL_PARTITIONS) as reader:
        committed = reader.committed([(topic, p) for p in partitions])  # reads without joining the group
    unapplied = _dml_offsets(report) - _changelog_offsets(root)
    return {(p, offset) for p, offset in unapplied if offset < (committed[topic, p] or 0)}


def _run_to_the_end(
    broker: EmbeddedBroker, topic: str, root: str, logs: Path, report: SimulationReport
) -> None:
    """Run the group until every DML is in a changelog. The embedded broker can wedge a group whose members
    were killed during a rebalance: later members join and are never assigned a partition (for minutes, far
    past the 30 s rebalance timeout). Then, once the group's Kafka commits are checked against the
    changelogs, the Spark engine (it joins no Kafka group) ends the group's work from the lake's records."""
    for _ in range(3):
        _run(broker, topic, root, logs, processes=2)
        if _changelog_offsets(root) == _dml_offsets(report):
            return
        newest = max(logs.glob("run-*.log"), key=lambda path: path.stat().st_mtime)
        if "assigned" not in newest.read_text():
            assert _unapplied_below_commits(broker, topic, root, f"{topic}.lake", report) == set()
            _run(broker, topic, root, logs, spark=True)
            return


@pytest.mark.slow
def test_three_members_on_s3_killed_at_random_points_end_exact(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, s3_lake: str, tmp_path: Path
) -> None:
    """A `run --processes 2` and a plain `run` (three members), killed together with SIGKILL at a random
    point once they are applying rows, three times; then the group runs to the end. No WATERMARK is
    produced after the stream: partitions a killed run applied to their end resolve from the recorded
    progress."""
    topic = kafka_topic(6)
    workload, report = _produce(kafka_broker, topic, rows=6000, partitions=6)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    delays = random.Random(12).sample([x / 4 for x in range(12)], 3)  # 0 .. 2.75 s into the work
    for delay in delays:
        members = [
            _start(kafka_broker, topic, s3_lake, tmp_path, processes=2),
            _start(kafka_broker, topic, s3_lake, tmp_path),
        ]
        _working(s3_lake, members)
        time.sleep(delay)  # a random kill point, by design: they are applying rows (waited for above)
        for member in members:
            with contextlib.suppress(ProcessLookupError):  # it may have ended, idle, already
                os.killpg(member.pid, signal.SIGKILL)
            member.wait()
        time.sleep(SESSION_TIMEOUT_S + 1.5)  # by design: the killed members' sessions must expire
    _run_to_the_end(kafka_broker, topic, s3_lake, tmp_path, report)
    _check(s3_lake, workload, report, truth)
    assert consistent_ts(LakeRoot.of(s3_lake)) == workload.last_watermark


@pytest.mark.slow
@pytest.mark.parametrize(  # every batch: as-of reads of two members on local files (test_e2e_lakehouse)
    "options", [("--mirror-interval-rows", "150")], ids=["lazy"]
)
def test_two_members_on_s3_as_of_every_watermark_equal_the_truth_then(
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    s3_server: LocalS3Server,
    s3_lake: str,
    tmp_path: Path,
    options: tuple[str, ...],
) -> None:
    """Two members write the lake on S3, MERGEing their mirrors lazily; as of every watermark of the stream
    every table (all of them at one TSO) equals the truth then, read with explicit storage options. The
    catalog records, per live table, a mirror version and a TSO it holds every change up to; where that
    version is exact, a plain Delta read of it is the truth at that TSO."""
    topic = kafka_topic(3)
    config = WorkloadConfig(
        rows=600,  # 8 watermarks, every DDL type: each as-of read on the S3 server takes about a second
        tables=3,
        partitions=3,
        dispatch="primary-key",
        watermark_every_txns=30,
        start_physical_ms=int(time.time() * 1000),
    )
    produce_to_kafka(Workload(config), MessageEncoder(), kafka_broker.bootstrap_servers, topic)
    records = sent(Workload(config))  # the same stream
    sink, stem = f"delta:{s3_lake}", tmp_path / "run-p2"
    code, log = run_to_end(kafka_broker, topic, f"{topic}.lake", sink, stem, 2, options, timeout=600)
    assert code == 0, log.read_text()[-3000:]
    storage = s3_server.storage_options
    watermarks = sorted({r.message.commit_ts for r in records if isinstance(r.message, Watermark)})
    assert len(watermarks) >= 6 and consistent_ts(s3_lake, storage_options=storage) == watermarks[-1]
    for watermark in watermarks:
        for name, expected in truth_at(records, watermark).items():
            database, table = name.split(".")
            rows = read_mirror(s3_lake, database, table, as_of_tso=watermark, storage_options=storage)
            assert rows is not None, f"{name} at {watermark}"
            columns = [c.name for c in expected.schema.columns]
            assert rows.column_names == [*columns, "_commit_ts", "_schema_version"], f"{name} at {watermark}"
            assert arrow_table_rows(rows, expected.schema) == expected.rows, f"{name} at {watermark}"

    exact = 0
    for entry in tables(s3_lake, storage):
        uri = f"{s3_lake}/{entry.location}/mirror"
        if not entry.live or entry.mirror is None:
            continue
        claimed = {v.version: v for v in mirror_versions(DeltaTable(uri, storage_options=storage))}
        commits = claimed[entry.mirror.version]
        assert commits.newest_ts == entry.mirror.newest_ts
        if options:  # lazy: the commits' own claims
            assert commits.complete_ts == entry.mirror.complete_ts
        else:  # MERGEd every batch: up to the consistent point read at a progress record, at the most
            assert commits.complete_ts <= entry.mirror.complete_ts <= watermarks[-1]
        if entry.mirror.exact:
            exact += 1
            expected = truth_at(records, entry.mirror.complete_ts)[".".join(entry.name)]
            plain = DeltaTable(uri, version=entry.mirror.version, storage_options=storage).to_pyarrow_table()
            assert arrow_table_rows(plain, expected.schema) == expected.rows
    assert exact or not options  # lazy MERGEs are exact at what they claim
