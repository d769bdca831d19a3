"""What mirror commits claim and when lazy MERGEs run: a sink knows the lake's consistent point from its
first commit (not only after its first progress record), every writer of a lake MERGEs on the cadence the
lake records (or refuses to start), and a due MERGE runs on an idle stream."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import pyarrow as pa
import pytest
from captures import TS, keyed_table, one_row_per_table
from deltalake import DeltaTable
from test_lakehouse_asof import GROUP, _commit_points, _differences, _Driver

from consumer import app
from consumer.app import build_pipeline, build_source
from consumer.config import ConfigError, load_config
from consumer.configured import build_sinks
from consumer.lakehouse import catalog
from consumer.lakehouse.catalog import CATALOG, Catalog
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.settings import CADENCE_PROPERTY, SETTINGS
from consumer.lakehouse.status import read_status
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import COMPLETE_TS, mirror_versions, read_mirror, table_uri
from consumer.pipeline import resume
from consumer.protocol.model import DML, Bootstrap, DMLType, Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.truth import arrow_table_rows, sent, truth_at
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.delta import DeltaSink
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord
from consumer.stopping import StopRequest


def _mirror_commits(root: Path, table: str) -> list[dict[str, object]]:
    uri = table_uri(root, "shop", table)
    assert uri is not None
    return sorted(DeltaTable(uri).history(), key=lambda commit: int(str(commit["version"])))


# -- the consistent point from the first commit ----------------------------------------------------------
def test_a_restarted_sinks_first_mirror_commits_claim_the_lakes_consistent_point(tmp_path: Path) -> None:
    """A run records progress up to a watermark; a restarted sink's MERGEs before its own first progress
    record already claim that point (they used to claim 0), and every claim is true: as of every commit ts
    the mirror plus the changelog after what it claims equals the replay."""
    config = WorkloadConfig(rows=160, tables=2, partitions=2, ddl=False, seed=5, watermark_every_txns=4)
    records = sent(Workload(config))
    last = config.partitions - 1
    cut = 1 + next(
        i
        for i in range(len(records) // 2, len(records))
        if isinstance(records[i].message, Watermark) and records[i].partition == last
    )
    first = _Driver(DeltaSink(tmp_path), config.partitions, 1)
    first.feed(records[:cut])
    point = consistent_ts(tmp_path, GROUP)
    assert point is not None and point == first.last_watermark > 0
    before = {table: len(_mirror_commits(tmp_path, table)) for table in ("t0", "t1")}

    restarted = _Driver(DeltaSink(tmp_path), config.partitions, progress_every=10**6)  # records at the end
    restarted.offsets = dict(first.offsets)
    restarted.feed(records[cut:])
    claims = [
        int(str(commit[COMPLETE_TS]))
        for table in ("t0", "t1")
        for commit in _mirror_commits(tmp_path, table)[before[table] :]
        if commit["operation"] == "MERGE"
    ]
    assert claims and min(claims) >= point
    assert [d for tso in _commit_points(records)[::5] for d in _differences(tmp_path, records, tso)] == []


def _orders_capture(path: Path, rows: int) -> Path:
    """Partition ("t", 0): a BOOTSTRAP of `shop.a`, then per row n (1..rows) an INSERT of id n at TS + 10n
    and a WATERMARK past it: a longer capture starts with a shorter one's records."""
    encoder = MessageEncoder()
    schema = keyed_table("a", 1)
    values = [encoder.encode(Bootstrap(table_schema=schema, build_ts=0))]
    for n in range(1, rows + 1):
        row = DML(
            type=DMLType.INSERT,
            database="shop",
            table="a",
            table_id=1,
            commit_ts=TS + 10 * n,
            build_ts=0,
            schema_version=1,
            data={"id": n},
        )
        watermark = Watermark(commit_ts=TS + 10 * n + 5, build_ts=0)
        values += [encoder.encode(row, schema), encoder.encode(watermark)]
    with path.open("wb") as fp:
        write_capture((SourceRecord("t", 0, offset, value=v) for offset, v in enumerate(values)), fp)
    return path


def test_a_resumed_runs_first_merge_claims_the_point_read_as_partitions_were_assigned(tmp_path: Path) -> None:
    """`run` twice over a growing capture: the second run's first MERGE, made before its first progress
    record, claims the consistent point the first run left (read as its partition was assigned)."""
    root = tmp_path / "lake"
    for rows in (1, 2):
        capture = _orders_capture(tmp_path / f"capture-{rows}.jsonl", rows)
        overrides = {"source": {"url": f"file:{capture}"}, "sink": {"url": f"delta:{root}"}}
        overrides["parallelism"] = {"decode_workers": 0}
        app.run(load_config(overrides=overrides, environ={}), until_idle=0.3)
        if rows == 1:
            point = consistent_ts(root)
            assert point == TS + 15
    merges = [c for c in _mirror_commits(root, "a") if c["operation"] == "MERGE"]
    assert [int(str(c[COMPLETE_TS])) for c in merges] == [0, TS + 15]  # the first run knew nothing yet
    assert read_mirror(root, "shop", "a", as_of_tso=TS + 15)["id"].to_pylist() == [1]  # type: ignore[index]


