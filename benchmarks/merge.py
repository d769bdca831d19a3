"""Mirror MERGE at scale: does a MERGE cost follow the files holding the changed keys, not the table size?

Run: `python benchmarks/merge.py [--sizes 1000000,10000000] [--changes 100000] [--batches 3] [--file-mb 1]`.

With `--intervals 1,5,20 [--buckets 0,16] [--merges 2]` it measures the cadence matrix instead (issue 24):
per table size and bucket count one mirror is built, then for each key mode and mirror interval k, cycles of
`--changes` changes go to the changelog and the mirror is MERGEd every k cycles with the net change per key
(`DeltaSink(mirror_interval_rows=k * changes)`, MERGEd when progress is recorded; k = 1 is the default sink,
MERGEing each batch). Per MERGE: rows it wrote and its seconds, both per change of the cycles it covers
(median of `--merges` MERGEs). Targets at 10M rows, 10-cycle interval: recent 10% <= 2x rows written per
changed row, uniform <= 12x.

For each table size a mirror is built as the Delta sink keeps one (registered in the lakehouse catalog,
bounded files of `--file-mb`, sorted by key as after `ticdc-consumer maintain --cluster`), then batches of
`--changes` changes go through `DeltaSink.write` (catalog lookup, exactly-once filter, deletes side table,
key-range MERGE) with keys
  - recent 1% / recent 10%: in the most recent 1% / 10% of the key space (90% updates, 5% deletes of keys
    there, 5% inserts of new keys above the largest: a table whose activity is on its newest rows);
  - uniform: anywhere in the key space (the same mix).
Per MERGE: wall time of the write, files scanned / skipped / rewritten, rows the MERGE wrote per changed
row (changed = updated + inserted + deleted keys). Median over `--batches` batches per mode.
For reference, in the same run: the MERGE the sink made before this change (equality predicate only,
streamed source) on the recent-1% batches.

Targets (issue): the recent-key MERGE at the largest size within 2x of its time at the smallest; rows
written <= 5x rows changed for recent keys. The machine is shared: read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import DeltaTable, write_deltalake
from orders import BASE_TS, SCHEMA, base_columns, base_marks, change_batch, mirror_schema, random_changes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from consumer.batches.changes import TableChanges
from consumer.lakehouse.catalog import Catalog
from consumer.lakehouse.settings import MirrorCadence, record_mirror_cadence
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import BUCKET, bucket_of, read_delta, read_mirror
from consumer.sinks.base import CommitContext
from consumer.sinks.delta import DeltaSink

MODES = {"recent 1%": 0.01, "recent 10%": 0.10, "uniform": 1.0}


@dataclass
class Merge:
    seconds: float
    scanned: int
    skipped: int
    rewritten: int
    written: int
    changed: int

    @classmethod
    def of(cls, seconds: float, metrics: dict[str, int]) -> Merge:
        """From delta-rs MERGE metrics; changed = updated + inserted + deleted rows."""
        return cls(
            seconds,
            metrics["num_target_files_scanned"],
            metrics["num_target_files_skipped_during_scan"],
            metrics["num_target_files_removed"],
            metrics["num_output_rows"],
            sum(metrics[f"num_target_rows_{k}"] for k in ("updated", "inserted", "deleted")),
        )


class Bench:
    """One mirror of `rows` keys and the sink writing it."""

    def __init__(self, root: Path, rows: int, file_mb: float, seed: int, buckets: int = 0) -> None:
        self.rows = rows
        self.top = rows  # keys 0 .. top-1 exist (some deleted)
        self.rng = np.random.default_rng(seed)
        self.offset = 0
        self.ts = BASE_TS + 1_000_000
        self.root, self.file_bytes, self.buckets = root, int(file_mb * 1024 * 1024), buckets
        self.sink = self.new_sink()
        location = Catalog(LakeRoot.of(root)).locate((SCHEMA.database, SCHEMA.table), BASE_TS).location
        self.uri = str(root / location / "mirror")
        started = time.perf_counter()
        self._build(rows, self.file_bytes)
        self.build_seconds = time.perf_counter() - started

    def new_sink(self, interval_rows: int = 0) -> DeltaSink:
        """The sink writing the mirror: each batch MERGEd (mirror only), or lazily every `interval_rows`
        changelog rows (changelog and mirror). The lake records the cadence: one writer at a time here."""
        record_mirror_cadence(LakeRoot.of(self.root), MirrorCadence(0, interval_rows), replace=True)
        return DeltaSink(
            self.root,
            mode="both" if interval_rows else "mirror",
            target_file_size=self.file_bytes,
            mirror_buckets=self.buckets,
            mirror_interval_rows=interval_rows,
        )

    def _build(self, rows: int, file_bytes: int) -> None:
        """The mirror as the sink stores it (created by the sink: bucketed when asked), written in key
        order in bounded files."""
        schema = mirror_schema()
        self.sink._mirror(self.uri, schema, ("id",), 0)
        if self.buckets:
            schema = schema.append(pa.field(BUCKET, pa.int64(), False))
        step = 2_000_000
        for start in range(0, rows, step):
            keys = np.arange(start, min(rows, start + step))
            columns = base_columns(self.rng, keys)
            if self.buckets:
                columns.append(bucket_of(pa.array(keys), self.buckets))
            write_deltalake(
                self.uri,
                pa.Table.from_arrays([pa.array(c) for c in columns], schema=schema),
                mode="append",
                partition_by=[BUCKET] if self.buckets else None,
                target_file_size=file_bytes,
                commit_properties=base_marks(),
            )

    def batch(self, share: float, changes: int) -> TableChanges:
        """`changes` changes: 90% updates and 5% deletes of keys in the newest `share` of the key space,
        5% inserts of new keys; one commit ts per change, in offset order on partition 0."""
        low = int(self.top * (1 - share))
        keys, kinds, self.top = random_changes(self.rng, low, self.top, changes)
        offsets = np.arange(self.offset, self.offset + len(keys))
        commit_ts = self.ts + offsets - self.offset
        self.offset += len(keys)
        self.ts += len(keys)
        return change_batch(self.rng, keys, kinds, "bench", offsets, commit_ts)

    def cycle(self, changes: TableChanges) -> Merge | None:
        """One cycle through the lazy sink: the batch to the changelog, progress recorded up to it (the
        MERGE, when due, runs then); the MERGE's metrics and the time of the record that ran it."""
        before = self.sink.operation_metrics()
        self.sink.write(changes, CommitContext("bench", resolved_ts=self.ts))
        tp = ("bench", 0)
        context = CommitContext("bench", {tp: self.offset}, self.ts, b"", {tp: self.ts})
        started = time.perf_counter()
        self.sink.record_progress(context)
        seconds = time.perf_counter() - started
        after = self.sink.operation_metrics()
        if after["merges"] == before["merges"]:
            return None
        return Merge.of(seconds, {name: after[name] - before[name] for name in after})

    def merge(self, changes: TableChanges) -> Merge:
        before = self.sink.operation_metrics()
        started = time.perf_counter()
        self.sink.write(changes, CommitContext("bench", resolved_ts=self.ts))
        seconds = time.perf_counter() - started
        after = self.sink.operation_metrics()
        return Merge.of(seconds, {name: after[name] - before[name] for name in after})

    def merge_as_before(self, changes: TableChanges) -> Merge:
        """The MERGE as the sink made it before key ranges: equality on the key only, streamed source."""
        latest = changes.changelog.select(["id", "name", "qty", "price", "_commit_ts", "_schema_version"])
        latest = latest.append_column("_change_type", changes.changelog["_change_type"])
        latest = (
            latest.group_by("id", use_threads=False)
            .aggregate([("_commit_ts", "max")])
            .join(latest, ["id", "_commit_ts_max"], ["id", "_commit_ts"])
            .rename_columns({"_commit_ts_max": "_commit_ts"})
        )
        table = DeltaTable(self.uri)
        columns = ["id", "name", "qty", "price", "_commit_ts", "_schema_version"]
        assignments = {f"`{c}`": f"s.`{c}`" for c in columns}
        started = time.perf_counter()
        metrics = (
            table.merge(latest, "t.id = s.id", source_alias="s", target_alias="t")
            .when_matched_update(assignments, "s._change_type <> 'delete' AND s._commit_ts >= t._commit_ts")
            .when_matched_delete("s._change_type = 'delete' AND s._commit_ts >= t._commit_ts")
            .when_not_matched_insert(assignments, "s._change_type <> 'delete'")
            .execute()
        )
        return Merge.of(time.perf_counter() - started, metrics)


