"""Capture files: a captured topic reads back byte-exact, replays through FileSource; corruption is named."""

from __future__ import annotations

import base64
import io
import json
import re
import uuid
from pathlib import Path

import pytest

from consumer.sources.base import RebalanceListener, Source
from consumer.sources.capture import read_capture, write_capture
from consumer.sources.errors import CaptureFormatError, SourceError
from consumer.sources.files import FileSource
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource, capture_topic
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory

ODD_BYTES = bytes(range(256))
IDLE = 2.0  # see capture_topic: partitions needing an offset lookup start about a second late


def messages(partitions: int, per_partition: int) -> list[tuple[int, bytes | None, bytes | None]]:
    """Keys and values covering null keys, tombstones (null values) and every byte value."""
    produced: list[tuple[int, bytes | None, bytes | None]] = []
    for offset in range(per_partition):
        for partition in range(partitions):
            key = None if offset == 0 else f"k{partition}-{offset}".encode()
            value = None if offset == 1 else ODD_BYTES + f"{partition}-{offset}".encode()
            produced.append((partition, key, value))
    return produced


def position(record: SourceRecord) -> tuple[int, int]:
    return record.partition, record.offset


def sample_records() -> list[SourceRecord]:
    return [
        SourceRecord(topic="t", partition=0, offset=0, timestamp=1, key=None, value=b"\x00\xff"),
        SourceRecord(topic="t", partition=1, offset=7, timestamp=None, key=b"k", value=None),
        SourceRecord(topic="t", partition=0, offset=1, timestamp=2, key=b"", value=b"v"),
        SourceRecord(topic="u", partition=0, offset=5, timestamp=3, key=b"k2", value=b"w"),
    ]


def write_sample(path: Path) -> list[SourceRecord]:
    records = sample_records()
    with path.open("wb") as fp:
        write_capture(records, fp)
    return records


def test_capture_reads_back_every_record(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory, tmp_path: Path
) -> None:
    topic = kafka_topic(partitions=3)
    produced = messages(partitions=3, per_partition=4)
    kafka_broker.produce(topic, produced)
    out = tmp_path / "capture.jsonl"

    count = capture_topic(kafka_broker.bootstrap_servers, topic, out, idle_seconds=IDLE)

    captured = list(read_capture(out))
    assert count == len(captured) == 12
    assert not list(tmp_path.glob(".*partial"))
    with KafkaSource(kafka_broker.bootstrap_servers, [topic], "reader", partitions=ALL_PARTITIONS) as source:
        direct: list[SourceRecord] = []
        while len(direct) < 12:
            direct += source.poll_batch(100, timeout=0.1)
    assert sorted(captured, key=position) == sorted(direct, key=position)
    by_partition = {p: [(r.key, r.value) for r in captured if r.partition == p] for p in range(3)}
    assert by_partition == {p: [(k, v) for q, k, v in produced if q == p] for p in range(3)}


def test_capture_from_a_groups_committed_offsets(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory, tmp_path: Path
) -> None:
    topic = kafka_topic(partitions=2)
    kafka_broker.produce(topic, messages(partitions=2, per_partition=3))
    group = f"group-{uuid.uuid4().hex[:8]}"
    with KafkaSource(kafka_broker.bootstrap_servers, [topic], group, partitions=ALL_PARTITIONS) as source:
        source.commit({(topic, 0): 2})

    count = capture_topic(kafka_broker.bootstrap_servers, topic, tmp_path / "c.jsonl", IDLE, group)

    captured = {(r.partition, r.offset) for r in read_capture(tmp_path / "c.jsonl")}
    assert count == 4
    assert captured == {(0, 2), (1, 0), (1, 1), (1, 2)}


def test_failed_capture_leaves_no_file(kafka_broker: EmbeddedBroker, tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="does not exist"):
        capture_topic(kafka_broker.bootstrap_servers, "absent", tmp_path / "c.jsonl", IDLE)
    assert list(tmp_path.iterdir()) == []


def test_format_is_json_lines_with_standard_base64(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    assert write_capture(sample_records(), buffer) == 4
    first, second = (json.loads(line) for line in buffer.getvalue().splitlines()[:2])
    assert first == {
        "topic": "t",
        "partition": 0,
        "offset": 0,
        "timestamp": 1,
        "key": None,
        "value": base64.b64encode(b"\x00\xff").decode(),
    }
    assert second["value"] is None and second["timestamp"] is None
    path = tmp_path / "sample.jsonl"
    path.write_bytes(buffer.getvalue() + b"\n")  # a trailing blank line is tolerated
    assert list(read_capture(path)) == sample_records()


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        (b"not json", "malformed"),
        (b'{"topic": "t", "partition": 0}', "offset"),
        (b'{"topic": "t", "partition": 0, "offset": 3, "key": "***"}', "base64"),
    ],
)
def test_corrupt_line_names_file_and_line(tmp_path: Path, bad_line: bytes, reason: str) -> None:
    path = tmp_path / "corrupt.jsonl"
    write_sample(path)
    with path.open("ab") as fp:
        fp.write(bad_line + b"\n")
    records = read_capture(path)
    for _ in range(4):
        next(records)
    with pytest.raises(CaptureFormatError, match=f"{re.escape(str(path))}:5: .*{reason}") as failure:
        next(records)
    assert failure.value.line == 5
    assert failure.value.path == path


def test_file_source_replays_a_capture(tmp_path: Path) -> None:
    path = tmp_path / "replay.jsonl"
    records = write_sample(path)
    source: Source = FileSource(path)
    assert source.assignment() == {("t", 0), ("t", 1), ("u", 0)}

    source.pause([("t", 0)])
    unpaused = source.poll_batch(10, timeout=0)
    assert unpaused == [records[1], records[3]]
    assert source.poll_batch(10, timeout=0) == []
    source.resume([("t", 0)])
    assert source.poll_batch(1, timeout=0) == [records[0]]
    assert source.poll_batch(10, timeout=0) == [records[2]]

    assert source.committed([("t", 0)]) == {("t", 0): None}
    source.commit({("t", 0): 2, ("u", 0): 6})
    assert source.committed([("t", 0), ("u", 0)]) == {("t", 0): 2, ("u", 0): 6}
    assert isinstance(source, FileSource) and source.exhausted
    source.close()


def test_file_source_starts_where_on_assign_says(tmp_path: Path) -> None:
    path = tmp_path / "replay.jsonl"
    records = write_sample(path)
    offered: list[list[TopicPartition]] = []

    class StartOffsets(RebalanceListener):
        def on_assign(self, partitions: list[TopicPartition]) -> dict[TopicPartition, int]:
            offered.append(partitions)
            return {("t", 0): 1, ("u", 0): 6}

        def on_revoke(self, partitions: list[TopicPartition]) -> None:
            raise AssertionError("a file is never revoked")

    source = FileSource(path, listener=StartOffsets())
    assert offered == [[("t", 0), ("t", 1), ("u", 0)]]
    assert source.poll_batch(10, timeout=0) == [records[2], records[1]]
    assert source.exhausted
    assert source.assignment() == {("t", 0), ("t", 1), ("u", 0)}
