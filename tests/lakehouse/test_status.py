"""`ticdc-consumer status`: a lake's own account of how far it is (tables, consistent point, each group's
offsets and lag, rows left waiting at the last stop, dead letters), checked against what was produced."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pytest
from click.testing import CliRunner
from deltalake import write_deltalake
from lakehouse_checks import run_to_end

from consumer.cli import main
from consumer.errors import DeadLetter, RecordLocation
from consumer.lakehouse.progress import PROGRESS_SCHEMA, ProgressLog, consistent_ts
from consumer.lakehouse.status import read_status
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import read_changelog
from consumer.protocol.model import DML, DMLType
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.dead_letter import DeadLetterFile, DeadLetterObjects, DeadLetterTopic, count_letters
from consumer.state.machine import Unapplied
from consumer.testing.broker import EmbeddedBroker

HOUR_MS = 3_600_000
# hostile records after the stream, per partition: (value, the reason code its dead letter gets)
HOSTILE = {0: [(b"{not json", "malformed-message")], 1: [(b"\x00not a message", "compression-invalid")] * 2}


def _status(*args: str, code: int = 0) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["status", "--json", *args])
    assert result.exit_code == code, result.output
    parsed: dict[str, Any] = json.loads(result.stdout)
    return parsed


def _partitions(status: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["partition"]: p for p in status["partitions"]}


# -- what the pipeline records at a stop ---------------------------------------------------------------
def _stop(partition: int, waiting: int, held: int) -> Unapplied:
    return Unapplied(("t", partition), waiting, 0, 0, None, held, ())


def test_a_stop_records_what_each_partition_left_unapplied_and_compaction_keeps_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("consumer.lakehouse.progress.COMPACT_EVERY", 3)
    log = ProgressLog(LakeRoot.of(tmp_path))
    log.record("g", {("t", 0): 5, ("t", 1): 7}, {}, stopped=(_stop(1, 3, 2),))
    assert {tp: (s.waiting_rows, s.held_rows) for tp, s in log.last_stops("g").items()} == {
        ("t", 0): (0, 0),  # a partition the stop does not name left nothing
        ("t", 1): (3, 2),
    }
    log.record("g", {("t", 0): 9}, {})  # no stop: the last stop stands
    log.record("g", {("t", 0): 9}, {}, stopped=(_stop(0, 4, 0),))
    assert log.last_stops("g")[("t", 0)].waiting_rows == 4
    compaction = LakeRoot.of(tmp_path).existing(log.progress_uri).history(1)[0]  # the third append's
    assert compaction["operationParameters"]["mode"] == "Overwrite"
    assert {tp: s.waiting_rows for tp, s in log.last_stops("g").items()} == {("t", 0): 4, ("t", 1): 3}
    assert {tp: p.resume_offset for tp, p in log.partitions("g").items()} == {("t", 0): 9, ("t", 1): 7}
    assert log.last_stops("another group") == {}


def test_a_progress_table_older_than_the_stop_counts_gains_them(tmp_path: Path) -> None:
    log = ProgressLog(LakeRoot.of(tmp_path))
    added = ("waiting_rows", "held_rows", "topic_partitions")
    old_schema = pa.schema([f for f in PROGRESS_SCHEMA if f.name not in added])
    row = {"group": "g", "topic": "t", "partition": 0, "resume_offset": 3, "applied_ts": 8, "member": "m"}
    write_deltalake(
        log.progress_uri, pa.Table.from_pylist([{**row, "recorded_at": datetime.now(UTC)}], old_schema)
    )
    assert log.last_stops("g") == {} and log.topic_partitions("g") == {}
    assert consistent_ts(tmp_path, "g") == 8
    log.record("g", {("t", 0): 4}, {}, stopped=())
    assert log.last_stops("g")[("t", 0)].held_rows == 0
    assert log.partitions("g")[("t", 0)].applied_ts == 8
    assert consistent_ts(tmp_path, "g") == 8  # the old rows claim no partition count
    log.record("g", {("t", 0): 4}, {}, topic_partitions={"t": 2})
    assert log.topic_partitions("g") == {"t": 2} and consistent_ts(tmp_path, "g") is None


def test_status_lists_the_partitions_no_member_recorded_yet(tmp_path: Path) -> None:
    """A member that started early recorded its partition 2 of 3: the status shows partitions 0 and 1
    without a record, which is why the lake has no consistent point yet."""
    ProgressLog(LakeRoot.of(tmp_path)).record("g", {("t", 2): 6}, {("t", 2): 9}, topic_partitions={"t": 3})
    status = read_status(str(tmp_path))
    assert status.consistent_ts is None
    listed = [(p.group, p.topic, p.partition, p.lake_offset, p.applied_ts) for p in status.partitions]
    assert listed == [("g", "t", 0, None, None), ("g", "t", 1, None, None), ("g", "t", 2, 6, 9)]


# -- dead letters --------------------------------------------------------------------------------------
def _letter(partition: int, offset: int, code: str) -> DeadLetter:
    return DeadLetter(RecordLocation("t", partition, offset), f"{code}: why", b"v", code)


def test_dead_letters_are_counted_per_reason_code_each_record_once(tmp_path: Path) -> None:
    letters = [_letter(0, 1, "a"), _letter(0, 2, "b"), _letter(1, 1, "a"), _letter(0, 1, "a")]
    first, second = DeadLetterFile(tmp_path / "dl.jsonl"), DeadLetterFile(tmp_path / "dl.jsonl")
    for index, letter in enumerate(letters):  # two members appending, one replaying a record
        (first if index % 2 else second).write(letter)
    objects = DeadLetterObjects(f"file://{tmp_path}/objects")
    for letter in letters:
        objects.write(letter)
    with (tmp_path / "dl.jsonl").open("ab") as torn:
        torn.write(b'{"topic": "t", "parti')
    assert count_letters(str(tmp_path / "dl.jsonl")) == {"a": 2, "b": 1}
    assert count_letters(f"file://{tmp_path}/objects") == {"a": 2, "b": 1}
    assert count_letters(str(tmp_path / "none.jsonl")) == {}


def test_a_root_without_a_lakehouse_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["status", "--sink", str(tmp_path)])
    assert result.exit_code == 2
    assert "no lakehouse here" in result.output and "Traceback" not in result.output


# -- end to end ----------------------------------------------------------------------------------------
def _orphan(workload: Workload) -> bytes:
    """A row of a table whose schema nobody announces: it waits for it (held) until its timeout."""
    schema = workload.tables[0].schema
    unknown = msgspec.structs.replace(schema, database="elsewhere", table="unknown", table_id=999_999)
    row = DML(
        type=DMLType.INSERT,
        database="elsewhere",
        table="unknown",
        table_id=999_999,
        commit_ts=workload.last_watermark + 1,
        build_ts=0,
        schema_version=unknown.version,
        data={column.name: None for column in schema.columns},
    )
    return MessageEncoder().encode(row, unknown)


def _run(broker: EmbeddedBroker, topic: str, root: Path, group: str, processes: int) -> int:
    code, log = run_to_end(
        broker, topic, group, f"delta:{root}", root.parent / f"{group}-p{processes}", processes
    )
    assert code in (0, 3), log.read_text()[-3000:]
    return code


@pytest.mark.slow
def test_status_of_a_lake_two_members_wrote_matches_what_was_produced(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, tmp_path: Path
) -> None:
    topic, dlq = kafka_topic(3), kafka_topic(1)
    config = WorkloadConfig(
        rows=1500, tables=3, partitions=3, start_physical_ms=int(time.time() * 1000) - HOUR_MS
    )
    workload = Workload(config)
    produced = produce_to_kafka(workload, MessageEncoder(), kafka_broker.bootstrap_servers, topic)  # type: ignore[arg-type]
    kafka_broker.produce(topic, [(p, None, value) for p, records in HOSTILE.items() for value, _ in records])
    ends = {p: end + len(HOSTILE.get(p, [])) for p, end in produced.end_offsets.items()}
    root, group = tmp_path / "lake", f"{topic}.status"
    assert _run(kafka_broker, topic, root, group, processes=2) == 0

    kafka = ["--brokers", kafka_broker.bootstrap_servers, "--topic", topic]
    status = _status("--sink", str(root), *kafka)
    assert status["consistent_ts"] == consistent_ts(root) == workload.last_watermark
    assert HOUR_MS / 1000 - 60 < status["consistent_age_s"] < HOUR_MS / 1000 + 300
    expected_letters: dict[str, int] = {}
    for records in HOSTILE.values():
        for _, code in records:
            expected_letters[code] = expected_letters.get(code, 0) + 1
    assert status["dead_letters"] == {
        "destination": f"file:{root / '_dead_letters.jsonl'}",
        "total": sum(expected_letters.values()),
        "by_reason_code": expected_letters,
    }
    for partition, found in _partitions(status).items():
        assert found["group"] == group and found["topic"] == topic
        at_end = {"lake_offset": ends[partition], "committed_offset": ends[partition]}
        assert {key: found[key] for key in at_end} == at_end
        assert (found["end_offset"], found["lag_records"], found["lag_s"]) == (ends[partition], 0, 0.0)
        assert (found["waiting_rows"], found["held_rows"]) == (0, 0)
    live = {(t.schema.database, t.schema.table): t for t in workload.tables if not t.dropped}
    assert {(t["database"], t["table"]): t["mirror_rows"] for t in status["tables"]} == {
        name: len(table.rows) for name, table in live.items()
    }
    for table in status["tables"]:
        changelog = read_changelog(root, table["database"], table["table"], ["_commit_ts"])
        assert changelog is not None and table["changelog_rows"] == changelog.num_rows
        assert table["last_change_ts"] <= workload.last_watermark

    assert _status("--sink", str(root), "--max-lag-s", str(HOUR_MS / 1000 + 600))["consistent_ts"]
    _status("--sink", str(root), "--max-lag-s", "60", code=3)

    # more records: a row whose schema never comes, on partition 2
    kafka_broker.produce(topic, [(2, None, _orphan(workload))])
    behind = _partitions(_status("--sink", f"delta:{root}", *kafka, "--group", group))
    assert [behind[p]["lag_records"] for p in sorted(behind)] == [0, 0, 1]
    assert behind[2]["lag_s"] > HOUR_MS / 1000 - 60  # the age of what the partition applied
    assert _run(kafka_broker, topic, root, group, processes=1) == 3  # it waits, unapplied
    stopped = _status("--sink", str(root), *kafka)
    assert stopped["consistent_ts"] == consistent_ts(root) == workload.last_watermark
    waiting = {
        p: (s["waiting_rows"], s["held_rows"], s["lag_records"]) for p, s in _partitions(stopped).items()
    }
    assert waiting == {0: (0, 0, 0), 1: (0, 0, 0), 2: (0, 1, 1)}
    assert _partitions(stopped)[2]["committed_offset"] == ends[2]  # the held row: read again on restart

    sent_to_topic = DeadLetterTopic(kafka_broker.bootstrap_servers, dlq)
    for letter in (_letter(0, 1, "a"), _letter(0, 1, "a"), _letter(0, 2, "b")):
        sent_to_topic.write(letter)
    sent_to_topic.close()
    in_topic = _status(
        "--sink", str(root), "--dead-letter", f"kafka://{kafka_broker.bootstrap_servers}/{dlq}"
    )
    assert in_topic["dead_letters"]["by_reason_code"] == {"a": 1, "b": 1}