# -- one cadence per lake --------------------------------------------------------------------------------
def test_every_writer_of_a_lakes_mirrors_uses_the_cadence_it_records(tmp_path: Path) -> None:
    """The first sink records its cadence in the lake; one with the same starts, one with another is refused
    at start naming both values; a sink keeping no mirror has no cadence."""
    DeltaSink(tmp_path, mirror_interval_rows=40)
    settings = DeltaTable(str(tmp_path / SETTINGS)).metadata().configuration
    assert settings[CADENCE_PROPERTY] == "interval_s=0;interval_rows=40"  # any Delta reader sees it
    DeltaSink(tmp_path, mirror_interval_rows=40)
    with pytest.raises(ConfigError) as refused:
        DeltaSink(tmp_path)  # MERGE every batch
    message = str(refused.value)
    assert "cadence is mirror_interval_s = 0, mirror_interval_rows = 0 (a MERGE every batch), but" in message
    assert f"{tmp_path} records mirror_interval_s = 0, mirror_interval_rows = 40 (lazy MERGEs)" in message
    with pytest.raises(ConfigError, match=r"cadence is mirror_interval_s = 30, mirror_interval_rows = 40 \("):
        DeltaSink(tmp_path, mirror_interval_s=30, mirror_interval_rows=40)
    assert DeltaSink(tmp_path, mode="changelog").lazy_mirrors is False  # no mirror, no cadence
    overrides = {"source": {"url": "file:capture.jsonl"}, "sink": {"url": f"delta:{tmp_path}"}}
    with pytest.raises(ConfigError, match="mirror_interval_rows = 40"):  # as `run` builds it: exit 2
        build_sinks(load_config(overrides=overrides, environ={}))
    assert DeltaTable(str(tmp_path / SETTINGS)).metadata().configuration == settings  # nothing changed


def test_members_starting_at_once_agree_on_the_first_recorded_cadence(tmp_path: Path) -> None:
    """Two members of a new lake start together with different cadences: one records its own, the other
    is refused, whichever came first."""
    together = threading.Barrier(2)

    def start(interval_rows: int) -> ConfigError | None:
        together.wait()
        try:
            DeltaSink(tmp_path, mirror_interval_rows=interval_rows)
        except ConfigError as exc:
            return exc
        return None

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(start, [0, 50]))
    assert sorted(outcome is None for outcome in outcomes) == [False, True]
    recorded = DeltaTable(str(tmp_path / SETTINGS)).metadata().configuration[CADENCE_PROPERTY]
    winner = 0 if outcomes[0] is None else 50
    assert recorded == f"interval_s=0;interval_rows={winner}"


# -- a due MERGE on an idle stream -----------------------------------------------------------------------
def test_a_due_merge_runs_while_the_stream_is_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`mirror_interval_s` passes while nothing arrives: the pipeline records progress because a MERGE is
    due, and the mirrors are MERGEd while the run goes on (seen from its cycles, which then stop it), not
    only when it stops. Regular progress records are made rare here so they cannot do it instead."""
    monkeypatch.setattr(resume, "PROGRESS_SECONDS", 3600.0)
    capture = one_row_per_table(tmp_path / "capture.jsonl", "ab")  # rows, then a WATERMARK, then nothing
    root = tmp_path / "lake"
    overrides = {
        "source": {"url": f"file:{capture}"},
        "sink": {"url": f"delta:{root}", "mirror_interval_s": 0.3},
        "parallelism": {"decode_workers": 0},
    }
    config = load_config(overrides=overrides, environ={})
    pipeline = build_pipeline(config)
    source = build_source(config, pipeline)
    stop = StopRequest()
    seen: list[int] = []

    def cycle(running: object) -> None:
        uris = [table_uri(root, "shop", table) for table in "ab"]
        if all(u is not None for u in uris):
            merged = [c for u in uris for c in DeltaTable(str(u)).history() if c["operation"] == "MERGE"]
            if len(merged) == 2:  # both mirrors MERGEd while running: the observable event
                seen.append(pipeline.stats.records)
                stop.request("the due MERGEs ran")

    try:
        stats = pipeline.run(source, until_idle=20.0, on_cycle=cycle, stop=stop)
    finally:
        source.close()
        pipeline.close()
    assert stats.stopped_on_request, "the MERGEs came only as the run stopped"
    assert seen == [5]  # every record (2 BOOTSTRAPs, 2 rows, the WATERMARK) was read before: idle
    for n, table in enumerate("ab", start=1):
        rows = read_mirror(root, "shop", table)
        assert rows is not None and rows["id"].to_pylist() == [n]


# -- what each mirror holds, in the catalog --------------------------------------------------------------
MIRROR_COLUMNS = ("mirror_version", "mirror_ts", "mirror_newest_ts")


def _catalog_mirror_records(root: Path) -> list[tuple[object, ...]]:
    """Per catalog version, its rows' mirror columns, as a plain Delta reader of `_catalog` sees them."""
    catalog = DeltaTable(str(root / CATALOG))
    records = []
    for version in range(catalog.version() + 1):
        catalog.load_as_version(version)
        rows = catalog.to_pyarrow_table()
        columns = [c for c in ("location", *MIRROR_COLUMNS) if c in rows.column_names]
        records.append(tuple(sorted(map(tuple, rows.select(columns).to_pylist()))))
    return records


