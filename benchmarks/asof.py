"""As-of reads: what does reading a table as of a TSO cost beside reading its mirror alone, by the size of
the changelog tail the read applies?

Run: `python benchmarks/asof.py [--rows 1000000] [--tails 0,0.01,0.05,0.1,0.2] [--repeats 3] [--file-mb 1]`.

A mirror of `--rows` keys is built as the Delta sink keeps one (registered in the lakehouse catalog, its key
recorded, bounded files in key order, its commit metadata saying it holds every change up to the base TSO),
then changes after it go to the table's changelog through `DeltaSink.write` (mode `changelog`: the mirror
lags, as with a long mirror interval): 90% updates, 5% deletes, 5% inserts of new keys, keys uniform over
the table, one commit ts each. For each tail size (a share of `--rows`, cumulative) the script times
  - the mirror alone: its current Delta version read into Arrow (`read_delta`), what any Delta reader pays;
  - `read_mirror(root, db, table, as_of_tso=T)` at the tail's newest TSO: the mirror version, the tail's
    changes in (base, T], applied per key with the MERGE's rules;
and checks the as-of read's row count against the keys the changes leave. Best of `--repeats`.

Target (issue 24): with a 10% tail on a 1M-row table the as-of read within 2x of reading the mirror alone.
The machine is shared: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, write_deltalake

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from consumer.batches.changes import TableChanges, changelog_schema, stored_schema
from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.ddl import DDLLog
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import COMPLETE_TS, KEY_PROPERTY, NEWEST_TS, read_delta, read_mirror
from consumer.protocol.model import DDL, TSO_PHYSICAL_SHIFT, Column, DataType, DDLType, Index, TableSchema
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink

SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=1,
    version=1,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("name", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=32)),
        Column("qty", DataType("bigint", length=20)),
        Column("price", DataType("double", length=22)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
BASE_TS = 1_700_000_000_000 << TSO_PHYSICAL_SHIFT
TOPIC, GROUP = "bench", "bench"


class Lake:
    """A lakehouse root holding one table: a mirror at BASE_TS and a changelog tail after it."""

    def __init__(self, root: Path, rows: int, file_mb: float, seed: int) -> None:
        self.root, self.rows = root, rows
        self.rng = np.random.default_rng(seed)
        self.top, self.offset, self.ts = rows, 0, BASE_TS
        self.live = set(range(rows))
        lake = LakeRoot.of(root)
        location = Catalog(lake).locate((SCHEMA.database, SCHEMA.table), BASE_TS - 1).location
        create = DDL(
            type=DDLType.CREATE,
            sql="CREATE TABLE orders",
            commit_ts=BASE_TS - 1,
            build_ts=0,
            table_schema=SCHEMA,
        )
        DDLLog(lake).record(create, SCHEMA.database, SCHEMA.table)  # the lake's earliest change
        self.uri = str(root / location / "mirror")
        self.sink = DeltaSink(root, mode="changelog")
        self._build(int(file_mb * 1024 * 1024))

    def _build(self, file_bytes: int) -> None:
        user = stored_schema(TableCodec(SCHEMA))
        fields = [f.with_nullable(True) if f.name != "id" else f for f in user]
        meta = [pa.field("_commit_ts", pa.int64(), False), pa.field("_schema_version", pa.int64(), False)]
        schema = pa.schema([*fields, *meta])
        marks = CommitProperties(custom_metadata={COMPLETE_TS: str(BASE_TS), NEWEST_TS: str(BASE_TS)})
        step = 1_000_000
        for start in range(0, self.rows, step):
            keys = np.arange(start, min(self.rows, start + step))
            columns = [*self._values(keys), np.full(len(keys), BASE_TS), np.full(len(keys), 1)]
            write_deltalake(
                self.uri,
                pa.Table.from_arrays([pa.array(c) for c in columns], schema=schema),
                mode="append",
                configuration={"delta.targetFileSize": str(file_bytes)},
                target_file_size=file_bytes,
                commit_properties=marks,
            )
        DeltaTable(self.uri).alter.set_table_properties({KEY_PROPERTY: "id"}, raise_if_not_exists=False)

    def _values(self, keys: np.ndarray) -> list[pa.Array]:
        return [
            pa.array(keys, pa.int64()),
            pa.array([f"order-{k}" for k in keys.tolist()], pa.string()),
            pa.array(self.rng.integers(0, 1000, len(keys)), pa.int64()),
            pa.array(self.rng.random(len(keys)), pa.float64()),
        ]

    def grow_tail(self, changes: int) -> None:
        """`changes` more changes in the changelog, in batches of 100k; progress recorded at the last."""
        for start in range(0, changes, 100_000):
            self.sink.write(
                self._batch(min(100_000, changes - start)), CommitContext(GROUP, resolved_ts=self.ts)
            )
        applied = {(TOPIC, 0): self.ts}
        self.sink.record_progress(CommitContext(GROUP, {(TOPIC, 0): self.offset}, self.ts, b"", applied))

    def _batch(self, changes: int) -> TableChanges:
        inserts = changes // 20
        existing = self.rng.integers(0, self.top, changes - inserts)
        new = np.arange(self.top, self.top + inserts)
        self.top += inserts
        keys = np.concatenate([existing, new])
        kinds = np.array(["update_postimage"] * len(existing) + ["insert"] * inserts, dtype=object)
        kinds[: len(existing)][self.rng.random(len(existing)) < 0.05 / 0.95] = "delete"
        order = self.rng.permutation(len(keys))
        keys, kinds = keys[order], kinds[order]
        for key, kind in zip(keys.tolist(), kinds.tolist(), strict=True):
            (self.live.discard if kind == "delete" else self.live.add)(key)
        count = len(keys)
        offsets = np.arange(self.offset, self.offset + count)
        commit_ts = self.ts + 1 + offsets - self.offset
        self.offset += count
        self.ts = int(commit_ts[-1])
        meta = [
            pa.array(kinds.tolist(), pa.string()),
            pa.array(commit_ts, pa.int64()),
            pa.array((commit_ts >> TSO_PHYSICAL_SHIFT) * 1000, pa.timestamp("us", tz="UTC")),
            pa.array(np.full(count, 1), pa.int64()),
            pa.array([TOPIC] * count, pa.string()),
            pa.array(np.zeros(count), pa.int32()),
            pa.array(offsets, pa.int64()),
        ]
        schema = changelog_schema(TableCodec(SCHEMA))
        return TableChanges(SCHEMA, pa.Table.from_arrays([*self._values(keys), *meta], schema=schema))


def best(repeats: int, read: Callable[[], pa.Table]) -> tuple[float, pa.Table]:
    times, rows = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        rows = read()
        times.append(time.perf_counter() - started)
    assert rows is not None
    return min(times), rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tails", default="0,0.01,0.05,0.1,0.2", help="tail sizes, shares of --rows")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--file-mb", type=float, default=1.0)
    args = parser.parse_args(argv)
    tails = sorted(float(t) for t in args.tails.split(","))
    work = Path(tempfile.mkdtemp(prefix="asof-bench-"))
    try:
        started = time.perf_counter()
        lake = Lake(work / "lake", args.rows, args.file_mb, seed=7)
        lake.grow_tail(0)
        mirror = DeltaTable(lake.uri)
        print(
            f"{args.rows:,}-row mirror built in {time.perf_counter() - started:.1f} s, "
            f"{len(mirror.file_uris())} files",
            flush=True,
        )
        root = LakeRoot.of(work / "lake")
        read_delta(root, DeltaTable(lake.uri))  # warm-up: the files' first read
        print("| changelog tail | tail / rows | mirror alone s | as-of read s | as-of / mirror alone |")
        print("|---|---|---|---|---|")
        written = 0
        for share in tails:
            lake.grow_tail(int(share * args.rows) - written)
            written = int(share * args.rows)
            alone, plain = best(args.repeats, lambda: read_delta(root, DeltaTable(lake.uri)))
            as_of, rows = best(
                args.repeats, lambda: read_mirror(work / "lake", "shop", "orders", as_of_tso=lake.ts)
            )
            assert plain.num_rows == args.rows and rows.num_rows == len(lake.live), (
                rows.num_rows,
                len(lake.live),
            )
            print(
                f"| {written:,} | {share:.0%} | {alone:.2f} | {as_of:.2f} | {as_of / alone:.2f}x |",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
