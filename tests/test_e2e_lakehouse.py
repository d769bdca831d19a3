"""End to end into the lakehouse on the real broker: simulator -> Kafka -> `run` -> Delta, checked against
the simulator's ground truth (mirror) and for duplicates (changelog, by topic/partition/offset)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from consumer.protocol.codec import MessageEncoder
from consumer.simulate.output import produce_to_kafka, write_ground_truth
from consumer.simulate.truth import arrow_table_rows, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.delta import consistent_ts, table_dir, table_paths
from consumer.testing.broker import EmbeddedBroker

FAST_GROUP_ENV = {
    "TICDC_CONSUMER_KAFKA_SESSION_TIMEOUT_MS": "1000",
    "TICDC_CONSUMER_KAFKA_HEARTBEAT_INTERVAL_MS": "100",
}


def _produce(
    broker: EmbeddedBroker, topic: str, encoding: str = "json", compression: str = "none", **options: Any
) -> Workload:
    workload = Workload(WorkloadConfig(**{"rows": 4000, "tables": 3, "partitions": 3, **options}))
    produce_to_kafka(workload, MessageEncoder(encoding, compression), broker.bootstrap_servers, topic)  # type: ignore[arg-type]
    return workload


def _run(
    broker: EmbeddedBroker, topic: str, root: Path, group: str, *extra: str, wait: bool = True
) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "consumer",
        "run",
        "--source",
        f"kafka://{broker.bootstrap_servers}/{topic}",
        "--group",
        group,
        "--sink",
        f"delta:{root}",
        "--until-idle",
        "3",
        *extra,
    ]
    env = {**os.environ, **FAST_GROUP_ENV, "TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": "1000"}
    if not wait:
        return subprocess.Popen(
            command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True
        )
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _mirror_state(root: Path, workload: Workload) -> dict[str, Any]:
    state = {}
    for table in workload.tables:
        schema = table.schema
        path = table_dir(root, schema.database, schema.table) / "mirror"
        rows = DeltaTable(str(path)).to_pyarrow_table() if path.exists() else None
        state[f"{schema.database}.{schema.table}"] = (
            arrow_table_rows(rows, schema) if rows is not None else {}
        )
    return state


def _changelog_duplicates(root: Path) -> int:
    duplicates = 0
    for path in table_paths(root, include_ddl_log=False):
        if path.name != "changelog":
            continue
        keys = DeltaTable(str(path)).to_pyarrow_table(
            columns=["_topic", "_partition", "_offset", "_change_type"]
        )
        grouped = keys.group_by(keys.column_names).aggregate([([], "count_all")])
        duplicates += pc.sum(pc.subtract(grouped["count_all"], 1)).as_py() or 0
    return duplicates


def _ddl_types(root: Path) -> set[str]:
    return set(DeltaTable(str(root / "_ddl")).to_pyarrow_table(columns=["type"])["type"].to_pylist())


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
    assert _changelog_duplicates(tmp_path / "lake") == 0
    assert _ddl_types(tmp_path / "lake") == {"CREATE", "ALTER", "CINDEX", "TRUNCATE", "RENAME", "ERASE"}
    assert consistent_ts(tmp_path / "lake") == workload.last_watermark


def test_sigkill_at_several_points_then_restart_ends_exact(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    workload = _produce(kafka_broker, topic, rows=15000, dispatch="primary-key")
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    root = tmp_path / "lake"
    for delay in (2.0, 3.5, 5.0):  # Spark-free startup ~1 s; kills land before, between and during commits
        process = _run(kafka_broker, topic, root, "killed", wait=False)
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        process.wait()  # type: ignore[union-attr]
    _run(kafka_broker, topic, root, "killed")
    assert differences(_mirror_state(root, workload), truth) == []
    assert _changelog_duplicates(root) == 0
