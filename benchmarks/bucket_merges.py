"""A bucketed mirror's MERGE in bucket groups (`sink.mirror_split_rows`) against delta-rs's own MERGE.

Run: `python benchmarks/bucket_merges.py [--sizes 200000,1000000] [--changed 0.5,0.3] [--buckets 16]
[--repeats 3]`.

Per size N: a mirror of N rows (`DeltaSink`, mode mirror, `--buckets` buckets) is built once per way, then
one batch of UPDATEs of N x changed keys (every other key) is written, timed: by one delta-rs MERGE
(`mirror_split_rows = 0`) and split in bucket groups on the loop engine's threads (`mirror_split_rows = 1`).
The two ways alternate, the fastest of `--repeats` counts; the ratio is split / delta-rs (below 1: the split
is faster). Both lakes must end equal. The machine is shared: read the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from deltalake import DeltaTable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' key-value table

from delta_changes import KV as SCHEMA

from consumer.batches.changes import TableChanges, table_changes
from consumer.errors import RecordLocation
from consumer.lakehouse.tables import table_uri
from consumer.protocol.model import DMLType
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink
from consumer.testing.messages import raw_dml

GROUP = "bench"


def _changes(keys: range, kind: DMLType, ts: int, first: int) -> TableChanges:
    before = {"v": "?"} if kind is DMLType.UPDATE else None
    located = [
        (
            raw_dml(
                SCHEMA, kind, {"id": key, "v": f"v{ts}"}, before and {**before, "id": key}, commit_ts=ts << 18
            ),
            RecordLocation("bench", 0, first + index),
        )
        for index, key in enumerate(keys)
    ]
    return table_changes(TableCodec(SCHEMA), located)


def _merge_seconds(root: Path, buckets: int, split: int, rows: TableChanges, updates: TableChanges) -> float:
    """The seconds of the UPDATE batch's MERGE into a fresh mirror of `rows`."""
    sink = DeltaSink(root, mirror_buckets=buckets, mode="mirror")
    sink.write(rows, CommitContext(GROUP))
    sink.split_rows = split
    started = time.perf_counter()
    sink.write(updates, CommitContext(GROUP))
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="200000,1000000", help="mirror rows, comma-separated")
    parser.add_argument("--changed", default="0.5,0.3", help="per size: the share of its keys updated")
    parser.add_argument("--buckets", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.sizes.split(",")]
    shares = [float(share) for share in args.changed.split(",")]
    print(f"{'mirror rows':>12} {'updated':>9} {'delta-rs s':>11} {'split s':>8} {'split / delta-rs':>17}")
    for size, share in zip(sizes, shares, strict=True):
        updated = int(size * share)
        rows = _changes(range(size), DMLType.INSERT, 5, 0)
        updates = _changes(range(0, 2 * updated, 2), DMLType.UPDATE, 6, size)
        best = {0: float("inf"), 1: float("inf")}
        lakes: dict[int, list[dict[str, object]]] = {}
        for _ in range(args.repeats):
            for split in (0, 1):
                root = Path(tempfile.mkdtemp(prefix="bucket-merges-"))
                try:
                    best[split] = min(best[split], _merge_seconds(root, args.buckets, split, rows, updates))
                    mirror = DeltaTable(str(table_uri(root, "shop", "kv")))
                    lake = mirror.to_pyarrow_table(columns=["id", "v"]).sort_by("id").to_pylist()
                    lakes.setdefault(split, lake)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
        assert lakes[0] == lakes[1], "the split MERGE's mirror differs from delta-rs's"
        print(f"{size:>12,} {updated:>9,} {best[0]:>11.2f} {best[1]:>8.2f} {best[1] / best[0]:>16.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
