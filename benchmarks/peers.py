"""Kafka to a Delta changelog, CPU per record against raw consume and a naive pipeline, in one run.

Run: `python benchmarks/peers.py [--small N] [--large N] [--resent 0.1] [--repeats N] [--compare CHECKOUT]`.

One embedded broker (tansu). The simulator writes Simple JSON topics of `--small` and `--large` DML events
(4 tables, 2 partitions, dispatched by table, no DDLs), and the same two streams as TiCDC sends them after
restarts, with about `--resent` of their DMLs sent again (`WorkloadConfig.resends`). Each consumer reads
each topic to its end; the figure is the **marginal CPU per record**: (CPU of the large topic - CPU of the
small one) / (records of the large - records of the small), so start-up, group joins and idle waits cancel.
CPU is user + system of the consumer's own process (`run` is a child: its rusage); each pass runs `--repeats`
times and the least counts (other load on a shared box only ever adds).

- raw consume: librdkafka `consume(1000)` from every partition, counting records only.
- naive: `json.loads` of each record, rows grouped per table, `deltalake.write_deltalake` per 50k rows
  (no types, no ordering, no exactly-once: what a user writes by hand).
- run: `ticdc-consumer run --mode changelog --until-idle 3` with its defaults.
- run, re-sent: the same on the streams with copies; per record of the stream sent once (the copies are
  the extra work), and per record read.
- with `--compare CHECKOUT`: `run` of another checkout (its `.venv`), on the same topics in the same run, e.g.
  the commit before a change, to see what the change costs.

Targets (issue 39): a stream with 10 % re-sent changes costs <= 1.1x per record (of the stream sent once).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from confluent_kafka import Consumer, TopicPartition

from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.ends import EndOffsets
from consumer.testing.broker import EmbeddedBroker

NAIVE_BATCH = 50_000


def _workload(rows: int, resends: int) -> WorkloadConfig:
    return WorkloadConfig(rows=rows, tables=4, partitions=2, ddl=False, seed=7, resends=resends)


def _resends_for(rows: int, share: float) -> int:
    """Restarts that re-send about `share` of the DMLs (each sends what followed its checkpoint)."""
    if share <= 0:
        return 0
    probe = _workload(rows, 10)
    copies = sum(r.resent for r in Workload(probe).records())
    return max(1, round(10 * share * rows / max(copies, 1)))


def _produce(broker: EmbeddedBroker, topic: str, config: WorkloadConfig) -> tuple[int, int]:
    """Records in the topic, and those of them that are copies."""
    broker.create_topic(topic, config.partitions)
    report = produce_to_kafka(Workload(config), MessageEncoder("json"), broker.bootstrap_servers, topic)
    return report.records, report.resent


def _ends(broker: EmbeddedBroker, topic: str, partitions: int) -> dict[int, int]:
    ends = EndOffsets(broker.bootstrap_servers, {})
    try:
        bounds = ends.bounds([topic])
    finally:
        ends.close()
    return {partition: end for (_, partition), (_, end) in bounds.items()}


def _consumer(broker: EmbeddedBroker, topic: str, ends: dict[int, int]) -> Consumer:
    consumer = Consumer(
        {"bootstrap.servers": broker.bootstrap_servers, "group.id": f"peers-{time.monotonic_ns()}"}
    )
    consumer.assign([TopicPartition(topic, p, 0) for p in ends])
    return consumer


def _drain(broker: EmbeddedBroker, topic: str, ends: dict[int, int], take: Callable[[list], None]) -> int:
    """Read every partition to its end, handing each `consume(1000)` to `take`; records read."""
    consumer = _consumer(broker, topic, ends)
    positions = dict.fromkeys(ends, 0)
    read = 0
    try:
        while any(positions[p] < ends[p] for p in ends):
            messages = [m for m in consumer.consume(1000, 1.0) if m.error() is None]
            for message in messages:
                positions[message.partition()] = message.offset() + 1
            read += len(messages)
            take(messages)
    finally:
        consumer.close()
    return read


def _cpu() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def raw_consume(broker: EmbeddedBroker, topic: str, ends: dict[int, int], _: Path) -> float:
    before = _cpu()
    _drain(broker, topic, ends, lambda messages: None)
    return _cpu() - before


def naive(broker: EmbeddedBroker, topic: str, ends: dict[int, int], out: Path) -> float:
    import pyarrow as pa
    from deltalake import write_deltalake

    tables: dict[str, list[dict]] = {}

    def flush(name: str) -> None:
        rows = tables.pop(name, [])
        if rows:
            write_deltalake(str(out / name), pa.Table.from_pylist(rows), mode="append", schema_mode="merge")

    def take(messages: list) -> None:
        for message in messages:
            value = json.loads(message.value())
            if value.get("type") in ("INSERT", "UPDATE", "DELETE"):
                name = f"{value['database']}.{value['table']}"
                row = {k: json.dumps(v) for k, v in (value.get("data") or value.get("old") or {}).items()}
                tables.setdefault(name, []).append({**row, "_type": value["type"], "_ts": value["commitTs"]})
                if len(tables[name]) >= NAIVE_BATCH:
                    flush(name)

    before = _cpu()
    _drain(broker, topic, ends, take)
    for name in list(tables):
        flush(name)
    return _cpu() - before


def run(broker: EmbeddedBroker, topic: str, _: dict[int, int], out: Path) -> float:
    return run_in(Path(__file__).resolve().parents[1], sys.executable, broker, topic, out)


def run_in(checkout: Path, python: str, broker: EmbeddedBroker, topic: str, out: Path) -> float:
    """`run` of `checkout` with `python` to the topic's end; the CPU it used."""
    command = [python, "-m", "consumer", "run", "--source", f"kafka://{broker.bootstrap_servers}/{topic}"]
    command += ["--group", f"peers-{time.monotonic_ns()}", "--sink", f"delta:{out}", "--mode", "changelog"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [*command, "--until-idle", "3"], capture_output=True, text=True, check=False, cwd=checkout
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"run failed ({done.returncode}): {done.stderr[-2000:]}")
    print(f"    {topic}: {done.stdout.splitlines()[0]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=20_000, help="DMLs of the small topics")
    parser.add_argument("--large", type=int, default=200_000, help="DMLs of the large topics")
    parser.add_argument("--resent", type=float, default=0.1, help="share of DMLs sent again")
    parser.add_argument("--compare", type=Path, help="another checkout whose run is measured beside")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each pass; the least CPU counts")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="peers-"))
    with EmbeddedBroker() as broker:
        topics: dict[tuple[str, int], tuple[str, int, int]] = {}
        for kind, share in (("once", 0.0), ("resent", args.resent)):
            for size in (args.small, args.large):
                topic = f"peers-{kind}-{size}"
                records, copies = _produce(broker, topic, _workload(size, _resends_for(size, share)))
                topics[kind, size] = (topic, records, copies)
                print(f"produced {topic}: {records} records, {copies} of them copies")
        results: dict[str, float] = {}
        passes: list[tuple[str, Callable[..., float], str]] = [
            ("librdkafka consume(1000), counting", raw_consume, "once"),
            ("naive: json.loads, per table, a deltalake append per 50k", naive, "once"),
            ("ticdc-consumer run --mode changelog", run, "once"),
            ("ticdc-consumer run --mode changelog, re-sent", run, "resent"),
        ]
        if args.compare is not None:
            other = args.compare.resolve()

            def compared(broker: EmbeddedBroker, topic: str, _: dict[int, int], out: Path) -> float:
                return run_in(other, str(other / ".venv" / "bin" / "python"), broker, topic, out)

            passes += [(f"{other.name}: run --mode changelog", compared, "once")]
        for name, consume, kind in passes:
            spent = {}
            for size in (args.small, args.large):
                topic, records, _ = topics[kind, size]
                runs = [scratch / f"{len(results)}-{size}-{n}" for n in range(args.repeats)]
                spent[size] = min(consume(broker, topic, _ends(broker, topic, 2), out) for out in runs)
            small, large = topics[kind, args.small], topics[kind, args.large]
            results[name] = (spent[args.large] - spent[args.small]) / (large[1] - small[1]) * 1e6
            if kind == "resent":  # per record of the stream sent once: the copies are extra work
                once = topics["once", args.large][1] - topics["once", args.small][1]
                per_once = (spent[args.large] - spent[args.small]) / once * 1e6
                results[f"{name}, per record sent once"] = per_once
    print("\n| consumer | marginal CPU per record |\n| --- | --- |")
    for name, micros in results.items():
        print(f"| {name} | {micros:.1f} µs |")
    base = results["ticdc-consumer run --mode changelog"]
    ratio = results["ticdc-consumer run --mode changelog, re-sent, per record sent once"] / base
    print(f"\nre-sent stream / stream sent once, per record sent once: {ratio:.2f}x (target <= 1.1x)")
    print(f"naive / run: {results['naive: json.loads, per table, a deltalake append per 50k'] / base:.2f}x")
    if args.compare is not None:
        print(f"run / {args.compare.name}'s run: {base / results[passes[-1][0]]:.2f}x")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS", "100000")
    raise SystemExit(main())
