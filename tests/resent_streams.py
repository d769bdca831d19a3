"""Streams TiCDC sent more than once, and the lakes they make: what the re-sent-change tests share.

A stream is a simulated changefeed's Kafka records per partition (`Sent`); copies of some of them are
inserted at later positions of the same partition, as TiCDC's at-least-once delivery does after a restart,
and each version of the stream is consumed into its own lake, compared with the lake of the stream sent once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from consumer import app
from consumer.config import load_config
from consumer.lakehouse.manifest import manifest_files
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import entry_uri, read_delta, read_mirror, tables
from consumer.pipeline.stats import PipelineStats
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import DDL, DML, Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import DebeziumStream, StreamWriter, encoded
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord

TOPIC = "cdc"
GROUP = "resends"
MODE = "changelog,mirror,history"


@dataclass(frozen=True)
class Sent:
    """One Kafka record of the stream as first sent: its kind (DML, DDL, ...), commit ts (0: none), key and
    value."""

    kind: str
    commit_ts: int
    key: bytes | None
    value: bytes | None


Stream = dict[int, list[Sent]]  # per partition, in offset order


def simulated(config: WorkloadConfig, protocol: str = "simple") -> tuple[Stream, list[int]]:
    """The workload's records per partition, and its WATERMARKs' commit ts (as of which lakes compare)."""
    writer: StreamWriter = MessageEncoder("json")
    if protocol == "debezium":
        writer = DebeziumStream(DebeziumEncoder(DebeziumOptions(tidb_extension=True)))
    stream: Stream = {}
    marks: list[int] = []
    for record, (key, value) in encoded(Workload(config), writer):
        message = record.message
        commit_ts = message.commit_ts if isinstance(message, DML | DDL | Watermark) else 0
        if isinstance(message, Watermark) and record.partition == 0:
            marks.append(commit_ts)
        stream.setdefault(record.partition, []).append(Sent(type(message).__name__, commit_ts, key, value))
    return stream, marks


def with_copies(stream: Stream, partition: int, start: int, end: int, at: int, ddls: bool = True) -> Stream:
    """`stream` with copies of partition `partition`'s changes at positions `start:end` inserted before
    position `at` (>= `end`: a copy comes after what it copies); `ddls`: copy the DDLs among them too."""
    kinds = ("DML", "DDL") if ddls else ("DML",)
    records = stream[partition]
    copies = [sent for sent in records[start:end] if sent.kind in kinds]
    return {**stream, partition: [*records[:at], *copies, *records[at:]]}


def write(stream: Stream, path: Path) -> Path:
    """A capture file of `stream`, with the offsets a broker would give its records."""
    with path.open("wb") as file:
        write_capture(
            (
                SourceRecord(
                    topic=TOPIC,
                    partition=partition,
                    offset=offset,
                    key=sent.key,
                    value=sent.value,
                    timestamp=None,
                )
                for partition, records in sorted(stream.items())
                for offset, sent in enumerate(records)
            ),
            file,
        )
    return path


def consume(capture: Path, root: Path, protocol: str = "simple", kind: str = "delta") -> PipelineStats:
    """`run` of the capture into a lake at `root` (`kind`: delta or parquet), in this process, until it has
    read it all."""
    sink = {"url": f"{kind}:{root}", **({"mode": MODE} if kind == "delta" else {})}
    config = load_config(
        environ={},
        overrides={
            "source": {"url": f"file:{capture}", "group": GROUP},
            "decode": {"protocol": protocol},
            "sink": sink,
            "parallelism": {"decode_workers": 0},
        },
    )
    return app.run(config, until_idle=0.3)


def parquet_lake(root: Path) -> dict[str, list[str]]:
    """Every table's committed Parquet rows, order aside and offsets aside."""
    lakehouse = LakeRoot.of(root)
    found = {}
    for entry in tables(lakehouse):
        names = manifest_files(lakehouse, entry.location) or []
        parts = [pq.read_table(name).drop_columns(["_offset"]) for name in names]
        rows = pa.concat_tables(parts, promote_options="permissive") if parts else None
        found[entry.location] = [] if rows is None else sorted(map(repr, _rows(rows)))
    return found


def lake(root: Path) -> dict[tuple[str, str], list[str]]:
    """Every table's changelog, mirror and history rows, order aside and offsets aside (copies of a
    stream take later offsets than the stream sent once gave the same changes)."""
    found: dict[tuple[str, str], list[str]] = {}
    lakehouse = LakeRoot.of(root)
    for entry in tables(lakehouse):
        for kind in ("changelog", "mirror", "history"):
            table = lakehouse.open(entry_uri(lakehouse, entry, kind))
            if table is not None:
                rows = read_delta(lakehouse, table)
                rows = rows.drop_columns([name for name in ("_offset",) if name in rows.column_names])
                found[(entry.location, kind)] = sorted(map(repr, _rows(rows)))
    return found


def as_of(root: Path, names: Sequence[tuple[str, str]], marks: Sequence[int]) -> dict[Any, list[str]]:
    """Each table's mirror as of each watermark (None where it did not exist then)."""
    found: dict[Any, list[str]] = {}
    for mark in marks:
        for database, table in names:
            rows = read_mirror(root, database, table, as_of_tso=mark)
            found[(database, table, mark)] = [] if rows is None else sorted(map(repr, _rows(rows)))
    return found


def point(root: Path) -> int | None:
    return consistent_ts(root, GROUP)


def _rows(rows: pa.Table) -> list[dict[str, Any]]:
    return [dict(sorted(row.items())) for row in rows.to_pylist()]


def table_names(config: WorkloadConfig) -> list[tuple[str, str]]:
    """Every name a table of the workload had."""
    names = set()
    for record in Workload(config).records():
        schema = getattr(record.message, "table_schema", None)
        if schema is not None:
            names.add((schema.database, schema.table))
    return sorted(names)


def differences(one: Mapping[Any, Any], other: Mapping[Any, Any]) -> list[Any]:
    """The keys whose rows differ, with how many each side has."""
    return [
        (key, len(one.get(key, [])), len(other.get(key, [])))
        for key in sorted(set(one) | set(other), key=repr)
        if one.get(key) != other.get(key)
    ]
