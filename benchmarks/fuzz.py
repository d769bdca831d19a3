"""The long fuzz run: millions of hostile record values through every decoding stage (issues 10, 14).

Run: `python benchmarks/fuzz.py [--protocol simple|avro|debezium] [--cases 1000000] [--seed 1] [--workers 1]
[--chunk 20000] [--chunk-timeout 1800]`.

Cases are seeded mutations of a simulated corpus (`consumer.testing.hostile.Mutator`: bit flips, truncation,
splices, deep nesting, invalid UTF-8, huge numbers and strings, wrong value types per column, hostile
schemas, headers and timestamp zones, compression bombs, Avro varints over 10 bytes; JSON and Avro) run
through `consumer.testing.fuzz.FuzzHarness`: `MessageDecoder.decode`, then `TableCodec.decode` /
`decode_batch` / `decode_changes` with the typed rows a sink writes, or a `TableCodec` of each schema. A case
may decode or raise a `ConsumerError`; anything else (or an `InternalDecodeError`) is a failure.

`--protocol avro|debezium` fuzzes TiCDC's other protocols instead (`consumer.testing.protocol_fuzz`): hostile
(key, value) records through `decode_record` and the row decode; for Avro each child starts its own
`LocalSchemaRegistry` holding the corpus's writer schemas and hostile variants of them, reached through
confluent-kafka's client. The Avro row decode runs polars-avro's native reader.

Chunks of cases run in child processes, so a crash (a segfault, an abort) or a hang (past
`--chunk-timeout`) is reported with the chunk's seed and the record in flight (each child writes the case
it is about to run to a file first) instead of ending the run; each child reports its peak memory. Failures
are written to `--failures` (JSON lines: base64 value and traceback) to be replayed. Prints cases, decoded,
ConsumerErrors by reason code, other exceptions, crashed or hung chunks and the peak memory of any child;
exits 1 if anything was not contained.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

_FAILURES_KEPT_PER_CHUNK = 20
T = TypeVar("T")


def run_chunk(protocol: str, seed: int, count: int, in_flight: Path) -> dict[str, object]:
    """In a child: `count` cases from `seed`; its report as a JSON-able dict."""
    from consumer.testing.fuzz import Corpus, FuzzHarness, FuzzReport
    from consumer.testing.hostile import mutations
    from consumer.testing.processes import peak_rss_mib

    report: FuzzReport
    if protocol == "simple":
        corpus = Corpus.simulated(seed=seed % 7)
        values = mutations(corpus.values, seed=seed, count=count)
        report = FuzzHarness(corpus).run_all(_noted(values, in_flight))
    else:
        from consumer.testing.protocol_fuzz import ProtocolCorpus, ProtocolFuzzHarness, record_mutations
        from consumer.testing.registry import LocalSchemaRegistry

        with LocalSchemaRegistry() as registry:
            foreign = ProtocolCorpus.simulated(protocol, registry.url, seed=seed % 7)  # type: ignore[arg-type]
            pairs = record_mutations(foreign, seed, count)
            report = ProtocolFuzzHarness(foreign).run_all(_noted(pairs, in_flight))
    return {
        "seed": seed,
        "cases": report.cases,
        "decoded": report.decoded,
        "errors": dict(report.consumer_errors),
        "failures": len(report.failures),
        "failed": [
            {"value": base64.b64encode(value).decode(), "trace": trace}
            for value, trace in report.failures[:_FAILURES_KEPT_PER_CHUNK]
        ],
        "peak_mib": peak_rss_mib(),
    }


def _noted(cases: Iterable[T], in_flight: Path) -> Iterator[T]:
    """The cases, each written to `in_flight` before it runs (what a crash or a hang was running)."""
    with in_flight.open("w") as file:
        for case in cases:
            parts = case if isinstance(case, tuple) else (case,)
            file.seek(0)
            file.write(json.dumps([None if p is None else base64.b64encode(p).decode() for p in parts]))
            file.truncate()
            file.flush()
            yield case


def _child(protocol: str, timeout: float, seed: int, count: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="fuzz-") as directory:
        in_flight = Path(directory) / "case.json"
        command = [sys.executable, __file__, "--protocol", protocol, "--chunk-seed", str(seed)]
        command += ["--chunk", str(count), "--in-flight", str(in_flight)]
        try:
            result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout)
        except subprocess.TimeoutExpired as exc:  # subprocess.run killed the child
            stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr)
            return _broken(seed, count, f"hung > {timeout:g} s", stderr, in_flight)
        if result.returncode != 0:
            return _broken(seed, count, f"exit {result.returncode}", result.stderr, in_flight)
        return json.loads(result.stdout.splitlines()[-1])


def _broken(seed: int, count: int, how: str, stderr: str, in_flight: Path) -> dict[str, object]:
    case = in_flight.read_text() if in_flight.exists() else "?"
    return {"seed": seed, "cases": count, "crashed": how, "stderr": stderr[-3000:], "case": case}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=("simple", "avro", "debezium"), default="simple")
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workers", type=int, default=1, help="child processes at once (the machine is shared)"
    )
    parser.add_argument("--chunk", type=int, default=20_000, help="cases per child")
    parser.add_argument(
        "--chunk-timeout", type=float, default=1800.0, help="seconds before a child counts as hung"
    )
    parser.add_argument("--failures", type=Path, default=Path("fuzz-failures.jsonl"))
    parser.add_argument("--chunk-seed", type=int, help=argparse.SUPPRESS)  # a child's own run
    parser.add_argument("--in-flight", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.chunk_seed is not None:
        print(json.dumps(run_chunk(args.protocol, args.chunk_seed, args.chunk, args.in_flight)))
        return 0

    started = time.monotonic()
    sizes = [min(args.chunk, args.cases - start) for start in range(0, args.cases, args.chunk)]
    seeds = [args.seed * 1_000_003 + index for index in range(len(sizes))]
    totals: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    crashed: list[dict[str, object]] = []
    peak = 0.0
    with ThreadPoolExecutor(args.workers) as pool, args.failures.open("w") as failures:
        child = functools.partial(_child, args.protocol, args.chunk_timeout)
        for done, chunk in enumerate(pool.map(child, seeds, sizes), start=1):
            totals["cases"] += int(chunk["cases"])  # type: ignore[call-overload]
            if "crashed" in chunk:
                crashed.append(chunk)
                continue
            totals["decoded"] += int(chunk["decoded"])  # type: ignore[call-overload]
            totals["failures"] += int(chunk["failures"])  # type: ignore[call-overload]
            errors.update(chunk["errors"])  # type: ignore[arg-type]
            peak = max(peak, float(chunk["peak_mib"]))  # type: ignore[arg-type]
            for failure in chunk["failed"]:  # type: ignore[attr-defined]
                failures.write(json.dumps({"seed": chunk["seed"], **failure}) + "\n")
            failures.flush()
            elapsed = time.monotonic() - started
            print(
                f"{done}/{len(sizes)} chunks, {totals['cases']:,} cases, "
                f"{sum(errors.values()):,} ConsumerErrors, {totals['failures']} other, "
                f"{len(crashed)} crashed, {elapsed:,.0f} s",
                flush=True,
            )
    elapsed = time.monotonic() - started
    print()
    print(
        f"fuzz {args.protocol}: seed {args.seed}, {len(sizes)} chunks of <= {args.chunk:,} cases, "
        f"{args.workers} worker(s)"
    )
    print(f"cases                 {totals['cases']:>12,}")
    print(f"decoded               {totals['decoded']:>12,}")
    print(f"ConsumerErrors        {sum(errors.values()):>12,}")
    for code, count in errors.most_common():
        print(f"  {code:<20}{count:>12,}")
    print(f"other exceptions      {totals['failures']:>12,}   (written to {args.failures})")
    print(f"crashed/hung chunks   {len(crashed):>12,}")
    for chunk in crashed:
        print(f"  seed {chunk['seed']}: {chunk['crashed']}, in flight {chunk['case']}\n{chunk['stderr']}")
    print(f"peak memory of a child {peak:>11,.0f} MiB")
    print(f"wall time             {elapsed:>12,.0f} s ({totals['cases'] / elapsed:,.0f} cases/s)")
    return 0 if not totals["failures"] and not crashed else 1


if __name__ == "__main__":
    raise SystemExit(main())
