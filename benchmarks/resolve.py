"""Consumer state machine: resolve throughput, and memory while rows wait for a schema.

Run: `python benchmarks/resolve.py [--rows N] [--held-rows N] [--budget-mib N]`.

1. Throughput. 3 partitions carry 20 tables (each table on one partition, the default dispatcher); the
   BOOTSTRAPs come first, then ~300-byte DMLs round-robin with a watermark on every partition every
   1,000 rows. Timed: `process` of every record, `resolve` after each watermark round, `confirm` of every
   unit and `committable`. Also reported: the share of that spent in `resolve` alone. Best of 3.
2. Memory. A consumer joins mid-stream: `--held-rows` DMLs of 20 tables whose schema it has not seen
   arrive on 3 data partitions; their BOOTSTRAPs are on partition 0 only
   (`send-bootstrap-to-all-partition=false`), which lags. The source feeds a partition only while
   `paused()` does not name it, as a Kafka source would. When every data partition is paused it has
   nothing left to feed but partition 0, whose BOOTSTRAPs release the rows; feeding then resumes until
   every row went out. Peak memory is traced with tracemalloc.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from itertools import count
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from consumer.errors import DeadLetter, RecordLocation
from consumer.protocol.model import (
    Bootstrap,
    Column,
    DataType,
    DMLType,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.state import ConsumerState, RowBatch, Unit
from consumer.state.pending import row_size

TOPIC = "bench"
TABLES = 20
PARTITIONS = 3
PAYLOAD_BYTES = 300
WATERMARK_EVERY = 1_000  # rows between watermark rounds
REPEATS = 3
MiB = 1 << 20
BASE_TS = 449_811_223_446_634_498


def table_schema(table: int) -> TableSchema:
    columns = tuple(Column(name=f"c{i}", data_type=DataType(mysql_type="varchar")) for i in range(12))
    return TableSchema(
        database="shop", table=f"t{table:02d}", table_id=100 + table, version=7, columns=columns
    )


SCHEMAS = [table_schema(t) for t in range(TABLES)]


def dml(i: int, table: int) -> RawDML:
    """A DML as the codec decodes it: its own strings and payload, a realistic ~300-byte value."""
    return RawDML(
        type=DMLType.INSERT,
        database="".join(("sh", "op")),
        table=f"t{table:02d}",
        table_id=100 + table,
        commit_ts=BASE_TS + i,
        build_ts=1_700_000_000_000 + i,
        schema_version=7,
        payload=b"%0*d" % (PAYLOAD_BYTES, i),
        encoding="json",
    )


def watermark(ts: int) -> Watermark:
    return Watermark(commit_ts=ts, build_ts=0)


class Feeder:
    """Consecutive offsets per partition, as Kafka assigns them."""

    def __init__(self, state: ConsumerState) -> None:
        self.state = state
        self.offsets: dict[int, Iterator[int]] = {}

    def send(self, partition: int, message: RawDML | Watermark | Bootstrap) -> None:
        offsets = self.offsets.setdefault(partition, count())
        self.state.process(RecordLocation(TOPIC, partition, next(offsets)), message)


def apply(state: ConsumerState) -> tuple[int, int]:
    """Resolve, confirm every unit, commit; returns (rows emitted, dead letters)."""
    units: list[Unit] = state.resolve()
    rows = dead = 0
    for unit in units:
        if isinstance(unit, RowBatch):
            rows += len(unit.rows)
        elif isinstance(unit, DeadLetter):
            dead += 1
        state.confirm(unit)
    state.committable()
    return rows, dead


# -- 1. throughput ---------------------------------------------------------------------------------
def throughput(rows: int) -> tuple[float, float]:
    """(seconds for process + resolve + confirm, seconds inside resolve) for one run."""
    records = [dml(i, i % TABLES) for i in range(rows)]
    state = ConsumerState()
    state.assign((TOPIC, p) for p in range(PARTITIONS))
    feeder = Feeder(state)
    for schema in SCHEMAS:
        for p in range(PARTITIONS):
            feeder.send(p, Bootstrap(table_schema=schema, build_ts=0))
    emitted = 0
    in_resolve = 0.0
    start = time.perf_counter()
    for i, record in enumerate(records, start=1):
        feeder.send(record.table_id % PARTITIONS, record)
        if i % WATERMARK_EVERY == 0 or i == rows:
            for p in range(PARTITIONS):
                feeder.send(p, watermark(BASE_TS + i))
            before = time.perf_counter()
            emitted += apply(state)[0]
            in_resolve += time.perf_counter() - before
    elapsed = time.perf_counter() - start
    assert emitted == rows, (emitted, rows)
    return elapsed, in_resolve


# -- 2. memory under backpressure ------------------------------------------------------------------
def held_memory(rows: int, budget: int) -> dict[str, float]:
    state = ConsumerState(budget_bytes=budget)
    data_partitions = range(1, PARTITIONS + 1)
    state.assign((TOPIC, p) for p in range(PARTITIONS + 1))
    feeder = Feeder(state)
    fed = emitted = dead = pauses = 0
    max_held = 0
    fed_at_pause = held_at_pause = peak_waiting = None
    bootstrapped = False
    tracemalloc.start()
    while fed < rows:
        paused = {p for _, p in state.paused()}
        open_partitions = [p for p in data_partitions if p not in paused]
        if not open_partitions:
            pauses += 1
            if fed_at_pause is None:
                fed_at_pause, held_at_pause = fed, state.stats().held_bytes
                peak_waiting = tracemalloc.get_traced_memory()[1]
            if bootstrapped:
                raise SystemExit("backpressure stalled the source with every schema known")
            for schema in SCHEMAS:  # the lagging partition 0 finally delivers its BOOTSTRAPs
                feeder.send(0, Bootstrap(table_schema=schema, build_ts=0))
            bootstrapped = True
        for p in open_partitions:
            for _ in range(WATERMARK_EVERY // len(open_partitions)):
                if fed == rows:
                    break
                table = PARTITIONS * (fed % (TABLES // PARTITIONS)) + (p - 1)
                feeder.send(p, dml(fed, table % TABLES))
                fed += 1
        max_held = max(max_held, state.stats().held_bytes)
        if bootstrapped:
            for p in range(PARTITIONS + 1):
                feeder.send(p, watermark(BASE_TS + fed))
            got_rows, got_dead = apply(state)
            emitted, dead = emitted + got_rows, dead + got_dead
    for p in range(PARTITIONS + 1):
        feeder.send(p, watermark(BASE_TS + fed))
    got_rows, got_dead = apply(state)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "fed": fed,
        "emitted": emitted + got_rows,
        "dead": dead + got_dead,
        "pauses": pauses,
        "fed_at_pause": fed_at_pause or 0,
        "held_at_pause": held_at_pause or 0,
        "max_held": max_held,
        "peak_waiting": peak_waiting or peak,
        "peak": peak,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000, help="DMLs for the throughput run")
    parser.add_argument("--held-rows", type=int, default=1_000_000, help="DMLs waiting for a schema")
    parser.add_argument("--budget-mib", type=int, default=256, help="ConsumerState budget_bytes in MiB")
    args = parser.parse_args(argv)
    if min(args.rows, args.held_rows, args.budget_mib) <= 0:
        parser.error("--rows, --held-rows and --budget-mib must be positive")

    print(
        f"throughput: {PARTITIONS} partitions, {TABLES} tables, {args.rows:,} DMLs of {PAYLOAD_BYTES} bytes"
    )
    best = min(throughput(args.rows) for _ in range(REPEATS))
    total, in_resolve = best
    print(f"  process + resolve + confirm: {args.rows / total:>12,.0f} rows/s  ({total:.2f} s)")
    print(f"  resolve + confirm alone:     {args.rows / in_resolve:>12,.0f} rows/s  ({in_resolve:.2f} s)")

    budget = args.budget_mib * MiB
    print(f"memory: {args.held_rows:,} DMLs wait for their schema, budget {args.budget_mib} MiB")
    m = held_memory(args.held_rows, budget)
    print(f"  backpressure engaged after {m['fed_at_pause']:,} DMLs ({m['pauses']} stall(s) of the source)")
    print(f"  held at the pause:    {m['held_at_pause'] / MiB:8.1f} MiB (accounted)")
    print(f"  max held:             {m['max_held'] / MiB:8.1f} MiB (accounted)")
    print(f"  peak traced, waiting: {m['peak_waiting'] / MiB:8.1f} MiB")
    print(f"  peak traced, overall: {m['peak'] / MiB:8.1f} MiB")
    unbounded = args.held_rows * row_size(dml(0, 0))
    print(f"  holding all of them would take {unbounded / MiB:.1f} MiB (accounted)")
    print(f"  emitted {m['emitted']:,} of {m['fed']:,} rows, {m['dead']:,} dead letters")

    ok = m["max_held"] <= budget and m["peak_waiting"] <= budget and m["pauses"] > 0
    ok = ok and m["emitted"] == m["fed"] == args.held_rows and m["dead"] == 0
    print("  within budget, backpressure engaged, nothing dropped" if ok else "  FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
