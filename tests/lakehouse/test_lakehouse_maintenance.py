"""`maintain` (and `ticdc-consumer maintain`): compaction, clustering mirrors by key, purging the deletes
side tables below the consistent point, checkpoints; the tables' contents never change."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pyarrow as pa
from click.testing import CliRunner
from delta_changes import CONTEXT, SCHEMA, TS, evolved_schema, raw_change, table_batch
from deltalake import DeltaTable

from consumer.cli import main
from consumer.lakehouse import maintain, read_mirror, table_uri
from consumer.protocol.model import DMLType
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink

OTHER = evolved_schema(5, *SCHEMA.columns, table="other")


def _filled(root: Path) -> DeltaSink:
    """`orders`: a mirror of 600 keys in 6 files whose key ranges overlap; `other`: 100 keys deleted."""
    sink = DeltaSink(root, target_file_size=2048)
    for batch in range(6):
        keys = range(batch, 600, 6)  # every batch spans the whole key range: files overlap
        rows = [
            (raw_change(DMLType.INSERT, TS + batch, _row(k)), 0, batch * 100 + i) for i, k in enumerate(keys)
        ]
        sink.write(table_batch(rows), CONTEXT)
    inserts = [(raw_change(DMLType.INSERT, TS, _row(k), schema=OTHER), 1, k) for k in range(100)]
    deletes = [
        (raw_change(DMLType.DELETE, TS + 10, old=_row(k), schema=OTHER), 1, 100 + k) for k in range(100)
    ]
    sink.write(table_batch(inserts, OTHER), CONTEXT)
    sink.write(table_batch(deletes, OTHER), CONTEXT)
    return sink


def _row(key: int) -> dict[str, object]:
    return {"id": key, "name": f"n{key}", "qty": 1}


def _key_ranges(uri: str) -> list[tuple[int, int]]:
    actions = pa.table(DeltaTable(uri).get_add_actions(flatten=True))
    return sorted(zip(actions["min.id"].to_pylist(), actions["max.id"].to_pylist(), strict=True))


def test_maintain_clusters_mirrors_purges_deletes_and_keeps_every_row(tmp_path: Path) -> None:
    sink = _filled(tmp_path)
    before = read_mirror(tmp_path, "shop", "orders")
    uri = table_uri(tmp_path, "shop", "orders")
    assert before is not None and uri is not None
    overlapping = _key_ranges(uri)
    assert len(overlapping) == 6 and overlapping[0][1] > overlapping[1][0]
    deletes = str(tmp_path / "shop/other/deletes")
    sink.record_progress(CommitContext("g", {("t", 0): 3000}, TS + 11, b"", applied_ts={("t", 0): TS + 11}))

    report = maintain(tmp_path, cluster=True)
    assert report.consistent_ts == TS + 11 and all(done.error is None for done in report.tables)
    mirror = next(done for done in report.tables if done.uri == uri)
    assert mirror.clustered and mirror.files_after < mirror.files_before
    ranges = _key_ranges(uri)
    assert all(low > previous_high for (_, previous_high), (low, _) in itertools.pairwise(ranges))
    assert next(done for done in report.tables if done.uri == deletes).deletes_purged == 100
    assert DeltaTable(deletes).to_pyarrow_dataset().count_rows() == 0
    after = read_mirror(tmp_path, "shop", "orders")
    assert after is not None and after.sort_by("id").equals(before.sort_by("id"))


def test_the_maintain_command_reports_each_table(tmp_path: Path) -> None:
    _filled(tmp_path)
    result = CliRunner().invoke(main, ["maintain", "--sink", f"delta:{tmp_path}", "--no-vacuum"])
    assert result.exit_code == 0, result.output
    assert "shop/orders/mirror: " in result.output and "_catalog: " in result.output
    assert "tables maintained in" in result.output


def test_maintain_vacuums_changelog_files_no_commit_added(tmp_path: Path) -> None:
    """A file the Spark engine's task wrote whose commit never came (its driver killed) is vacuumed once
    older than the retention; committed files stay."""
    _filled(tmp_path)
    changelog = tmp_path / "shop" / "orders" / "changelog"
    committed = sorted(changelog.glob("*.parquet"))
    orphan = changelog / "part-00000-orphan-c000.snappy.parquet"
    orphan.write_bytes(committed[0].read_bytes())
    old = time.time() - 8 * 24 * 3600  # past the default retention (a week)
    os.utime(orphan, (old, old))
    report = maintain(tmp_path)
    assert all(done.error is None for done in report.tables)
    assert not orphan.exists()
    assert DeltaTable(str(changelog)).to_pyarrow_table().num_rows == 600
