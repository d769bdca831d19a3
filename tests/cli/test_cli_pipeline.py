"""The command line end to end: simulate -> Kafka -> capture -> run (file source) -> ground truth."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from consumer.simulate.truth import differences, load_truth, replay_changelog
from consumer.testing.broker import EmbeddedBroker


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "consumer", *args], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _jsonl_output(root: Path) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    rows = {
        f"{p.parent.name}.{p.stem}": [json.loads(x) for x in p.read_text().splitlines()]
        for p in root.glob("*/*.jsonl")
    }
    ddls = [json.loads(x) for x in (root / "_ddl.jsonl").read_text().splitlines()]
    return rows, ddls


def test_simulate_capture_and_run_reproduce_the_ground_truth(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic = kafka_topic(3)
    truth_path, capture = tmp_path / "truth.json", tmp_path / "capture.jsonl"
    produced = _cli(
        "simulate",
        "--brokers",
        kafka_broker.bootstrap_servers,
        "--topic",
        topic,
        "--rows",
        "3000",
        "--encoding",
        "avro",
        "--compression",
        "lz4",
        "--truth",
        str(truth_path),
    )
    assert "3000 DML" in produced.stdout
    captured = _cli(
        "capture",
        "--brokers",
        kafka_broker.bootstrap_servers,
        "--topic",
        topic,
        "--out",
        str(capture),
        "--idle-seconds",
        "2",
    )
    assert f"captured {sum(1 for _ in capture.open())} records" in captured.stdout
    out = tmp_path / "out"
    ran = _cli("run", "--source", f"file:{capture}", "--sink", f"jsonl:{out}", "--until-idle", "0.5")
    assert "0 dead letters" in ran.stdout
    rows, ddls = _jsonl_output(out)
    assert differences(replay_changelog(rows, ddls), load_truth(truth_path)) == []
