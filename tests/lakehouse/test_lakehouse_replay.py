"""Re-running a stream into the same lakehouse (same group, same root) changes nothing: the recorded resume
offsets are right after every run, and a re-read from the start skips what is already there, across
TRUNCATE, DROP, RENAME and CREATE-after-DROP."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
from lakehouse_checks import changelog_duplicates, versions

from consumer import app
from consumer.config import RunConfig, SinkConfig, SourceConfig
from consumer.protocol.model import DMLType, RawDML
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import write_capture_file, write_ground_truth
from consumer.simulate.truth import delta_mirror_state, differences
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.delta import DeltaSink
from consumer.sources.base import RebalanceListener
from consumer.sources.capture import read_capture
from consumer.sources.files import FileSource
from consumer.sources.record import TopicPartition
from consumer.state.machine import ConsumerState

TOPIC = "replay"
GROUP = "replayer"


def _capture(tmp_path: Path) -> tuple[Path, dict[int, int], Workload]:
    """A stream with every DDL type: ALTER, CREATE INDEX, TRUNCATE, RENAME, DROP TABLE, CREATE after DROP."""
    workload = Workload(WorkloadConfig(rows=1500, tables=3, partitions=3, dispatch="primary-key", seed=3))
    path = tmp_path / "capture.jsonl"
    report = write_capture_file(workload, MessageEncoder(), TOPIC, path)
    return path, report.end_offsets, workload


def _config(capture: Path, root: Path, kind: str = "delta") -> RunConfig:
    return RunConfig(
        source=SourceConfig(url=f"file:{capture}", group=GROUP), sink=SinkConfig(url=f"{kind}:{root}")
    )


def _run(capture: Path, root: Path, kind: str = "delta") -> None:
    app.run(_config(capture, root, kind), until_idle=0.5)


def _reread(capture: Path, root: Path, kind: str = "delta") -> None:
    """The same group reading the whole stream again from its first record, whatever was recorded."""
    pipeline = app.build_pipeline(_config(capture, root, kind))
    try:
        pipeline.run(FileSource(capture, listener=_FromTheStart(pipeline.state)), until_idle=0.5)
    finally:
        pipeline.close()


class _FromTheStart(RebalanceListener):
    """Assigns partitions to the state machine without asking the sinks where to resume."""

    def __init__(self, state: ConsumerState) -> None:
        self._state = state

    def on_assign(self, partitions: list[TopicPartition]) -> None:
        self._state.assign(partitions)

    def on_revoke(self, partitions: list[TopicPartition]) -> None:
        self._state.revoke(partitions)


def test_a_complete_run_records_the_offsets_after_its_last_record(tmp_path: Path) -> None:
    capture, ends, _ = _capture(tmp_path)
    _run(capture, tmp_path / "lake")
    recorded = DeltaSink(tmp_path / "lake").recorded_offsets(GROUP)
    assert recorded == {(TOPIC, partition): end for partition, end in ends.items()}


def test_replaying_a_stream_across_a_drop_table_changes_nothing(tmp_path: Path) -> None:
    capture, _, workload = _capture(tmp_path)
    root = tmp_path / "lake"
    _run(capture, root)
    written = versions(root)
    _run(capture, root)
    _reread(capture, root)
    _run(capture, root)
    assert versions(root) == written
    schemas = [table.schema for table in workload.tables]
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    assert differences(delta_mirror_state(root, schemas), truth) == []
    assert changelog_duplicates(root) == 0


def test_replaying_a_stream_into_parquet_changes_nothing(tmp_path: Path) -> None:
    capture, _, _ = _capture(tmp_path)
    root = tmp_path / "lake"
    _run(capture, root, "parquet")
    written = versions(root), _manifests(root)
    _run(capture, root, "parquet")
    _reread(capture, root, "parquet")
    assert (versions(root), _manifests(root)) == written
    decoded = (MessageDecoder().decode(record.value) for record in read_capture(capture))
    images = sum(2 if m.type is DMLType.UPDATE else 1 for m in decoded if isinstance(m, RawDML))
    rows = sum(pq.read_metadata(path).num_rows for path in root.glob("*/*/changelog/*.parquet"))
    assert len(written[1]) == 4 and rows == images  # 4 tables (one dropped, then created again)


def _manifests(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes() for path in root.glob("*/*/changelog/_manifest.json")
    }


def test_the_run_summary_reports_what_the_mirror_merges_read_and_wrote(tmp_path: Path) -> None:
    capture, _, _ = _capture(tmp_path)
    command = [sys.executable, "-m", "consumer", "run", "--source", f"file:{capture}", "--group", GROUP]
    command += ["--sink", f"delta:{tmp_path / 'lake'}", "--until-idle", "0.5"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(
        r"(\d+) mirror MERGEs: (\d+) files scanned, (\d+) skipped, (\d+) rewritten", result.stdout
    )
    assert found is not None, result.stdout
    merges, scanned, skipped, rewritten = map(int, found.groups())
    assert merges > 10 and rewritten > 0 and scanned + skipped >= rewritten