def median(merges: list[Merge]) -> Merge:
    return Merge(
        statistics.median(m.seconds for m in merges),
        int(statistics.median(m.scanned for m in merges)),
        int(statistics.median(m.skipped for m in merges)),
        int(statistics.median(m.rewritten for m in merges)),
        int(statistics.median(m.written for m in merges)),
        int(statistics.median(m.changed for m in merges)),
    )


def run(size: int, args: argparse.Namespace, work: Path) -> dict[str, Merge]:
    bench = Bench(work / f"lake-{size}", size, args.file_mb, seed=size % 1000)
    files = len(DeltaTable(bench.uri).file_uris())
    print(f"{size:,} rows: built in {bench.build_seconds:.1f} s, {files} files", flush=True)
    bench.merge(bench.batch(0.01, args.changes))  # warm-up: caches, the side table
    results = {}
    for mode, share in MODES.items():
        results[mode] = median([bench.merge(bench.batch(share, args.changes)) for _ in range(args.batches)])
        print(f"  {mode}: {results[mode].seconds:.2f} s", flush=True)
    as_before = [bench.merge_as_before(bench.batch(0.01, args.changes)) for _ in range(args.batches)]
    results["recent 1%, MERGE as before"] = median(as_before)
    return results


def report(sizes: list[int], results: dict[int, dict[str, Merge]]) -> None:
    head = (
        f"{'rows':>11} {'keys':<28} {'seconds':>8} {'scanned':>8} {'skipped':>8} {'rewritten':>9} "
        f"{'rows written':>12} {'changed':>8} {'written/changed':>15}"
    )
    print(head)
    print("-" * len(head))
    for size in sizes:
        for mode, m in results[size].items():
            print(
                f"{size:>11,} {mode:<28} {m.seconds:>8.2f} {m.scanned:>8} {m.skipped:>8} {m.rewritten:>9} "
                f"{m.written:>12,} {m.changed:>8,} {m.written / max(m.changed, 1):>14.2f}x"
            )
    small, large = min(sizes), max(sizes)
    print()
    for mode in MODES:
        ratio = results[large][mode].seconds / results[small][mode].seconds
        amplification = results[large][mode].written / max(results[large][mode].changed, 1)
        target = " (target <= 2x; written/changed <= 5x)" if mode.startswith("recent") else ""
        print(
            f"{mode}: MERGE at {large:,} rows takes {ratio:.2f}x its time at {small:,}; "
            f"writes {amplification:.2f}x the rows it changes at {large:,}{target}"
        )
    before = results[large]["recent 1%, MERGE as before"]
    now = results[large]["recent 1%"]
    print(
        f"recent 1% at {large:,} rows: {before.seconds / now.seconds:.1f}x faster than the MERGE as before, "
        f"{before.written / max(now.written, 1):.1f}x fewer rows written"
    )


