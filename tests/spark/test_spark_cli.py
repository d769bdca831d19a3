"""`ticdc-consumer run --engine spark` as a command: driver processes killed with SIGKILL at several points
of a micro-batch and restarted from the checkpoint, a new checkpoint on the same lake, and the query on a
standalone cluster (a master and two workers started from the pip-installed pyspark)."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from deltalake import DeltaTable
from lakehouse_checks import changelog_duplicates, changelog_rows, spark_config
from pyspark.sql import SparkSession

from consumer.config import RunConfig
from consumer.kill_points import ENV as KILL_POINT
from consumer.kill_points import GATE_ENV as START_GATE
from consumer.protocol.model import DDL
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import WatermarkHeartbeat, produce_to_kafka, write_ground_truth
from consumer.simulate.truth import changelog_images, delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.spark import engine
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.spark_cluster import SparkStandaloneCluster

pytestmark = [pytest.mark.spark, pytest.mark.e2e, pytest.mark.slow]
BATCH_RECORDS = 1000  # several micro-batches per run
BIG_BATCH_RECORDS = 4000  # the executor-worker kill's: tasks long enough to be caught


def _produce(broker: EmbeddedBroker, topic: str, encoding: str, compression: str, rows: int) -> Workload:
    workload = Workload(WorkloadConfig(rows=rows, tables=3, partitions=3, dispatch="primary-key"))
    produce_to_kafka(workload, MessageEncoder(encoding, compression), broker.bootstrap_servers, topic)  # type: ignore[arg-type]
    return workload


def _start(
    broker: EmbeddedBroker,
    topic: str,
    root: Path,
    checkpoint: Path,
    *extra: str,
    env: dict[str, str] | None = None,
    until_idle: bool = True,
) -> tuple[subprocess.Popen[bytes], Path]:
    """A `run --engine spark` command in its own process group (a kill takes its JVM and workers too);
    without `until_idle`, a processingTime query that runs until stopped."""
    command = [
        sys.executable,
        "-m",
        "consumer",
        "run",
        "--engine",
        "spark",
        "--source",
        f"kafka://{broker.bootstrap_servers}/{topic}",
        "--group",
        f"{topic}.g",
        "--sink",
        f"delta:{root}",
        "--checkpoint",
        str(checkpoint),
        *(["--until-idle", "2"] if until_idle else []),
        *extra,
    ]
    log = root.parent / f"run-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            env={**os.environ, "TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": str(BATCH_RECORDS), **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log


def _finish(process: subprocess.Popen[bytes], log: Path) -> str:
    assert process.wait(600) == 0, log.read_text()[-4000:]
    return log.read_text()


def _delta_commits(root: Path) -> int:
    """Commits of the lake's change tables (not `_settings`, which a mirror writer records at its start)."""
    return sum(1 for path in root.glob("**/_delta_log/*.json") if "_settings" not in path.parts)


