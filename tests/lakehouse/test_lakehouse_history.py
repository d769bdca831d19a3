"""History tables (SCD type 2) through the real Delta sink: simulated streams whose transactions are spread
over partitions and applied in several cadences, one partition lagging behind the others (its rows arrive
after later ones, and after DDLs), against the straightforward history of the full change list and the
stream's truth at every commit ts; replays commit nothing; out-of-order splits and TRUNCATE by hand."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from lakehouse_checks import valid_at

from consumer.batches.changes import table_changes
from consumer.errors import RecordLocation
from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import entry_uri, read_delta, read_history, read_mirror, tables
from consumer.protocol.model import DDL, DML, DDLType, DMLType, TableSchema
from consumer.protocol.table import TableCodec
from consumer.simulate.truth import arrow_table_rows, sent, truth_at
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.delta import DeltaSink
from consumer.testing.messages import raw_dml

TOPIC, GROUP = "t", "g"
Located = tuple[TableSchema, DML, RecordLocation]
Version = tuple[
    str, int, int, int | None, bool, int, int
]  # location, id, from, to, deleted, partition, offset


# -- a stream spread over partitions -------------------------------------------------------------------
@dataclass
class Segment:
    """The DMLs between two DDLs, and the DDL ending them (None: the stream's end)."""

    rows: list[Located] = field(default_factory=list)
    ddl: DDL | None = None


def _segments(records: list[StreamRecord], partitions: int, seed: int) -> list[Segment]:
    """The workload's DMLs, each transaction on a random partition (so a key's changes land on several:
    out of order once one lags), offsets counted per partition; DDLs once each."""
    chooser, offsets = random.Random(seed), [0] * partitions
    placed: dict[int, int] = {}
    segments, seen = [Segment()], set()
    for record in records:
        message = record.message
        if isinstance(message, DML) and record.schema is not None:
            partition = placed.setdefault(message.commit_ts, chooser.randrange(partitions))
            segments[-1].rows.append(
                (record.schema, message, RecordLocation(TOPIC, partition, offsets[partition]))
            )
            offsets[partition] += 1
        elif isinstance(message, DDL) and (message.commit_ts, message.sql) not in seen:
            seen.add((message.commit_ts, message.sql))
            segments[-1].ddl = message
            segments.append(Segment())
    return segments


def _drive(sink: DeltaSink, segments: list[Segment], cadence: int, lagging: int) -> None:
    """Each segment's rows in chunks of `cadence` per partition, partitions interleaved; the `lagging`
    partition's rows of a segment come only after the next DDL and the next segment's other rows."""
    late: list[Located] = []
    for segment in segments:
        on_time = [row for row in segment.rows if row[2].partition != lagging]
        for chunk in _chunks(on_time, cadence):
            _write(sink, chunk)
        for chunk in _chunks(late, cadence):
            _write(sink, chunk)
        late = [row for row in segment.rows if row[2].partition == lagging]
        if segment.ddl is not None:
            schema = segment.ddl.table_schema
            assert schema is not None
            event = DDLEvent(segment.ddl, schema.database, schema.table)
            sink.apply_ddl(event, CommitContext(GROUP, resolved_ts=segment.ddl.commit_ts))
    for chunk in _chunks(late, cadence):
        _write(sink, chunk)


def _chunks(rows: list[Located], cadence: int) -> Iterator[list[Located]]:
    """Per partition, runs of `cadence` rows, partitions taking turns."""
    by_partition: dict[int, list[Located]] = {}
    for row in rows:
        by_partition.setdefault(row[2].partition, []).append(row)
    runs = [[rows[i : i + cadence] for i in range(0, len(rows), cadence)] for rows in by_partition.values()]
    for turn in range(max((len(r) for r in runs), default=0)):
        yield from (r[turn] for r in runs if turn < len(r))


def _write(sink: DeltaSink, rows: list[Located]) -> None:
    """One batch per table schema version, as the pipeline cuts them."""
    grouped: dict[tuple[str, str, int], list[Located]] = {}
    for row in rows:
        grouped.setdefault((row[0].database, row[0].table, row[0].version), []).append(row)
    for batch in grouped.values():
        schema = batch[0][0]
        located = [
            (raw_dml(schema, d.type, d.data, d.old, commit_ts=d.commit_ts), loc) for _, d, loc in batch
        ]
        sink.write(table_changes(TableCodec(schema), located), CommitContext(GROUP, resolved_ts=0))


# -- what the history must be --------------------------------------------------------------------------
def _expected(root: Path, segments: list[Segment]) -> set[Version]:
    """Per table incarnation and key, its changes sorted, each valid until the next one (the last until the
    incarnation's TRUNCATE or DROP)."""
    catalog = Catalog(LakeRoot.of(root))
    changes: dict[tuple[str, int], list[tuple[int, int, int, bool]]] = {}
    for segment in segments:
        for _, dml, origin in segment.rows:
            entry = catalog.find((dml.database, dml.table), dml.commit_ts)
            assert entry is not None
            deleted = dml.type is DMLType.DELETE
            key = ((dml.old if deleted else dml.data) or {})["id"]
            change = (dml.commit_ts, origin.partition, origin.offset, deleted)
            changes.setdefault((entry.location, key), []).append(change)
    cuts: dict[str, list[int]] = {}
    for ddl in (s.ddl for s in segments if s.ddl and s.ddl.type in (DDLType.TRUNCATE, DDLType.ERASE)):
        assert ddl.table_schema is not None
        entry = catalog.find((ddl.table_schema.database, ddl.table_schema.table), ddl.commit_ts - 1)
        assert entry is not None
        cuts.setdefault(entry.location, []).append(ddl.commit_ts)
    versions = set()
    for (location, key), ordered in changes.items():
        ordered.sort()
        following = [change[0] for change in ordered[1:]]
        for (ts, partition, offset, deleted), end in zip(ordered, [*following, None], strict=True):
            cut = min((c for c in cuts.get(location, []) if c > ts), default=None)
            ended = min((e for e in (end, cut) if e is not None), default=None)
            versions.add((location, key, ts, ended, deleted, partition, offset))
    return versions


def _histories(root: Path) -> dict[str, pa.Table]:
    lake = LakeRoot.of(root)
    opened = {e.location: lake.open(entry_uri(lake, e, "history")) for e in tables(lake)}
    return {location: read_delta(lake, table) for location, table in opened.items() if table is not None}


def _stored(histories: dict[str, pa.Table]) -> set[Version]:
    columns = ["id", "_valid_from_ts", "_valid_to_ts", "_deleted", "_partition", "_offset"]
    return {
        (location, *row.values())
        for location, rows in histories.items()
        for row in rows.select(columns).to_pylist()
    }


def _differences_from_truth(root: Path, records: list[StreamRecord], segments: list[Segment]) -> list[str]:
    """At every commit ts, where the versions valid then differ from the stream replayed up to it."""
    histories, catalog = _histories(root), Catalog(LakeRoot.of(root))
    points = sorted(
        {row[1].commit_ts for s in segments for row in s.rows} | {s.ddl.commit_ts for s in segments if s.ddl}
    )
    found = []
    for tso in points:
        for name, expected in truth_at(records, tso).items():
            database, table = name.split(".")
            entry = catalog.find((database, table), tso)
            history = None if entry is None else histories.get(entry.location)
            rows = {} if history is None else arrow_table_rows(valid_at(history, tso), expected.schema)
            if rows != expected.rows:
                found.append(f"{name} at {tso}: {len(rows)} rows, expected {len(expected.rows)}")
    return found


def _versions(root: Path) -> dict[str, int]:
    return {location: DeltaTable(str(root / location / "history")).version() for location in _histories(root)}


@settings(max_examples=3, deadline=None, phases=[Phase.generate])  # shrinking a failure takes minutes
@given(
    seed=st.integers(0, 10_000),
    partitions=st.integers(2, 3),
    cadence=st.integers(3, 12),
    lagging=st.integers(0, 2),
)
def test_history_equals_the_change_list_whatever_the_order_and_replays_commit_nothing(
    tmp_path_factory: pytest.TempPathFactory, seed: int, partitions: int, cadence: int, lagging: int
) -> None:
    root = tmp_path_factory.mktemp("lake")
    records = sent(Workload(WorkloadConfig(rows=60, tables=2, partitions=1, seed=seed)))
    segments = _segments(records, partitions, seed)
    _drive(DeltaSink(root, mode="both,history"), segments, cadence, lagging)

    assert _stored(_histories(root)) == _expected(root, segments)
    assert _differences_from_truth(root, records, segments) == []
    for entry in tables(root):  # the newest versions are the mirror
        history, mirror = read_history(root, *entry.name), read_mirror(root, *entry.name)
        if entry.live and history is not None and mirror is not None:
            current = valid_at(history, 2**63 - 2).select(["id"]).sort_by("id")
            assert current.equals(mirror.select(["id"]).sort_by("id"))

    written = _versions(root)
    _drive(DeltaSink(root, mode="history"), segments, cadence * 2, -1)  # a replay, another cadence
    assert _versions(root) == written


def test_a_late_change_splits_the_version_it_falls_in_and_truncate_ends_versions(tmp_path: Path) -> None:
    schema = next(r.schema for r in sent(Workload(WorkloadConfig(tables=1, rows=5))) if r.schema)
    sink, base = DeltaSink(tmp_path, mode="history"), 1 << 40

    def change(kind: DMLType, ts: int, partition: int, offset: int, **values: int) -> None:
        row = {c.name: None for c in schema.columns} | {"id": 1} | values
        raw = raw_dml(schema, kind, None if kind is DMLType.DELETE else row, row, commit_ts=base + ts)
        located = [(raw, RecordLocation(TOPIC, partition, offset))]
        sink.write(table_changes(TableCodec(schema), located), CommitContext(GROUP))

    change(DMLType.INSERT, 9, 0, 0)
    change(DMLType.DELETE, 12, 0, 1)
    change(DMLType.INSERT, 5, 1, 0)  # late: the lagging member's
    truncate = DDL(
        type=DDLType.TRUNCATE, sql="TRUNCATE x", commit_ts=base + 11, build_ts=0, table_schema=schema
    )
    sink.apply_ddl(DDLEvent(truncate, schema.database, schema.table), CommitContext(GROUP))
    change(DMLType.INSERT, 3, 1, 1)  # later still, and before the TRUNCATE

    history = read_history(tmp_path, schema.database, schema.table, key={"id": 1})
    assert history is not None
    spans = [
        (r["_valid_from_ts"] - base, r["_valid_to_ts"] and r["_valid_to_ts"] - base, r["_deleted"])
        for r in history.to_pylist()
    ]
    assert spans == [(3, 5, False), (5, 9, False), (9, 11, False), (12, None, True)]
    assert read_history(tmp_path, schema.database, schema.table, key={"id": 2}).num_rows == 0  # type: ignore[union-attr]