@dataclass
class Cadence:
    """The MERGEs of one (size, buckets, keys, interval) cell, each with the changes of the cycles it
    covers."""

    merges: list[Merge]
    covered: int  # changes per MERGE: interval x changes per cycle
    files: int  # the mirror's files before the cell

    def per_change(self) -> tuple[float, float]:
        """Median rows written and MERGE microseconds, per change covered."""
        written = statistics.median(m.written for m in self.merges) / self.covered
        micros = statistics.median(m.seconds for m in self.merges) / self.covered * 1e6
        return written, micros


def run_cadences(
    size: int, buckets: int, args: argparse.Namespace, work: Path
) -> dict[tuple[str, int], Cadence]:
    """Every key mode and interval on one mirror of `size` rows with `buckets` buckets."""
    bench = Bench(work / f"lake-{size}-b{buckets}", size, args.file_mb, seed=size % 1000, buckets=buckets)
    files = len(DeltaTable(bench.uri).file_uris())
    print(
        f"{size:,} rows, {buckets} buckets: built in {bench.build_seconds:.1f} s, {files} files", flush=True
    )
    bench.merge(bench.batch(0.01, args.changes))  # warm-up: caches, the side table
    results = {}
    for mode, share in MODES.items():
        for interval in args.intervals:
            files = len(DeltaTable(bench.uri).file_uris())
            merges = []
            if interval == 1:  # the default sink: each batch MERGEd as it is written
                bench.sink = bench.new_sink()
                merges = [bench.merge(bench.batch(share, args.changes)) for _ in range(args.merges)]
            else:
                bench.sink = bench.new_sink(interval * args.changes)
                tp = ("bench", 0)
                bench.sink.record_progress(
                    CommitContext("bench", {tp: bench.offset}, bench.ts, b"", {tp: bench.ts})
                )
                while len(merges) < args.merges:
                    merge = bench.cycle(bench.batch(share, args.changes))
                    if merge is not None:
                        merges.append(merge)
            results[(mode, interval)] = Cadence(merges, interval * args.changes, files)
            written, micros = results[(mode, interval)].per_change()
            print(
                f"  {mode}, every {interval} cycles: {written:.2f} rows written, {micros:.1f} us per change",
                flush=True,
            )
    return results


