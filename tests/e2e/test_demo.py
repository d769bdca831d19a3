"""The README's demo, end to end: embedded broker, simulated TiCDC, a mid-stream joiner, Delta and Parquet."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from rich.console import Console

from consumer.demo import DemoSettings, run_demo


@pytest.mark.slow
def test_demo_ends_with_the_ground_truth_and_says_so(spark: SparkSession, tmp_path: Path) -> None:
    out = io.StringIO()
    report = run_demo(tmp_path, DemoSettings(rows=4000, tables=3), Console(file=out, width=200))
    printed = out.getvalue()

    assert report.mirror_differences == []
    assert "equal to the simulator's ground truth" in printed
    late = report.late_join
    assert late.expected_rows > 0
    assert late.delivered_rows == late.expected_rows
    assert 0 < late.held_rows <= late.expected_rows  # it had to wait for a BOOTSTRAP
    assert report.produced.by_kind["DML"] == 4000
    assert report.changelog_rows == report.parquet_rows == report.lakehouse.rows
    assert report.lakehouse.dead_letters == 0
    truth = json.loads((tmp_path / "ground-truth.json").read_text())
    assert report.consistent_ts == truth["watermark"]
    assert f"as of TSO {truth['watermark']}" in printed
    assert "c_time: interval day to second" in printed  # typed rows through Spark
