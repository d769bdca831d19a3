"""The two engines take over from each other on one lake: `run` (the loop engine) and `run --engine spark`
(with its own checkpoint) as commands on the real broker, one after the other on the same lake and group,
stopped cleanly part-way or SIGKILLed at a point of their own (`consumer.kill_points`): between a changelog
commit and its mirror MERGE, between a progress record and the executors' MERGEs. Each run starts where the
lake's records say, whichever engine made them, and applies only what the lake lacks; the lake ends equal to
the simulator's ground truth, no changelog row twice, and row for row equal to one loop engine's run of the
whole stream."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable
from lakehouse_checks import (
    changelog_duplicates,
    changelog_rows,
    lake_contents,
    run_to_end,
    spark_config,
    start_run,
    versions,
)
from pyspark.sql import SparkSession

from consumer.config import RunConfig
from consumer.kill_points import ENV as KILL_POINT
from consumer.lakehouse.offsets import delta_applied
from consumer.lakehouse.progress import consistent_ts
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka, write_ground_truth
from consumer.simulate.truth import changelog_images, delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.lookups import group_offsets
from consumer.spark import engine
from consumer.testing.broker import EmbeddedBroker

pytestmark = [pytest.mark.spark, pytest.mark.e2e, pytest.mark.slow]
# several batches per run, and a run reads little ahead of what it can apply (its first MERGE comes early)
BUDGET = {"max_batch_records": 500, "pending_bytes": 50000}
BATCH_RECORDS = {f"TICDC_CONSUMER_BUDGET_{name.upper()}": str(value) for name, value in BUDGET.items()}
Run = tuple[subprocess.Popen[str], Path]  # a command and its log
STOP_SPARK = "executor-merges:1:TERM"  # a query that runs until stopped stops cleanly at its first MERGEs


def _produce(broker: EmbeddedBroker, topic: str, rows: int) -> Workload:
    workload = Workload(WorkloadConfig(rows=rows, tables=3, partitions=3, dispatch="primary-key"))
    produce_to_kafka(workload, MessageEncoder(), broker.bootstrap_servers, topic)
    return workload


def _loop(broker: EmbeddedBroker, topic: str, root: Path, env: Mapping[str, str] | None = None) -> Run:
    """A loop engine `run` of the group `<topic>.g` until idle, not waited for."""
    log = root.parent / f"loop-{time.monotonic_ns()}.log"
    env = {**BATCH_RECORDS, **(env or {})}
    return start_run(broker.bootstrap_servers, topic, f"{topic}.g", f"delta:{root}", log, 1, env=env), log


def _spark(
    broker: EmbeddedBroker,
    topic: str,
    root: Path,
    checkpoint: Path,
    *,
    until_idle: bool = True,
    env: Mapping[str, str] | None = None,
) -> Run:
    """A `run --engine spark` of the same group into the same lake, in its own process group (a kill takes
    its JVM and Python workers too); without `until_idle`, a query that runs until stopped."""
    command = [sys.executable, "-m", "consumer", "run", "--engine", "spark"]
    command += ["--source", f"kafka://{broker.bootstrap_servers}/{topic}", "--group", f"{topic}.g"]
    command += ["--sink", f"delta:{root}", "--checkpoint", str(checkpoint)]
    command += ["--until-idle", "2"] if until_idle else []
    log = root.parent / f"spark-{time.monotonic_ns()}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            command,
            env={**os.environ, **BATCH_RECORDS, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
    return process, log


def _spark_config(broker: EmbeddedBroker, topic: str, root: Path, checkpoint: Path) -> RunConfig:
    """What `_spark`'s command runs (until idle), for a run in this process."""
    return spark_config(broker, topic, f"{topic}.g", root, checkpoint, BUDGET)


def _changelog_commits(root: Path) -> int:
    return sum(1 for _ in root.glob("*/*/changelog/_delta_log/*.json"))


def _finish(run: Run) -> str:
    process, log = run
    assert process.wait(600) == 0, log.read_text()[-3000:]
    return log.read_text()


def _killed(run: Run) -> None:
    """The run SIGKILLed itself at its kill point."""
    process, log = run
    assert process.wait(600) == -signal.SIGKILL, log.read_text()[-3000:]


def _summary_rows(log: str) -> int:
    """Changelog rows in a `run` log's summary line: the rows the run applied."""
    found = re.findall(r"^\d+ records, (\d+) changelog rows", log, flags=re.MULTILINE)
    assert found, log[-2000:]
    return int(found[-1])