def report_cadences(
    args: argparse.Namespace, results: dict[tuple[int, int], dict[tuple[str, int], Cadence]]
) -> None:
    head = (
        f"{'rows':>11} {'buckets':>7} {'keys':<11} {'interval':>8} {'MERGE s':>8} {'rewritten':>9} "
        f"{'of files':>8} {'written/change':>14} {'written/net':>11} {'us/change':>9}"
    )
    print(head)
    print("-" * len(head))
    for (size, buckets), cells in results.items():
        for (mode, interval), cell in cells.items():
            written, micros = cell.per_change()
            seconds = statistics.median(m.seconds for m in cell.merges)
            rewritten = int(statistics.median(m.rewritten for m in cell.merges))
            net = statistics.median(m.written / max(m.changed, 1) for m in cell.merges)
            print(
                f"{size:>11,} {buckets:>7} {mode:<11} {interval:>8} {seconds:>8.2f} {rewritten:>9} "
                f"{cell.files:>8} {written:>13.2f}x {net:>10.2f}x {micros:>9.1f}"
            )
    print()
    print(
        "written/change: rows the MERGE wrote per change of the cycles it covers; written/net: per key it "
        "changed (updated + inserted + deleted);\ntargets (issue 24, at 10M rows, 10-cycle interval): "
        "recent 10% <= 2x rows written per changed row, uniform <= 12x"
    )


def run_as_of(
    size: int, tails: list[float], args: argparse.Namespace, work: Path
) -> list[tuple[int, float, float, float]]:
    """A fresh read (mirror + changelog tail) of a lazy mirror of `size` rows whose changelog holds a tail
    of each share of `tails` (uniform keys, never MERGEd), against reading the mirror alone: a bare scan of
    its files, and the SDK's read of it before any tail (both best of 3). Returns (tail changes, fresh
    read s, scan s, SDK read without tail s) per tail."""
    bench = Bench(work / f"as-of-{size}", size, args.file_mb, seed=size % 1000)
    print(f"{size:,} rows: built in {bench.build_seconds:.1f} s", flush=True)
    bench.sink = bench.new_sink(2**62)  # lazy, never due: the changelog grows, the mirror stays
    tp = ("bench", 0)
    bench.sink.record_progress(CommitContext("bench", {tp: bench.offset}, bench.ts, b"", {tp: bench.ts}))
    lake = LakeRoot.of(bench.root)
    untailed = best_of(3, lambda: read_mirror(bench.root, SCHEMA.database, SCHEMA.table))
    results, tail = [], 0
    for share in sorted(tails):
        while tail < share * size:
            count = min(args.changes, int(share * size) - tail)
            bench.cycle(bench.batch(1.0, count))
            tail += count
        rows = read_mirror(bench.root, SCHEMA.database, SCHEMA.table)
        assert rows is not None and rows.num_rows >= size * 0.95, "the fresh read lost rows"
        fresh = best_of(3, lambda: read_mirror(bench.root, SCHEMA.database, SCHEMA.table))
        alone = best_of(3, lambda: read_delta(lake, DeltaTable(bench.uri)))
        results.append((tail, fresh, alone, untailed))
        print(f"  tail {tail:,}: fresh read {fresh:.2f} s, mirror alone {alone:.2f} s", flush=True)
    return results