class _MirrorMerges:
    """Counts the MERGE commits of the lake's mirrors (each commit file read once)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[Path, bool] = {}

    def count(self) -> int:
        for path in self.root.glob("*/*/mirror/_delta_log/*.json"):
            if path not in self.seen:
                try:
                    self.seen[path] = '"operation":"MERGE"' in path.read_text()
                except OSError:
                    continue
        return sum(self.seen.values())


def _batches(checkpoint: Path) -> set[str]:
    return {path.name for path in (checkpoint / "ticdc").glob("batch-*.arrow")}


def _planned(checkpoint: Path) -> set[str]:
    return {path.name for path in (checkpoint / "offsets").glob("[0-9]*")}


def _committed_not_applied(checkpoint: Path) -> bool:
    committed = {int(path.name) for path in (checkpoint / "commits").glob("[0-9]*")}
    applied = {int(name.split("-")[1].split(".")[0]) for name in _batches(checkpoint)}
    return bool(committed) and max(committed) > max(applied, default=-1)


def _killed(process: subprocess.Popen[bytes], log: Path) -> None:
    """The command reached its kill point (`TICDC_TEST_KILL_POINT`) and SIGKILLed its process group."""
    assert process.wait(300) == -signal.SIGKILL, log.read_text()[-4000:]


def _uncommitted_changelog_files(root: Path) -> set[Path]:
    """Parquet files in changelog directories that no version of their table adds."""
    found = set()
    for log in root.glob("*/*/changelog/_delta_log"):
        table = log.parent
        added = {Path(uri) for uri in DeltaTable(str(table)).file_uris()}
        found |= {path for path in table.glob("*.parquet") if path not in added}
    return found


def _kill_when(process: subprocess.Popen[bytes], log: Path, reached: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 300
    while not reached():
        assert process.poll() is None, f"the run ended before the kill point: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "the kill point never came"
        time.sleep(0.01)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


class _Restarts:
    """Drivers run one after another on one checkpoint, the i-th with `envs[i]`: each starts gated
    (`TICDC_TEST_START_GATE`) while the one before it still runs, and `open()` lets it read its state once
    that one is dead. It reads nothing before (as a driver started after the kill), and its start-up (Python,
    the JVM, the session) overlaps the run before it instead of following it."""

    def __init__(
        self, broker: EmbeddedBroker, topic: str, root: Path, checkpoint: Path, envs: list[dict[str, str]]
    ) -> None:
        self._run = (broker, topic, root, checkpoint)
        self._gates = [root.parent / f"gate-{index}" for index in range(len(envs))]
        self._envs = envs
        self._started: list[tuple[subprocess.Popen[bytes], Path]] = []
        self._opened = 0
        self._start_next()

    def _start_next(self) -> None:
        index = len(self._started)
        if index < len(self._envs):
            self._started.append(
                _start(*self._run, env={START_GATE: str(self._gates[index]), **self._envs[index]})
            )

    def open(self) -> tuple[subprocess.Popen[bytes], Path]:
        """The next driver, free to read its state (the ones before it are dead); the one after it starts."""
        assert all(process.poll() is not None for process, _ in self._started[: self._opened])
        self._gates[self._opened].touch()
        self._opened += 1
        self._start_next()
        return self._started[self._opened - 1]

    def close(self) -> None:
        """End a driver left gated (a failed test)."""
        for process, _ in self._started:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def test_sigkill_around_a_batch_then_restart_is_exact_and_a_new_checkpoint_adds_nothing(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Commands killed at several points of a batch (around its changelog files: written by executor
    tasks, committed by the driver), then the query restarted from the checkpoint (in this process: a
    fresh handler, like a fresh driver), then a new checkpoint on the same lake."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, "json", "none", rows=4000)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root, checkpoint = tmp_path / "lake", tmp_path / "checkpoint"
    killed_at = [{KILL_POINT: "changelog-files-written:1"}, {KILL_POINT: "changelog-files-committed:1"}]
    restarts = _Restarts(kafka_broker, topic, root, checkpoint, [{}] * 5 + killed_at)
    try:
        # before: a batch planned (its offsets logged), nothing of it committed
        process, log = restarts.open()
        _kill_when(process, log, lambda: bool(_planned(checkpoint)))
        assert _delta_commits(root) == 0 and not _batches(checkpoint)

        # during: some of a batch's tables committed, its record not yet written
        process, log = restarts.open()
        recorded, commits = _batches(checkpoint), _delta_commits(root)
        _kill_when(
            process, log, lambda: _delta_commits(root) > commits + 1 and _batches(checkpoint) == recorded
        )

        # after: the first batch of this run recorded (Spark may or may not have logged its commit)
        process, log = restarts.open()
        recorded = _batches(checkpoint)
        _kill_when(process, log, lambda: bool(_batches(checkpoint) - recorded))

        # between: Spark logged a batch's commit while the driver was still applying it
        process, log = restarts.open()
        _kill_when(process, log, lambda: _committed_not_applied(checkpoint))

        # a MERGE: a task on the executors committed a mirror MERGE (the batch's record may not be written)
        process, log = restarts.open()
        merges = _MirrorMerges(root)
        before = merges.count()
        _kill_when(process, log, lambda: merges.count() > before)

        # a changelog file written by an executor task, the driver dead before committing it: an orphan
        _killed(*restarts.open())
        orphans = _uncommitted_changelog_files(root)
        assert orphans

        # a changelog file committed by the driver, nothing after
        _killed(*restarts.open())
    finally:
        restarts.close()

    with caplog.at_level(logging.INFO, logger="consumer.spark.engine"):
        engine.run(_config(kafka_broker, topic, root, checkpoint), until_idle=1.0, spark=spark)
    assert "again from Kafka" in caplog.text  # the committed batch was read again and applied
    assert orphans <= _uncommitted_changelog_files(root)  # never committed later
    schemas = [table.schema for table in workload.tables]
    assert differences(delta_mirror_state(root, schemas), truth) == []
    assert changelog_duplicates(root) == 0
    images = changelog_images(workload.config)
    assert changelog_rows(root) == images

    # a new checkpoint on the same lake starts where the sinks' records say, and the sinks skip the rows
    # they hold: nothing applied twice (TiCDC's periodic WATERMARK resolves what follows the resume point)
    with WatermarkHeartbeat(workload, MessageEncoder(), kafka_broker.bootstrap_servers, topic):
        engine.run(_config(kafka_broker, topic, root, tmp_path / "another"), until_idle=1.0, spark=spark)
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == images
    assert differences(delta_mirror_state(root, schemas), truth) == []


def test_sigterm_stops_a_running_query_cleanly_and_a_restart_completes_it_exactly(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """SIGTERM to the command alone (a service manager's stop): the query stops, what was handed over is
    applied, the command exits 0 and its JVM and Python workers end with it. The restart's first query
    fails to start (its Python worker too slow to connect back) and is started again, exactly."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, "json", "none", rows=3000)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root, checkpoint = tmp_path / "lake", tmp_path / "checkpoint"
    process, log = _start(kafka_broker, topic, root, checkpoint, until_idle=False)
    deadline = time.monotonic() + 300
    while not _batches(checkpoint):
        assert process.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, "no batch was ever recorded"
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    assert process.wait(120) == 0, log.read_text()[-4000:]
    assert "SIGTERM: stopping" in log.read_text()
    deadline = time.monotonic() + 30
    while _group_alive(process.pid):
        assert time.monotonic() < deadline, "the stopped command left processes of its group running"
        time.sleep(0.1)

    slow = _slow_first_source_runner(tmp_path)  # the restart's first query fails to start: started again
    restarted = _finish(*_start(kafka_broker, topic, root, checkpoint, env={"PYSPARK_PYTHON": str(slow)}))
    assert "did not connect back" not in restarted and "starting the query again (2 of 3)" in restarted
    assert differences(delta_mirror_state(root, [t.schema for t in workload.tables]), truth) == []
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == changelog_images(workload.config)


def _slow_first_source_runner(directory: Path) -> Path:
    """A Python for Spark's workers whose first streaming-source planner starts 12 s late: past the 10 s
    Spark gives a worker to connect back, as on a machine too loaded to start Python in time."""
    script = directory / "slow-python"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$2" = pyspark.sql.streaming.python_streaming_source_runner ] '
        f'&& mkdir "{directory}/slowed" 2>/dev/null; then sleep 12; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize(
    ("master", "retried"),
    [("local[2]", False), ("local[2,4]", True)],
    ids=["no-task-retries", "task-retries"],
)
def test_sigkill_of_an_executor_python_worker_mid_batch_then_restart_is_exact(
    spark: SparkSession,
    kafka_broker: EmbeddedBroker,
    kafka_topic: Any,
    tmp_path: Path,
    master: str,
    retried: bool,
) -> None:
    """kill -9 of the Python worker running a task of a batch (reading and decoding its Kafka range): without
    task retries (local mode's default) the query fails and the command exits 2, and a restart from the
    checkpoint (in this process, on the session's `local[2]`, as the SIGKILL test restarts) completes
    exactly; with retries (as on a cluster: `spark.task.maxFailures`) Spark runs the task again in a new
    worker and the same command completes exactly."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, "json", "none", rows=12000)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root, checkpoint = tmp_path / "lake", tmp_path / "checkpoint"
    big_batches = {"TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": str(BIG_BATCH_RECORDS)}
    process, log = _start(kafka_broker, topic, root, checkpoint, "--master", master, env=big_batches)
    killed = _kill_a_busy_task_worker(process, log, checkpoint)
    code = process.wait(600)
    output = log.read_text()
    assert "Python worker exited unexpectedly" in output, (killed, output[-4000:])  # the kill hit a task
    if retried:
        assert code == 0, output[-4000:]
    else:
        assert code == 2, output[-4000:]
        assert "the streaming query failed" in output, output[-4000:]
        config = _config(kafka_broker, topic, root, checkpoint, batch_records=BIG_BATCH_RECORDS)
        engine.run(config, until_idle=1.0, spark=spark)
    assert differences(delta_mirror_state(root, [t.schema for t in workload.tables]), truth) == []
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == changelog_images(workload.config)


def _task_workers(session: int) -> dict[int, psutil.Process]:
    """The Python workers the command's executors fork to run tasks (`pyspark.daemon pyspark.worker`, a
    child of the daemon): not the daemon itself, nor the planner's processes (`pyspark.sql.worker.*`)."""
    workers = {}
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) != session:
                continue
            parent = process.parent()
            command, above = process.cmdline(), parent.cmdline() if parent else []
        except (psutil.Error, ProcessLookupError):
            continue
        if "pyspark.worker" in command and "pyspark.worker" in above:
            workers[process.pid] = process
    return workers


