"""Change events as JSON lines, one file per table: the simplest durable sink (and a debugging aid).

Layout: `<root>/<database>/<table>.jsonl` (names as `consumer.lakehouse.layout.segment`s) and
`<root>/_ddl.jsonl`.

Rows carry their (topic, partition, offset), so redelivered duplicates after a crash are recognisable.
Members of one consumer group may share a root: appends hold an exclusive lock on the file, and the schemas
every member learned are merged into one file so a member taking over a partition can decode its older rows.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path
from typing import BinaryIO

import msgspec

from consumer.batches.changes import TableChanges, typed_rows
from consumer.lakehouse.layout import DDL_LOG, segment
from consumer.lakehouse.progress import merged_snapshots
from consumer.protocol.plain import value_object
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sources.record import TopicPartition

SCHEMAS_FILE = "_schemas.msgpack"


class JsonLinesSink:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._encoder = msgspec.json.Encoder()
        self._codecs: dict[tuple[str, str, int], TableCodec] = {}
        self._recorded = b""

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        codec = self._codecs.get(changes.schema.key)
        if codec is None or codec.schema != changes.schema:
            codec = self._codecs[changes.schema.key] = TableCodec(changes.schema)
        lines = [
            self._encoder.encode({name: value_object(value) for name, value in row.items()})
            for row in typed_rows(changes, codec)
        ]
        self._append(self.root / segment(changes.database) / f"{segment(changes.table)}.jsonl", lines)
        self._record_schemas(context)

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        ddl = event.ddl
        line = {
            "type": ddl.type.value,
            "sql": ddl.sql,
            "commit_ts": ddl.commit_ts,
            "database": event.database,
            "table": event.table,
        }
        self._append(self.root / f"{DDL_LOG}.jsonl", [self._encoder.encode(line)])
        self._record_schemas(context)

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {}  # no resume points: it relies on Kafka commits (at-least-once, duplicates recognisable)

    def recorded_schema_snapshot(self) -> bytes | None:
        path = self.root / SCHEMAS_FILE
        return path.read_bytes() if path.exists() else None

    def _record_schemas(self, context: CommitContext) -> None:
        """Merge this member's schemas into the shared file (other members of the group read it)."""
        if not context.schema_snapshot or context.schema_snapshot == self._recorded:
            return
        with (self.root / f".{SCHEMAS_FILE}.lock").open("a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # two members merging at once would drop one's schemas
            snapshots = (self.recorded_schema_snapshot(), context.schema_snapshot)
            merged = merged_snapshots([snapshot for snapshot in snapshots if snapshot])
            temporary = self.root / f".{SCHEMAS_FILE}.{os.getpid()}.{threading.get_ident()}"
            temporary.write_bytes(merged)
            os.replace(temporary, self.root / SCHEMAS_FILE)
        self._recorded = context.schema_snapshot

    def close(self) -> None:
        return None

    @staticmethod
    def _append(path: Path, lines: list[bytes]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a+b") as file:
            # Members sharing a root: another member's write in progress must not look like a torn line.
            fcntl.flock(file, fcntl.LOCK_EX)
            _drop_torn_line(file)
            file.write(b"".join(line + b"\n" for line in lines))
            file.flush()
            os.fsync(file.fileno())


def _drop_torn_line(file: BinaryIO) -> None:
    """A crash mid-write leaves a partial last line; its rows were never confirmed, so they come again."""
    end = file.seek(0, os.SEEK_END)
    position = end
    while position > 0:
        start = max(0, position - 65536)
        file.seek(start)
        block = file.read(position - start)
        if position == end and block.endswith(b"\n"):
            return
        cut = block.rfind(b"\n")
        if cut >= 0:
            file.truncate(start + cut + 1)
            return
        position = start
    file.truncate(0)
