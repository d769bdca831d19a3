"""Debezium against Simple JSON, routing and rows apart, in thread CPU time: `decode.py`'s Debezium ratio on
a shared machine, where wall-clock rounds move by 2x with the load.

Run: `python benchmarks/decode_split.py [--rows N] [--batch N] [--rounds N]`.

The same values as `decode.py` (its table, rows and encoders); per path, each batch is routed
(`decode_records`) then decoded (`TableCodec.decode_changes`), each step timed with `time.thread_time`
(the CPU this thread got, not the time others took); each step's figure is its best of `--rounds`. The
process pins itself to CPU 0 like `decode.py`. Caches and memory are still shared with whatever else runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

import decode as bench  # the sibling benchmark (its folder is the script's path): table, rows, encoders

from consumer.protocol.debezium.decoder import DebeziumDecoder
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy


def _split(records: Sequence[Any], decoder: Any, codec: TableCodec, batch: int) -> tuple[float, float]:
    """(routing, rows) thread CPU seconds of decoding `records` a batch at a time."""
    routing = rows = 0.0
    for start in range(0, len(records), batch):
        began = time.thread_time()
        raws = decoder.decode_records(records[start : start + batch])
        routed = time.thread_time()
        codec.decode_changes(raws)
        rows += time.thread_time() - routed
        routing += routed - began
    return routing, rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=20_000, help="DML messages per path (default 20000)")
    parser.add_argument(
        "--batch", type=int, default=10_000, help="records per decode_records (default 10000)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds, best of which counts (default 5)")
    args = parser.parse_args(argv)
    pinned = bench.pin_one_core()
    policy = ValuePolicy(timestamp_location="Asia/Shanghai")
    rows = bench.typed_rows(args.rows)
    simple = bench.polled((None, value) for value in bench.encode_all(rows, "json", policy))
    debezium = bench.polled(bench.debezium_records(rows, policy))
    dbz_decoder = DebeziumDecoder()
    first = dbz_decoder.decode_record(debezium[0].key, debezium[0].value)
    dbz_codec = TableCodec(
        dbz_decoder.described_schema(first.schema_key),  # type: ignore[arg-type, union-attr]
        policy,
        protocol=dbz_decoder.protocol,
    )
    simple_codec = TableCodec(bench.SCHEMA)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):  # rounds interleave the paths
        for name, records, decoder, codec in (
            ("Simple JSON", simple, MessageDecoder(), simple_codec),
            ("Debezium", debezium, dbz_decoder, dbz_codec),
        ):
            routing, rows_s = _split(records, decoder, codec, args.batch)
            old = best.get(name, (float("inf"), float("inf")))
            best[name] = (min(old[0], routing), min(old[1], rows_s))
    print(
        f"{pinned}; {args.rows:,} INSERT DMLs, batch {args.batch:,}, best of {args.rounds} (thread CPU time)"
    )
    for name, (routing, rows_s) in best.items():
        per = 1e6 / args.rows
        both = (routing + rows_s) * per
        print(f"{name:<12} routing {routing * per:.2f} us, rows {rows_s * per:.2f} us, both {both:.2f}")
    ratio = sum(best["Simple JSON"]) / sum(best["Debezium"])
    verdict = "ok" if ratio >= bench.TARGET_DEBEZIUM_VS_JSON else "MISSED"
    print(f"Debezium / Simple JSON: {ratio:.2f}x (target >= {bench.TARGET_DEBEZIUM_VS_JSON}x: {verdict})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
