"""History tables as of a TSO: simulated streams with DDLs (ALTER ADD/DROP COLUMN, TRUNCATE, RENAME, DROP and
CREATE again) spread over lagging partitions, through the real Delta sink, read back as of every commit ts
(and just before and at every DDL) and compared with the history of the changes up to it and with the
stream's truth; TSOs outside the range; the Spark reader."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from lakehouse_checks import valid_at
from pyspark.sql import SparkSession
from test_lakehouse_history import GROUP, TOPIC, Segment, _drive, _expected, _segments, _stored

from consumer.batches.changes import stored_name
from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import TsoOutOfRangeError, read_history, read_mirror, retained_range, tables
from consumer.protocol.model import DDL, DML
from consumer.simulate.truth import arrow_table_rows, sent, truth_at
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink
from consumer.spark import readers

USER_META = {
    "_valid_from_ts",
    "_valid_to_ts",
    "_deleted",
    "_schema_version",
    "_topic",
    "_partition",
    "_offset",
}


def _lake(
    root: Path,
    records: list[StreamRecord],
    seed: int,
    partitions: int = 2,
    cadence: int = 5,
    lagging: int = 0,
) -> list[Segment]:
    """`records` through a Delta sink keeping changelogs, mirrors and histories; progress recorded at the
    end (every partition applied to the stream's last commit ts)."""
    segments = _segments(records, partitions, seed)
    sink = DeltaSink(root, mode="both,history")
    _drive(sink, segments, cadence, lagging)
    last = max(dml.commit_ts for s in segments for _, dml, _ in s.rows)
    last = max([last, *(s.ddl.commit_ts for s in segments if s.ddl)])
    applied = {(TOPIC, p): last for p in range(partitions)}
    sink.record_progress(
        CommitContext(GROUP, {(TOPIC, p): 10**6 for p in range(partitions)}, last, b"", applied)
    )
    return segments


def _records(seed: int) -> list[StreamRecord]:
    return sent(Workload(WorkloadConfig(rows=60, tables=2, partitions=1, seed=seed)))


def _up_to(segments: list[Segment], tso: int) -> list[Segment]:
    """The stream cut at `tso`: its changes and DDLs with commit ts <= it."""
    return [
        Segment(
            [row for row in s.rows if row[1].commit_ts <= tso],
            s.ddl if s.ddl and s.ddl.commit_ts <= tso else None,
        )
        for s in segments
    ]


def _points(segments: list[Segment]) -> list[int]:
    """Every commit ts, and the TSO just before every DDL."""
    ddls = {s.ddl.commit_ts for s in segments if s.ddl}
    rows = {dml.commit_ts for s in segments for _, dml, _ in s.rows}
    return sorted(rows | ddls | {ts - 1 for ts in ddls})


def _as_of(root: Path, tso: int) -> dict[str, pa.Table]:
    """Each table that existed at `tso`, read by the name it had then, as of `tso`."""
    found = {}
    for entry in tables(root):
        name = entry.name_at(tso)
        rows = None if name is None else read_history(root, *name, as_of_tso=tso)
        if rows is not None:
            found[entry.location] = rows
    return found


def _columns_by(root: Path, records: list[StreamRecord], tso: int) -> dict[str, set[str]]:
    """Per location, the stored user columns the table had at some TSO <= `tso`."""
    catalog, had = Catalog(LakeRoot.of(root)), {}
    for record in records:
        message = record.message
        schema = message.table_schema if isinstance(message, DDL) else record.schema
        if not isinstance(message, DML | DDL) or schema is None or message.commit_ts > tso:
            continue
        entry = catalog.find((schema.database, schema.table), message.commit_ts)
        if entry is not None:
            had.setdefault(entry.location, set()).update(stored_name(c.name) for c in schema.columns)
    return had


@settings(max_examples=3, deadline=None, phases=[Phase.generate])
@given(seed=st.integers(0, 10_000), cadence=st.integers(3, 12), lagging=st.integers(0, 1))
def test_history_as_of_every_tso_is_the_history_of_the_changes_up_to_it(
    tmp_path_factory: pytest.TempPathFactory, seed: int, cadence: int, lagging: int
) -> None:
    root = tmp_path_factory.mktemp("lake")
    records = _records(seed)
    segments = _lake(root, records, seed, 2, cadence, lagging)
    assert any(s.ddl for s in segments)
    catalog = Catalog(LakeRoot.of(root))
    mismatches = []
    for tso in _points(segments):
        histories = _as_of(root, tso)
        live = {e.location for e in tables(root) if e.name_at(tso) is not None}
        expected = {v for v in _expected(root, _up_to(segments, tso)) if v[0] in live}
        if _stored(histories) != expected:
            mismatches.append(f"versions at {tso}: {len(_stored(histories) ^ expected)} differ")
        had = _columns_by(root, records, tso)
        for location, rows in histories.items():
            users = set(rows.column_names) - USER_META
            if not users <= had.get(location, set()):
                mismatches.append(
                    f"{location} at {tso}: columns {users - had.get(location, set())} came later"
                )
        for name, truth in truth_at(records, tso).items():
            entry = catalog.find(tuple(name.split(".")), tso)  # type: ignore[arg-type]
            history = None if entry is None else histories.get(entry.location)
            rows = {} if history is None else arrow_table_rows(valid_at(history, tso), truth.schema)
            if rows != truth.rows:
                mismatches.append(f"{name} at {tso}: {len(rows)} rows, expected {len(truth.rows)}")
    assert mismatches == []


def test_history_as_of_refuses_tsos_outside_the_range_and_is_the_full_history_at_the_end(
    tmp_path: Path,
) -> None:
    segments = _lake(tmp_path, _records(7), seed=7)
    earliest, point = retained_range(tmp_path)
    assert earliest is not None and point is not None
    first = min(
        [*(d.commit_ts for _, d, _ in segments[0].rows), *(s.ddl.commit_ts for s in segments if s.ddl)]
    )
    for outside in (0, earliest - 1, point + 1):  # before any data, after the consistent point
        with pytest.raises(TsoOutOfRangeError, match=f"from {earliest} .* to {point}"):
            read_history(tmp_path, "shop", "t1", as_of_tso=outside)
        with pytest.raises(TsoOutOfRangeError):
            read_mirror(tmp_path, "shop", "t1", as_of_tso=outside)
    assert earliest == first
    for entry in tables(tmp_path):
        if entry.live and read_history(tmp_path, *entry.name) is not None:
            now, then = (
                read_history(tmp_path, *entry.name),
                read_history(tmp_path, *entry.name, as_of_tso=point),
            )
            assert then is not None and now is not None
            assert then.select(now.column_names).equals(now)  # nothing after the consistent point


def test_spark_reads_the_history_as_of_a_tso(spark: SparkSession, tmp_path: Path) -> None:
    segments = _lake(tmp_path, _records(11), seed=11)
    tso = _points(segments)[len(_points(segments)) // 2]
    entry = next(e for e in tables(tmp_path) if e.name_at(tso) is not None and e.location == "shop/t1")
    name = entry.name_at(tso)
    assert name is not None
    expected = read_history(tmp_path, *name, as_of_tso=tso)
    assert expected is not None and expected.num_rows > 0
    frame = readers.read_history(spark, tmp_path, *name, as_of_tso=tso)
    assert frame.columns == expected.column_names
    got = sorted((r["id"], r["_valid_from_ts"], r["_valid_to_ts"], r["_deleted"]) for r in frame.collect())
    want = sorted(
        (r["id"], r["_valid_from_ts"], r["_valid_to_ts"], r["_deleted"])
        for r in expected.select(["id", "_valid_from_ts", "_valid_to_ts", "_deleted"]).to_pylist()
    )
    assert got == want
    assert all(r["_valid_to_ts"] is None or r["_valid_to_ts"] <= tso for r in frame.collect())
    one = readers.read_history(spark, tmp_path, *name, key={"id": want[0][0]}, as_of_tso=tso)
    assert {r["id"] for r in one.collect()} == {want[0][0]}
    with pytest.raises(TsoOutOfRangeError):
        readers.read_history(spark, tmp_path, *name, as_of_tso=0)