def _mirrors_behind(root: Path, group: str, topic: str) -> bool:
    """Whether some mirror lacks changelog rows (by their app transactions): a MERGE that never ran."""
    partitions = [(topic, partition) for partition in range(3)]
    for changelog in root.glob("*/*/changelog"):
        mirror = changelog.parent / "mirror"
        held = delta_applied(DeltaTable(str(changelog)), group, partitions)
        merged = delta_applied(DeltaTable(str(mirror)), group, partitions) if mirror.exists() else {}
        if any(merged.get(tp, 0) < offset for tp, offset in held.items()):
            return True
    return False


def _check_exact(root: Path, workload: Workload, truth: Any, reference: Path) -> None:
    assert differences(delta_mirror_state(root, [t.schema for t in workload.tables]), truth) == []
    assert changelog_duplicates(root) == 0
    assert changelog_rows(root) == changelog_images(workload.config)
    assert consistent_ts(root) == workload.last_watermark
    assert lake_contents(root) == lake_contents(reference)


@pytest.fixture
def reference(kafka_broker: EmbeddedBroker, tmp_path: Path) -> Callable[[str], Path]:
    """`reference(topic)`: a lake one loop engine made of the whole stream, alone."""

    def made(topic: str) -> Path:
        root = tmp_path / "reference"
        code, log = run_to_end(kafka_broker, topic, f"{topic}.ref", f"delta:{root}", tmp_path / "ref")
        assert code == 0, log.read_text()[-3000:]
        return root

    return made


def test_the_engines_take_turns_on_one_lake_and_it_ends_exact(
    spark: SparkSession, kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    """loop -> spark -> loop -> spark (its checkpoint again, behind the lake now; in this process, on the
    session, as a fresh driver would) -> loop, each stopped cleanly part-way but the last two: each applies
    exactly the rows the lake lacks (its summary counts them), and the last loop run finds nothing to do."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=5000)  # four runs, each stopped part-way but the last
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root, checkpoint = tmp_path / "lake", tmp_path / "checkpoint"
    images = changelog_images(workload.config)
    written = [0]

    def applied_its_share(applied: int) -> None:
        """The run applied some of the stream, the rows its summary counts (none twice)."""
        rows = changelog_rows(root)
        assert written[-1] < rows <= images, (written, rows, images)
        assert applied == rows - written[-1]
        written.append(rows)

    # each stops itself cleanly (SIGTERM) at its first MERGE: part-way, however loaded
    loop_stopped = {KILL_POINT: "mirror-merge:1:TERM"}
    applied_its_share(_summary_rows(_finish(_loop(kafka_broker, topic, root, env=loop_stopped))))
    stopped = _spark(kafka_broker, topic, root, checkpoint, until_idle=False, env={KILL_POINT: STOP_SPARK})
    applied_its_share(_summary_rows(_finish(stopped)))
    applied_its_share(_summary_rows(_finish(_loop(kafka_broker, topic, root, env=loop_stopped))))
    assert written[-1] < images
    config = _spark_config(kafka_broker, topic, root, checkpoint)
    applied_its_share(engine.run(config, until_idle=2.0, spark=spark).rows)
    assert written[-1] == images
    # the Spark engine commits the group's offsets as a member would: Kafka's lag for the group is none
    offsets = group_offsets(kafka_broker.bootstrap_servers, topic, [f"{topic}.g"])[f"{topic}.g"]
    assert {tp: at.committed for tp, at in offsets.items()} == {tp: at.end for tp, at in offsets.items()}
    before = versions(root)
    assert _summary_rows(_finish(_loop(kafka_broker, topic, root))) == 0
    assert versions(root) == before  # the lake's records say the stream is applied: nothing is again
    assert differences(delta_mirror_state(root, [t.schema for t in workload.tables]), truth) == []
    assert changelog_duplicates(root) == 0
    assert consistent_ts(root) == workload.last_watermark


def test_each_engine_takes_over_from_the_other_killed_before_its_mirror_merges(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path, reference: Callable[[str], Path]
) -> None:
    """A loop engine SIGKILLed between a changelog commit and its mirror's MERGE; a Spark engine (a new
    checkpoint) takes over, and is SIGKILLed between a progress record and its executors' MERGEs; a loop
    engine takes over from that and completes the stream: each first MERGEs what its predecessor left."""
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=4000)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root, group = tmp_path / "lake", f"{topic}.g"

    _killed(_loop(kafka_broker, topic, root, env={KILL_POINT: "mirror-merge:4"}))
    assert _mirrors_behind(root, group, topic)
    after_loop = changelog_rows(root)
    checkpoint = tmp_path / "checkpoint"
    _killed(_spark(kafka_broker, topic, root, checkpoint, env={KILL_POINT: "executor-merges:3"}))
    assert _mirrors_behind(root, group, topic)
    assert after_loop < changelog_rows(root) < changelog_images(workload.config)
    _finish(_loop(kafka_broker, topic, root))
    _check_exact(root, workload, truth, reference(topic))
