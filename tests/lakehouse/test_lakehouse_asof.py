"""The lakehouse as of any TSO: simulated streams through the real Delta sink, read back as of every commit
ts and compared with a plain replay of the stream up to it; fresh reads over a lagging mirror; what the
reads look up, remembered per Delta version; a table whose run stopped before its first Delta commit; the
`snapshot` command; TSOs outside the retained range."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import TableNotFoundError
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.batches.changes import stored_name, table_changes
from consumer.cli import main, time_tso
from consumer.errors import RecordLocation
from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.storage import REMEMBERED, LakeRoot, by_version
from consumer.lakehouse.tables import (
    TsoOutOfRangeError,
    mirror_versions,
    read_changelog,
    read_mirror,
    retained_range,
    table_uri,
    tables,
)
from consumer.protocol.model import DDL, DML, DDLType, DMLType, TableSchema, Watermark
from consumer.protocol.table import TableCodec
from consumer.simulate.truth import arrow_table_rows, sent, truth_at
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.delta import DeltaSink
from consumer.testing.messages import raw_dml

TOPIC, GROUP = "t", "g"
META = ["_commit_ts", "_schema_version"]


# -- driving the sink as the pipeline does -------------------------------------------------------------
class _Driver:
    """Feeds a simulated stream to a DeltaSink: rows are written in batches cut at DDLs and WATERMARKs, and
    progress is recorded at every `progress_every`-th WATERMARK (as members do now and then)."""

    def __init__(self, sink: DeltaSink, partitions: int, progress_every: int) -> None:
        self.sink, self.partitions, self.progress_every = sink, partitions, progress_every
        self.offsets = dict.fromkeys(range(partitions), 0)
        self.pending: list[tuple[TableSchema, DML, RecordLocation]] = []
        self.ddls: set[tuple[int, str]] = set()
        self.watermarks = 0
        self.last_watermark = 0

    def feed(self, records: Iterable[StreamRecord]) -> None:
        for record in records:
            location = RecordLocation(TOPIC, record.partition, self.offsets[record.partition])
            self.offsets[record.partition] += 1
            message = record.message
            if isinstance(message, DML) and record.schema is not None:
                self.pending.append((record.schema, message, location))
            elif isinstance(message, DDL) and (message.commit_ts, message.sql) not in self.ddls:
                self.ddls.add((message.commit_ts, message.sql))
                self._flush(message.commit_ts)
                schema = message.table_schema
                assert schema is not None
                self.sink.apply_ddl(DDLEvent(message, schema.database, schema.table), self._context(0))
            elif isinstance(message, Watermark) and record.partition == self.partitions - 1:
                self._flush(message.commit_ts)
                self.watermarks += 1
                self.last_watermark = message.commit_ts
                if self.watermarks % self.progress_every == 0:
                    self._record(message.commit_ts)
        self._record(self.last_watermark)  # a member's last record, on stop

    def _flush(self, resolved_ts: int) -> None:
        for schema, rows in _batches(self.pending):
            located = [
                (raw_dml(schema, d.type, d.data, d.old, commit_ts=d.commit_ts), loc) for d, loc in rows
            ]
            self.sink.write(table_changes(TableCodec(schema), located), self._context(resolved_ts))
        self.pending = []

    def _record(self, watermark: int) -> None:
        applied = {(TOPIC, p): watermark for p in range(self.partitions)}
        offsets = {(TOPIC, p): offset for p, offset in self.offsets.items()}
        self.sink.record_progress(CommitContext(GROUP, offsets, watermark, b"", applied))

    def _context(self, resolved_ts: int) -> CommitContext:
        return CommitContext(GROUP, resolved_ts=resolved_ts)


def _batches(
    pending: list[tuple[TableSchema, DML, RecordLocation]],
) -> Iterator[tuple[TableSchema, list[tuple[DML, RecordLocation]]]]:
    """Rows per table schema version, in stream order."""
    grouped: dict[tuple[str, str, int], tuple[TableSchema, list[tuple[DML, RecordLocation]]]] = {}
    for schema, dml, location in pending:
        grouped.setdefault((schema.database, schema.table, schema.version), (schema, []))[1].append(
            (dml, location)
        )
    yield from grouped.values()


def _stream(root: Path, config: WorkloadConfig, progress_every: int = 1) -> list[StreamRecord]:
    records = sent(Workload(config))
    _Driver(DeltaSink(root), config.partitions, progress_every).feed(records)
    return records


def _commit_points(records: list[StreamRecord]) -> list[int]:
    return sorted({r.message.commit_ts for r in records if isinstance(r.message, DML | DDL)})


def _names(records: list[StreamRecord]) -> set[tuple[str, str]]:
    return {(r.schema.database, r.schema.table) for r in records if r.schema is not None} | {
        (r.message.table_schema.database, r.message.table_schema.table)
        for r in records
        if isinstance(r.message, DDL) and r.message.table_schema is not None
    }


def _differences(root: Path, records: list[StreamRecord], tso: int) -> list[str]:
    """Where the as-of read of every table name of the stream differs from the replay up to `tso`."""
    truth = truth_at(records, tso)
    found = []
    for database, table in sorted(_names(records)):
        name = f"{database}.{table}"
        rows = read_mirror(root, database, table, as_of_tso=tso)
        expected = truth.get(name)
        if expected is None or rows is None:
            if (expected is None) != (rows is None):
                found.append(f"{name} at {tso}: expected {expected is not None}, read {rows is not None}")
            continue
        columns = [stored_name(c.name) for c in expected.schema.columns]
        if rows.column_names != [*columns, *META]:
            found.append(f"{name} at {tso}: columns {rows.column_names}, expected {columns}")
        elif arrow_table_rows(rows, expected.schema) != expected.rows:
            found.append(f"{name} at {tso}: {rows.num_rows} rows, expected {len(expected.rows)}")
    return found


# -- as of every commit ts -----------------------------------------------------------------------------
@settings(max_examples=2)
@given(
    seed=st.integers(0, 10_000),
    dispatch=st.sampled_from(["table", "primary-key"]),
    progress_every=st.integers(1, 3),
)
def test_as_of_every_commit_ts_equals_a_replay_of_the_stream(
    tmp_path_factory: pytest.TempPathFactory, seed: int, dispatch: str, progress_every: int
) -> None:
    """Every DML kind, key changes, ALTER ADD/DROP COLUMN, TRUNCATE, RENAME, DROP and CREATE again."""
    root = tmp_path_factory.mktemp("lake")
    config = WorkloadConfig(
        rows=120,
        tables=3,
        partitions=2,
        seed=seed,
        dispatch=dispatch,
        watermark_every_txns=4,  # type: ignore[arg-type]
    )
    records = _stream(root, config, progress_every)
    mismatches = [d for tso in _commit_points(records) for d in _differences(root, records, tso)]
    assert mismatches == []


def test_reads_use_the_mirror_versions_and_replay_only_the_changes_after_them(tmp_path: Path) -> None:
    records = _stream(
        tmp_path, WorkloadConfig(rows=80, tables=2, partitions=2, ddl=False, seed=1, watermark_every_txns=4)
    )
    uri = table_uri(tmp_path, "shop", "t1")
    assert uri is not None
    versions = mirror_versions(DeltaTable(uri))
    assert versions[-1].complete_ts > 0 and all(v.newest_ts is not None for v in versions)
    assert [v.complete_ts for v in versions] == sorted(v.complete_ts for v in versions)
    points = _commit_points(records)
    assert [
        d for tso in points[:: max(1, len(points) // 10)] for d in _differences(tmp_path, records, tso)
    ] == []


def test_a_fresh_read_is_exact_at_the_consistent_point_when_the_mirror_lags(tmp_path: Path) -> None:
    config = WorkloadConfig(rows=60, tables=2, partitions=2, ddl=False, seed=2)
    records = sent(Workload(config))
    split = len(records) // 2
    driver = _Driver(DeltaSink(tmp_path), config.partitions, 1)
    driver.feed(records[:split])
    driver.sink = DeltaSink(tmp_path, mode="changelog")  # the rest reaches the changelog only
    driver.feed(records[split:])
    _, point = retained_range(tmp_path)
    assert point is not None
    expected = truth_at(records, point)["shop.t1"]
    rows = read_mirror(tmp_path, "shop", "t1")
    assert rows is not None and arrow_table_rows(rows, expected.schema) == expected.rows
    mirror = read_mirror(tmp_path, "shop", "t1", as_of_tso=point)
    assert mirror is not None and mirror.equals(rows)


# -- what the reads look up, remembered per Delta version ----------------------------------------------
def test_reads_see_the_commits_made_since_the_last_read(tmp_path: Path) -> None:
    """The catalog, DDL log and progress records a read looked up are read again once they changed: rows,
    DDLs and progress committed after a read are in the next one."""
    config = WorkloadConfig(rows=60, tables=2, partitions=2, seed=5, watermark_every_txns=4)
    records = sent(Workload(config))
    driver = _Driver(DeltaSink(tmp_path), config.partitions, 1)
    driver.feed(records[: len(records) // 2])
    _, first = retained_range(tmp_path)
    assert first is not None and _differences(tmp_path, records, first) == []
    driver.feed(records[len(records) // 2 :])
    _, point = retained_range(tmp_path)
    assert point is not None and point > first
    assert _differences(tmp_path, records, point) == []
    assert [e.name for e in tables(tmp_path)] == [e.name for e in Catalog(LakeRoot.of(tmp_path)).refresh()]


def test_a_lookup_is_computed_once_per_version_of_its_table(tmp_path: Path) -> None:
    """Once per version; a commit, or a table made again in place (the same version, another table), is
    computed afresh."""
    uri, computed = str(tmp_path / "facts"), []

    def rows(table: DeltaTable) -> int:
        computed.append(table.version())
        return LakeRoot.of(tmp_path).scan(table).count_rows()

    write_deltalake(uri, pa.table({"n": [1]}))
    assert [by_version(DeltaTable(uri), "rows", rows) for _ in range(2)] == [1, 1] and computed == [0]
    write_deltalake(uri, pa.table({"n": [2]}), mode="append")
    assert by_version(DeltaTable(uri), "rows", rows) == 2 and computed == [0, 1]
    shutil.rmtree(uri)
    write_deltalake(uri, pa.table({"n": [3, 4, 5]}))
    write_deltalake(uri, pa.table({"n": [6]}), mode="append")
    assert by_version(DeltaTable(uri), "rows", rows) == 4 and computed == [0, 1, 1]
    table = DeltaTable(uri)
    for other in range(REMEMBERED):  # the process keeps so many lookups, the oldest dropped first
        by_version(table, f"other {other}", lambda _: None)
    assert by_version(table, "rows", rows) == 4 and computed == [0, 1, 1, 1]


def test_a_forked_child_computes_its_lookups_afresh(tmp_path: Path) -> None:
    """A child forked after a lookup (a process pool's fork) does not take its parent's."""
    write_deltalake(str(tmp_path / "facts"), pa.table({"n": [1]}))
    table = DeltaTable(str(tmp_path / "facts"))
    assert by_version(table, "who", lambda _: "parent") == "parent"
    child = os.fork()
    if child == 0:  # the child's verdict is its exit code; it never returns into pytest
        code = 1
        try:
            code = 0 if by_version(table, "who", lambda _: "child") == "child" else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert by_version(table, "who", lambda _: "again") == "parent"


# -- a table whose run stopped before its first Delta commit --------------------------------------------
def test_a_half_made_table_reads_as_empty_and_is_not_ready(tmp_path: Path) -> None:
    schema = Workload(WorkloadConfig(tables=2)).records().__next__().message.table_schema  # type: ignore[union-attr]
    assert schema is not None
    ddl = DDL(type=DDLType.CREATE, sql="CREATE TABLE t0", commit_ts=10 << 18, build_ts=0, table_schema=schema)
    sink = DeltaSink(tmp_path)
    sink.apply_ddl(DDLEvent(ddl, schema.database, schema.table), CommitContext(GROUP))
    Catalog(LakeRoot.of(tmp_path)).locate(("shop", "unannounced"), 11 << 18)  # rows seen, none committed
    sink.record_progress(CommitContext(GROUP, {(TOPIC, 0): 1}, 0, b"", {(TOPIC, 0): 12 << 18}))

    assert {(e.name, e.ready) for e in tables(tmp_path)} == {
        (("shop", "t0"), False),
        (("shop", "unannounced"), False),
    }
    with pytest.raises(TableNotFoundError):  # why a plain Delta reader checks `ready` first
        DeltaTable(str(tmp_path / "shop/t0/mirror"))
    empty = read_mirror(tmp_path, "shop", "t0")
    assert empty is not None and empty.num_rows == 0
    assert empty.column_names == [*(stored_name(c.name) for c in schema.columns), *META]
    unannounced = read_mirror(tmp_path, "shop", "unannounced", as_of_tso=12 << 18)
    assert unannounced is not None and unannounced.column_names == META and unannounced.num_rows == 0
    assert read_changelog(tmp_path, "shop", "t0") is None

    row = raw_dml(schema, DMLType.INSERT, {"id": 1}, commit_ts=13 << 18)
    sink.write(table_changes(TableCodec(schema), [(row, RecordLocation(TOPIC, 0, 1))]), CommitContext(GROUP))
    assert {e.name: e.ready for e in tables(tmp_path)}[("shop", "t0")] is True


# -- the snapshot command and the range ----------------------------------------------------------------
def test_snapshot_writes_the_as_of_read_and_refuses_tsos_out_of_range(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    start_ms = int(time.time() * 1000)
    config = WorkloadConfig(rows=80, tables=2, partitions=2, seed=4, start_physical_ms=start_ms)
    records = _stream(root, config)
    earliest, point = retained_range(root)
    assert earliest == min(_commit_points(records)) and point is not None
    tso = _commit_points(records)[len(_commit_points(records)) // 2]
    out = tmp_path / "snapshot.parquet"
    command = ["snapshot", "--sink", f"delta:{root}", "--table", "shop.t1", "--as-of-tso", str(tso)]
    result = CliRunner().invoke(main, [*command, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert pq.read_table(out).equals(read_mirror(root, "shop", "t1", as_of_tso=tso))

    for outside in (earliest - 1, point + 1):
        with pytest.raises(TsoOutOfRangeError, match=f"from {earliest} .* to {point}"):
            read_mirror(root, "shop", "t1", as_of_tso=outside)
    late = datetime.fromtimestamp((point >> 18) / 1000 + 3600, UTC)
    command = ["snapshot", "--sink", f"delta:{root}", "--table", "shop.t1", "--as-of-time", late.isoformat()]
    result = CliRunner().invoke(main, [*command, "--out", str(out)])
    assert result.exit_code != 0 and f"to {point}" in result.output
    assert time_tso(datetime.fromtimestamp(start_ms / 1000, UTC)) == start_ms << 18
