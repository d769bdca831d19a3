"""Where a simulated stream goes: a Kafka topic (real producer) or a capture file; plus its ground truth."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from consumer.large_messages.encoder import LargeMessageEncoder
from consumer.protocol.debezium.encoder import DebeziumEncoder
from consumer.protocol.model import DDL, DML, Bootstrap, DDLType, Watermark
from consumer.protocol.plain import row_object
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.simulate.workload import StreamRecord, Workload
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord


@dataclass
class SimulationReport:
    """What was produced, with the offsets a partition's records get in produce order (one producer)."""

    records: int = 0
    resent: int = 0  # copies of earlier records (TiCDC's restarts)
    by_kind: dict[str, int] = field(default_factory=dict)
    end_offsets: dict[int, int] = field(default_factory=dict)
    offsets: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (kind, partition) -> offsets

    def count(self, record: StreamRecord) -> int:
        """Count one record; returns its offset in its partition."""
        self.records += 1
        self.resent += record.resent
        kind = type(record.message).__name__
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        offset = self.end_offsets.get(record.partition, 0)
        self.end_offsets[record.partition] = offset + 1
        self.offsets.setdefault((kind, record.partition), []).append(offset)
        return offset


def record_key(record: StreamRecord) -> bytes | None:
    """TiCDC's keys: empty for DML and BOOTSTRAP (async producer), null for DDL and WATERMARK
    (docs/protocols/simple.md §1.1)."""
    return b"" if isinstance(record.message, DML | Bootstrap) else None


KafkaPair = tuple[bytes | None, bytes | None]  # key, value


class AvroStream:
    """The workload as TiCDC's Avro protocol sends it to `topic`: rows only (BOOTSTRAPs do not exist), DDLs
    and checkpoints only in the watermark mode (`encoder.options.watermark`)."""

    def __init__(self, encoder: ConfluentAvroEncoder, topic: str) -> None:
        self.encoder = encoder
        self.topic = topic

    def pairs(self, record: StreamRecord) -> list[KafkaPair]:
        message, watermarks = record.message, self.encoder.options.watermark
        if isinstance(message, DML) and record.schema is not None:
            return [self.encoder.encode_dml(message, record.schema, self.topic)]
        if isinstance(message, DDL) and watermarks:
            return [(None, self.encoder.encode_ddl(message, _action(message)))]
        if isinstance(message, Watermark) and watermarks:
            return [(None, self.encoder.encode_checkpoint(message.commit_ts))]
        return []


class DebeziumStream:
    """The workload as TiCDC's Debezium protocol sends it: no BOOTSTRAPs, WATERMARKs only with the TiDB
    extension (`encoder.options.tidb_extension`)."""

    def __init__(self, encoder: DebeziumEncoder) -> None:
        self.encoder = encoder

    def pairs(self, record: StreamRecord) -> list[KafkaPair]:
        message = record.message
        if isinstance(message, DML) and record.schema is not None:
            return [self.encoder.encode_dml(message, record.schema, message.build_ts)]
        if isinstance(message, DDL):
            return [self.encoder.encode_ddl(message, message.build_ts)]
        if isinstance(message, Watermark) and self.encoder.options.tidb_extension:
            return [self.encoder.encode_watermark(message.commit_ts, message.build_ts)]
        return []


StreamWriter = MessageEncoder | LargeMessageEncoder | AvroStream | DebeziumStream


def _action(ddl: DDL) -> int:
    """The TiDB ActionType number of a simulated DDL (what TiCDC's Avro DDL record sends)."""
    if ddl.type is DDLType.ALTER:
        return 6 if "DROP COLUMN" in ddl.sql.upper() else 5
    actions = {DDLType.CREATE: 3, DDLType.ERASE: 4, DDLType.CINDEX: 7, DDLType.DINDEX: 8}
    return {**actions, DDLType.TRUNCATE: 11, DDLType.RENAME: 14}.get(ddl.type, 1)


def encoded(workload: Workload, writer: StreamWriter) -> Iterable[tuple[StreamRecord, KafkaPair]]:
    """Each Kafka record of the stream, in order: a Simple `MessageEncoder`'s, or another protocol's."""
    for record in workload.records():
        if isinstance(writer, MessageEncoder | LargeMessageEncoder):
            yield record, (record_key(record), writer.encode(record.message, record.schema))
            continue
        for pair in writer.pairs(record):
            yield record, pair


def produce_to_kafka(
    workload: Workload,
    encoder: StreamWriter,
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

    pending: list[tuple[StreamRecord, KafkaPair]] = []
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
    pair: KafkaPair,
    callback: Any,
    report: SimulationReport,
) -> None:
    key, value = pair
    while True:
        try:
            producer.produce(topic, value=value, key=key, partition=record.partition, on_delivery=callback)
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
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise


def write_capture_file(workload: Workload, encoder: StreamWriter, topic: str, path: Path) -> SimulationReport:
    """The same stream as a capture file, with the offsets a broker would have assigned."""
    report = SimulationReport()

    def records() -> Iterable[SourceRecord]:
        for record, (key, value) in encoded(workload, encoder):
            yield SourceRecord(
                topic=topic,
                partition=record.partition,
                offset=report.count(record),
                key=key,
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
        encoder: MessageEncoder,
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
