"""The long fuzz run: millions of hostile record values through every decoding stage (issue 10).

Run: `python benchmarks/fuzz.py [--cases 1000000] [--seed 1] [--workers 1] [--chunk 20000]`.

Cases are seeded mutations of a simulated corpus (`consumer.testing.hostile.Mutator`: bit flips, truncation,
splices, deep nesting, invalid UTF-8, huge numbers and strings, wrong value types per column, hostile
schemas, headers and timestamp zones, compression bombs; JSON and Avro) run through
`consumer.testing.fuzz.FuzzHarness`: `MessageDecoder.decode`, then `TableCodec.decode` / `decode_batch` /
`decode_changes` with the typed rows a sink writes, or a `TableCodec` of each schema. A case may decode or
raise a `ConsumerError`; anything else (or an `InternalDecodeError`) is a failure.

Chunks of cases run in child processes, so a crash (a segfault) is reported with the chunk's seed instead
of ending the run; each child reports its peak memory. Failures are written to `--failures` (JSON lines:
base64 value and traceback) to be replayed. Prints cases, decoded, ConsumerErrors by reason code, other
exceptions, crashed chunks and the peak memory of any child; exits 1 if anything was not contained.
"""

from __future__ import annotations

import argparse
import base64
import json
import resource
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_FAILURES_KEPT_PER_CHUNK = 20


def run_chunk(seed: int, count: int) -> dict[str, object]:
    """In a child: `count` cases from `seed`; its report as a JSON-able dict."""
    from consumer.testing.fuzz import Corpus, FuzzHarness
    from consumer.testing.hostile import mutations

    corpus = Corpus.simulated(seed=seed % 7)
    report = FuzzHarness(corpus).run_all(mutations(corpus.values, seed=seed, count=count))
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
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _child(seed: int, count: int) -> dict[str, object]:
    command = [sys.executable, __file__, "--chunk-seed", str(seed), "--chunk", str(count)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        return {"seed": seed, "cases": count, "crashed": result.returncode, "stderr": result.stderr[-3000:]}
    return json.loads(result.stdout.splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--workers", type=int, default=1, help="child processes at once (the machine is shared)"
    )
    parser.add_argument("--chunk", type=int, default=20_000, help="cases per child")
    parser.add_argument("--failures", type=Path, default=Path("fuzz-failures.jsonl"))
    parser.add_argument("--chunk-seed", type=int, help=argparse.SUPPRESS)  # a child's own run
    args = parser.parse_args(argv)
    if args.chunk_seed is not None:
        print(json.dumps(run_chunk(args.chunk_seed, args.chunk)))
        return 0

    started = time.monotonic()
    sizes = [min(args.chunk, args.cases - start) for start in range(0, args.cases, args.chunk)]
    seeds = [args.seed * 1_000_003 + index for index in range(len(sizes))]
    totals: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    crashed: list[dict[str, object]] = []
    peak = 0.0
    with ThreadPoolExecutor(args.workers) as pool, args.failures.open("w") as failures:
        for done, chunk in enumerate(pool.map(_child, seeds, sizes), start=1):
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
    print(f"fuzz: seed {args.seed}, {len(sizes)} chunks of <= {args.chunk:,} cases, {args.workers} worker(s)")
    print(f"cases                 {totals['cases']:>12,}")
    print(f"decoded               {totals['decoded']:>12,}")
    print(f"ConsumerErrors        {sum(errors.values()):>12,}")
    for code, count in errors.most_common():
        print(f"  {code:<20}{count:>12,}")
    print(f"other exceptions      {totals['failures']:>12,}   (written to {args.failures})")
    print(f"crashed chunks        {len(crashed):>12,}")
    for chunk in crashed:
        print(f"  seed {chunk['seed']}: exit {chunk['crashed']}\n{chunk['stderr']}")
    print(f"peak memory of a child {peak:>11,.0f} MiB")
    print(f"wall time             {elapsed:>12,.0f} s ({totals['cases'] / elapsed:,.0f} cases/s)")
    return 0 if not totals["failures"] and not crashed else 1


if __name__ == "__main__":
    raise SystemExit(main())
