"""Where a simulated stream goes: a Kafka topic (real producer) or a capture file; plus its ground truth."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from confluent_kafka import KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from consumer.protocol.model import DML, Bootstrap, Message, TableSchema, Watermark
from consumer.render import row_object
from consumer.simulate.workload import StreamRecord, Workload
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord


class RecordEncoder(Protocol):
    """Turns a message into a record value: a `MessageEncoder`, or a `LargeMessageEncoder` around one."""

    def encode(self, message: Message, schema: TableSchema | None = None) -> bytes: ...


@dataclass
class SimulationReport:
    """What was produced, with the offsets a partition's records get in produce order (one producer)."""

    records: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    end_offsets: dict[int, int] = field(default_factory=dict)
    offsets: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (kind, partition) -> offsets

    def count(self, record: StreamRecord) -> int:
        """Count one record; returns its offset in its partition."""
        self.records += 1
        kind = type(record.message).__name__
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        offset = self.end_offsets.get(record.partition, 0)
        self.end_offsets[record.partition] = offset + 1
        self.offsets.setdefault((kind, record.partition), []).append(offset)
        return offset


def record_key(record: StreamRecord) -> bytes | None:
    """TiCDC's keys: empty for DML and BOOTSTRAP (async producer), null for DDL and WATERMARK (spec §1.1)."""
    return b"" if isinstance(record.message, DML | Bootstrap) else None


def encoded(workload: Workload, encoder: RecordEncoder) -> Iterable[tuple[StreamRecord, bytes]]:
    for record in workload.records():
        yield record, encoder.encode(record.message, record.schema)


def produce_to_kafka(
    workload: Workload,
    encoder: RecordEncoder,
    bootstrap_servers: str,
    topic: str,
    *,
    extra_config: dict[str, Any] | None = None,
) -> SimulationReport:
    """Produce the whole stream; the final WATERMARKs go alone so every partition ends on one."""
    ensure_topic(bootstrap_servers, topic, workload.config.partitions)
    producer = Producer(
        {"bootstrap.servers": bootstrap_servers, "linger.ms": 5, "acks": "all", **(extra_config or {})}
    )
    report = SimulationReport()
    failures: list[str] = []

    def delivered(error: Any, _message: Any) -> None:
        if error is not None:
            failures.append(str(error))

    pending: list[tuple[StreamRecord, bytes]] = []
    for item in encoded(workload, encoder):
        pending.append(item)
        if len(pending) > workload.config.partitions:
            _send(producer, topic, *pending.pop(0), delivered, report)
    producer.flush()
    for item in pending:  # the closing watermark broadcast, one record per produce+flush
        _send(producer, topic, *item, delivered, report)
        producer.flush()
    if failures:
        raise KafkaException(f"{len(failures)} records were not delivered: {failures[0]}")
    return report


def _send(
    producer: Producer,
    topic: str,
    record: StreamRecord,
    value: bytes,
    callback: Any,
    report: SimulationReport,
) -> None:
    while True:
        try:
            producer.produce(
                topic, value=value, key=record_key(record), partition=record.partition, on_delivery=callback
            )
            break
        except BufferError:  # local queue full: let deliveries drain
            producer.poll(0.1)
    producer.poll(0)
    report.count(record)


def ensure_topic(bootstrap_servers: str, topic: str, partitions: int) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap_servers})
    if topic in admin.list_topics(timeout=10).topics:
        return
    future = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic]
    try:
        future.result(timeout=10)
    except KafkaException as exc:
        if "TOPIC_ALREADY_EXISTS" not in str(exc):
            raise


def write_capture_file(
    workload: Workload, encoder: RecordEncoder, topic: str, path: Path
) -> SimulationReport:
    """The same stream as a capture file, with the offsets a broker would have assigned."""
    report = SimulationReport()

    def records() -> Iterable[SourceRecord]:
        for record, value in encoded(workload, encoder):
            yield SourceRecord(
                topic=topic,
                partition=record.partition,
                offset=report.count(record),
                key=record_key(record),
                value=value,
                timestamp=None,
            )

    with path.open("wb") as fp:
        write_capture(records(), fp)
    return report


def write_ground_truth(workload: Workload, path: Path) -> dict[str, Any]:
    """Every table's expected final state at the last watermark, values rendered as `decode` prints them."""
    truth = workload.ground_truth()
    rendered = {
        "watermark": truth["watermark"],
        "tables": {
            name: {"dropped": table["dropped"], "rows": [row_object(r) for r in table["rows"]]}
            for name, table in truth["tables"].items()
        },
    }
    path.write_text(json.dumps(rendered, indent=1, ensure_ascii=False))
    return rendered


class WatermarkHeartbeat:
    """Re-broadcasts the last WATERMARK every `interval` seconds, as TiCDC's checkpoint ticker does when the
    upstream is idle. Without it, a consumer that takes over a partition at its end never sees a watermark
    there. Use as a context manager around the consumers."""

    def __init__(
        self,
        workload: Workload,
        encoder: RecordEncoder,
        bootstrap_servers: str,
        topic: str,
        interval: float = 0.5,
    ) -> None:
        self._value = encoder.encode(Watermark(commit_ts=workload.last_watermark, build_ts=0))
        self._partitions = workload.config.partitions
        self._producer = Producer({"bootstrap.servers": bootstrap_servers, "linger.ms": 0})
        self._topic = topic
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="watermark-heartbeat", daemon=True)

    def __enter__(self) -> WatermarkHeartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
        self._producer.flush(10)

    def _beat(self) -> None:
        while not self._stop.wait(self._interval):
            for partition in range(self._partitions):
                self._producer.produce(self._topic, value=self._value, partition=partition)
            self._producer.flush(5)