def best_of(times: int, read: Callable[[], object]) -> float:
    seconds = []
    for _ in range(times):
        started = time.perf_counter()
        read()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def parse_sizes(text: str) -> list[int]:
    try:
        values = [int(part.replace("_", "")) for part in text.split(",") if part.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive numbers, not {text!r}")
    return sorted(set(values))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=parse_sizes, default=[1_000_000, 10_000_000], help="table rows")
    parser.add_argument("--changes", type=int, default=100_000, help="changes per batch (default 100000)")
    parser.add_argument("--batches", type=int, default=3, help="batches per mode, median counts (default 3)")
    parser.add_argument("--file-mb", type=float, default=1.0, help="mirror target file size (default 1)")
    parser.add_argument("--workdir", type=Path, help="keep the tables here (default: a temporary directory)")
    parser.add_argument(
        "--intervals",
        type=parse_sizes,
        help="the cadence matrix: mirror intervals in cycles, e.g. 1,5,10,20 (default: the single-MERGE run)",
    )
    parser.add_argument("--buckets", default="0", help="cadence matrix: bucket counts, e.g. 0,16 (default 0)")
    parser.add_argument("--merges", type=int, default=2, help="cadence matrix: MERGEs per cell, median (2)")
    parser.add_argument(
        "--as-of-tails",
        help="instead: fresh reads of a lazy mirror with changelog tails of these shares, e.g. 0.01,0.1",
    )
    args = parser.parse_args(argv)
    if min(args.changes, args.batches) <= 0 or args.file_mb <= 0:
        parser.error("--changes, --batches and --file-mb must be positive")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="merge-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if args.as_of_tails:
        tails = [float(t) for t in args.as_of_tails.split(",")]
        try:
            reads = {size: run_as_of(size, tails, args, work) for size in args.sizes}
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        print(
            f"\n{'rows':>11} {'tail':>9} {'fresh read s':>12} {'files scan s':>12} {'ratio':>6} "
            f"{'SDK read, no tail s':>19} {'ratio':>6}"
        )
        for size, rows in reads.items():
            for tail, fresh, alone, untailed in rows:
                print(
                    f"{size:>11,} {tail:>9,} {fresh:>12.2f} {alone:>12.2f} {fresh / alone:>5.2f}x "
                    f"{untailed:>19.2f} {fresh / untailed:>5.2f}x"
                )
        print("target (issue 24): 1M rows with a 10% tail within 2x of reading the mirror alone")
        print(f"total run time {time.perf_counter() - began:.0f} s")
        return 0
    if args.intervals:
        bucket_counts = [int(b) for b in args.buckets.split(",")]
        if args.merges <= 0 or min(bucket_counts) < 0:
            parser.error("--merges must be positive, --buckets >= 0")
        try:
            cells = {
                (size, buckets): run_cadences(size, buckets, args, work)
                for size in args.sizes
                for buckets in bucket_counts
            }
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        print()
        print(
            f"{args.changes:,} changes per cycle, mirror files of {args.file_mb:g} MiB, "
            f"median of {args.merges}"
        )
        report_cadences(args, cells)
        print(f"total run time {time.perf_counter() - began:.0f} s")
        return 0
    try:
        results = {size: run(size, args, work) for size in args.sizes}
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print(
        f"{args.changes:,} changes per MERGE, mirror files of {args.file_mb:g} MiB, median of {args.batches}"
    )
    report(args.sizes, results)
    print(f"total run time {time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