@pytest.mark.parametrize("interval_rows", [0, 25])
def test_the_catalog_records_what_each_mirror_holds_once_per_progress_record(
    tmp_path: Path, interval_rows: int
) -> None:
    """MERGEd every batch or lazily, the catalog gains at most one change of its mirror columns per progress
    record (however many MERGEs ran), each table's is what its mirror's commits claim at that version (a
    mirror MERGEd every batch: up to the consistent point read at the record, which its commits could not
    claim), every mirror is exact at the end, a plain Delta read of that version is the truth at the
    recorded TSO, and `status` shows the same."""
    config = WorkloadConfig(rows=200, tables=3, partitions=2, ddl=False, seed=7, watermark_every_txns=4)
    records = sent(Workload(config))
    driver = _Driver(DeltaSink(tmp_path, mirror_interval_rows=interval_rows), config.partitions, 2)
    driver.feed(records)

    history = _catalog_mirror_records(tmp_path)
    changes = sum(before != after for before, after in pairwise(history))
    merges = sum(
        commit["operation"] == "MERGE"
        for path in tmp_path.glob("shop/*/mirror")
        for commit in DeltaTable(str(path)).history()
    )
    progress_records = driver.watermarks // 2 + 1
    assert 0 < changes <= progress_records
    assert interval_rows or merges > 3 * progress_records  # MERGEd every batch: not one catalog commit each
    status = {(t.database, t.table): t for t in read_status(tmp_path).tables}
    assert len(status) == config.tables
    for entry in Catalog(LakeRoot.of(tmp_path)).entries():
        uri = table_uri(tmp_path, *entry.name)
        assert uri is not None and entry.mirror is not None
        claimed = {v.version: v for v in mirror_versions(DeltaTable(uri))}[entry.mirror.version]
        assert entry.mirror.newest_ts == claimed.newest_ts
        if interval_rows:
            assert entry.mirror == claimed
        else:  # also the consistent point read at the record, which commits made before could not claim
            assert claimed.complete_ts < entry.mirror.complete_ts <= (consistent_ts(tmp_path) or 0)
        shown = status[entry.name]
        assert (shown.mirror_ts, shown.mirror_version) == (entry.mirror.complete_ts, entry.mirror.version)
        assert shown.mirror_exact is entry.mirror.exact
        assert entry.mirror.exact and entry.mirror.complete_ts > 0  # at the end of a run, either cadence
        if entry.mirror.exact:
            expected = truth_at(records, entry.mirror.complete_ts)[".".join(entry.name)]
            plain = DeltaTable(uri, version=entry.mirror.version).to_pyarrow_table()
            assert arrow_table_rows(plain, expected.schema) == expected.rows


def test_a_catalog_written_before_the_mirror_columns_reads_and_gains_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lake whose catalog has no mirror columns (written before them) reads: no record, nothing shown;
    the next run's first record adds the columns, for any Delta reader."""
    config = WorkloadConfig(rows=120, tables=2, partitions=2, ddl=False, seed=3, watermark_every_txns=4)
    records = sent(Workload(config))
    cut = len(records) // 2
    older = pa.schema([f for f in catalog.CATALOG_SCHEMA if f.name not in MIRROR_COLUMNS])
    with monkeypatch.context() as patched:
        patched.setattr(catalog, "CATALOG_SCHEMA", older)
        first = _Driver(DeltaSink(tmp_path, mirror_interval_rows=25), config.partitions, 1)
        first.feed(records[:cut])
    assert DeltaTable(str(tmp_path / CATALOG)).schema().to_arrow().names == older.names
    assert [e.mirror for e in Catalog(LakeRoot.of(tmp_path)).entries()] == [None, None]
    assert [(t.mirror_ts, t.mirror_exact) for t in read_status(tmp_path).tables] == [(None, None)] * 2
    point = consistent_ts(tmp_path)
    assert point is not None

    restarted = _Driver(DeltaSink(tmp_path, mirror_interval_rows=25), config.partitions, 1)
    restarted.offsets = dict(first.offsets)
    restarted.feed(records[cut:])
    plain = DeltaTable(str(tmp_path / CATALOG)).to_pyarrow_table()
    assert plain.schema.names == catalog.CATALOG_SCHEMA.names
    recorded = zip(*(plain[c].to_pylist() for c in ("location", *MIRROR_COLUMNS[:2])), strict=True)
    for location, version, ts in recorded:
        claims = {v.version: v for v in mirror_versions(DeltaTable(str(tmp_path / location / "mirror")))}
        assert claims[version].complete_ts == ts >= point  # recorded by the second run