def _kill_a_busy_task_worker(process: subprocess.Popen[bytes], log: Path, checkpoint: Path) -> int:
    """SIGKILL a task worker seen using CPU (running a task: an idle worker waits on its socket) while a
    batch is planned and not yet recorded; its pid."""
    deadline = time.monotonic() + 300
    seen: dict[int, float] = {}
    while True:
        ended = process.poll() is not None
        assert not ended, f"the run ended before a busy worker was seen: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, "no task worker was ever seen busy"
        planned = {int(name) for name in _planned(checkpoint)}
        recorded = {int(name.split("-")[1].split(".")[0]) for name in _batches(checkpoint)}
        for pid, worker in _task_workers(process.pid).items():
            try:
                times = worker.cpu_times()
            except psutil.Error:
                continue
            used = times.user + times.system
            busy = pid in seen and used > seen[pid]
            seen[pid] = used
            if busy and planned and max(planned) > max(recorded, default=-1):
                os.kill(pid, signal.SIGKILL)
                return pid
        time.sleep(0.02)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _config(
    broker: EmbeddedBroker, topic: str, root: Path, checkpoint: Path, batch_records: int = BATCH_RECORDS
) -> RunConfig:
    """What `_start`'s command runs, for a run in this process."""
    return spark_config(broker, topic, f"{topic}.g", root, checkpoint, {"max_batch_records": batch_records})


@pytest.fixture(scope="session")
def spark_cluster() -> Any:
    """A standalone master and two one-core workers for the test run; every process it starts ends with it."""
    with SparkStandaloneCluster(workers=2, cores=1, memory="1g") as cluster:
        yield cluster
    assert cluster.running() == []


def test_the_stream_runs_on_a_standalone_cluster(
    spark_cluster: SparkStandaloneCluster, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, "avro", "snappy", rows=4000)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    output = _finish(
        *_start(
            kafka_broker,
            topic,
            root,
            tmp_path / "checkpoint",
            "--master",
            spark_cluster.master_url,
            env=spark_cluster.driver_environment,
        )
    )
    assert differences(delta_mirror_state(root, [t.schema for t in workload.tables]), truth) == []
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == changelog_images(workload.config)
    ddls = len(
        {r.message.commit_ts for r in Workload(workload.config).records() if isinstance(r.message, DDL)}
    )
    summary = rf"^\d+ records, \d+ changelog rows, {ddls} DDLs, 0 dead letters"
    assert re.search(summary, output, flags=re.MULTILINE), output[-2000:]
    applications = spark_cluster.executors()
    assert list(applications.values())[-1:] == [2], applications  # both workers ran the query's tasks
