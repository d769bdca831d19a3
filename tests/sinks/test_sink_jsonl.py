"""The JSON-lines sink shared by the members of a group: no member's write is taken for a torn line."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import msgspec

from consumer.batches.changes import table_changes
from consumer.errors import RecordLocation
from consumer.protocol.model import DDL, Column, DataType, DDLType, DMLType, Index, TableSchema
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.jsonl import JsonLinesSink
from consumer.state.schema_cache import snapshot_schemas
from consumer.testing.messages import raw_dml

WRITES, LINES = 150, 50
DDL_TRUNCATE = DDL(type=DDLType.TRUNCATE, sql="TRUNCATE TABLE t", commit_ts=1, build_ts=0)


def test_members_appending_to_one_file_at_once_lose_no_line(tmp_path: Path) -> None:
    path = tmp_path / "shop" / "orders.jsonl"
    pad = "x" * 2000  # long writes: a reader sees one half-written more often

    def member(name: str) -> None:
        for write in range(WRITES):
            lines = [json.dumps({"member": name, "write": write, "pad": pad}).encode()] * LINES
            JsonLinesSink._append(path, lines)

    threads = [threading.Thread(target=member, args=(name,)) for name in "abc"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    counts = Counter((row["member"], row["write"]) for row in rows)
    assert len(rows) == 3 * WRITES * LINES
    assert set(counts.values()) == {LINES} and len(counts) == 3 * WRITES


def test_a_torn_last_line_is_dropped_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "orders.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2')
    JsonLinesSink._append(path, [b'{"a": 3}'])
    assert path.read_bytes() == b'{"a": 1}\n{"a": 3}\n'


def _schema(table: str, version: int) -> TableSchema:
    columns = (Column("id", DataType("int", length=11), nullable=False),)
    return TableSchema(
        database="shop",
        table=table,
        table_id=1,
        version=version,
        columns=columns,
        indexes=(Index("primary", True, True, False, ("id",)),),
    )


def test_members_recording_schemas_at_once_keep_every_schema(tmp_path: Path) -> None:
    """Each member merges what it learned into the shared schema file; none may overwrite another's."""
    rounds = 40

    def member(table: str) -> None:
        sink = JsonLinesSink(tmp_path)
        for version in range(1, rounds + 1):
            snapshot = msgspec.msgpack.encode([_schema(table, version)])
            sink.apply_ddl(DDLEvent(DDL_TRUNCATE, "shop", table), CommitContext("g", {}, 0, snapshot))

    threads = [threading.Thread(target=member, args=(f"t{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    recorded = JsonLinesSink(tmp_path).recorded_schema_snapshot()
    assert recorded is not None
    keys = {schema.key for schema in snapshot_schemas(recorded)}
    assert keys == {("shop", f"t{i}", version) for i in range(4) for version in range(1, rounds + 1)}


def test_hostile_database_and_table_names_stay_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "root"
    sink = JsonLinesSink(root)
    for database, table in [("../../x", "/abs/path"), ("..", "_ddl"), ("a/b", "..")]:
        schema = TableSchema(
            database=database,
            table=table,
            table_id=1,
            version=1,
            columns=(Column("id", DataType("int", length=11), nullable=False),),
            indexes=(Index("primary", True, True, False, ("id",)),),
        )
        raw = raw_dml(schema, DMLType.INSERT, {"id": 5}, commit_ts=7)
        sink.write(table_changes(TableCodec(schema), [(raw, RecordLocation("t", 0, 1))]), CommitContext("g"))
    written = sorted(str(p.relative_to(root)) for p in root.rglob("*.jsonl"))
    assert written == ["a~2Fb/~2E..jsonl", "~2E./~5Fddl.jsonl", "~2E.~2F..~2Fx/~2Fabs~2Fpath.jsonl"]
    assert [p for p in tmp_path.iterdir()] == [root]
    assert json.loads((root / "a~2Fb" / "~2E..jsonl").read_text())["id"] == 5
