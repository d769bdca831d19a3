"""Claim-check throughput: a stream where 10% of the rows are claim-checked on a local S3 server, against
the same stream with every row inline, measured in one run.

Run: `python benchmarks/large_messages.py [--rows N] [--large-bytes N] [--concurrency N] [--repeats N]`.

1. Produce the stream twice from one seed into the embedded broker (tansu), 4 partitions, rows dispatched
   by primary key. Ten tables: table 0 (every column type) gets a tenth of the rows, and its TEXT column
   holds `--large-bytes` of text, so its DMLs are the large ones. Topic `inline` carries every row in Kafka;
   topic `claim-check` is what TiCDC sends with `large-message-handle-option = "claim-check"` and
   `max-message-bytes` = half of `--large-bytes`: each large DML's full value is an object on the S3 server
   (moto, its own process on a loopback port) and the Kafka record holds its key and the object's location.
2. Consume each topic with the pipeline `ticdc-consumer run` builds (decode workers as configured, the S3
   root in `[large_messages] claim_check_roots`) into a sink that drops every batch: Kafka fetch, decode,
   claim-check fetch, state machine and typed Arrow changelog, which every real sink sits behind. Each topic
   is consumed `--repeats` times (default 2), alternating, and the fastest pass of each counts (other load
   on this shared machine only ever slows a pass). Every pass must apply every changelog image without dead
   letters; the claim-check passes must fetch exactly the objects written.

rows/s counts DML events (upstream row changes). Target (issue 11): claim-check >= 0.7x inline.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from consumer import app
from consumer.config import LargeMessagesConfig, ParallelismConfig, RunConfig, SinkConfig, SourceConfig
from consumer.large_messages.claim_check import ClaimCheckWriter
from consumer.large_messages.encoder import LargeMessageEncoder
from consumer.pipeline import Pipeline
from consumer.protocol.model import DML
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.s3 import LocalS3Server

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lakehouse import DropSink

TABLES = 10
PARTITIONS = 4
BUCKET = "bench-claims"
TARGET_RATIO = 0.7
INLINE, ON_S3, ON_FILES = "inline", "claim-check on S3", "claim-check on files"


@dataclass
class Stream:
    topic: str
    root: str  # where its claim-checks are ("" for the inline stream)
    records: int = 0
    dmls: int = 0
    large: int = 0  # DMLs above the large-message limit: claim-checked, except in the inline stream


def produce(broker: EmbeddedBroker, streams: Sequence[Stream], rows: int, large_bytes: int) -> None:
    """The same workload into each stream's topic: inline, or claim-checked above `large_bytes // 2`."""
    for stream in streams:
        config = WorkloadConfig(
            rows=rows,
            tables=TABLES,
            partitions=PARTITIONS,
            ddl=False,
            dispatch="primary-key",
            start_physical_ms=1_700_000_000_000,
            large_value_bytes=large_bytes,
        )
        limit = large_bytes // 2
        encoder: MessageEncoder | LargeMessageEncoder = MessageEncoder()
        if stream.root:  # S3: one PUT an object (pyarrow's default is a three-request multipart upload)
            options = "?allow_delayed_open=true" if stream.root.startswith("s3:") else ""
            writer = ClaimCheckWriter(stream.root + options)
            encoder = LargeMessageEncoder(MessageEncoder(), "claim-check", limit, writer)
        stream.dmls, stream.large = _counts(Workload(config), limit)
        report = produce_to_kafka(Workload(config), encoder, broker.bootstrap_servers, stream.topic)
        stream.records = report.records


def _counts(workload: Workload, limit: int) -> tuple[int, int]:
    """(DMLs, DMLs whose full value is above the large-message limit) of the (deterministic) workload."""
    full = MessageEncoder()
    dmls = [record for record in workload.records() if isinstance(record.message, DML)]
    large = sum(len(full.encode(record.message, record.schema)) + 36 > limit for record in dmls)
    return len(dmls), large


class _Done(Exception):
    """Raised from `on_cycle` once every record of the topic went through."""


@dataclass
class Pass:
    stream: Stream
    seconds: float
    images: int
    dead_letters: int
    fetches: int
    fetched_bytes: int
    fetch_seconds: float
    server_cpu: float  # CPU seconds the S3 server process spent during the pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (Linux /proc), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def consume(broker: EmbeddedBroker, stream: Stream, server_pid: int, concurrency: int, workers: int) -> Pass:
    group = f"bench-{uuid.uuid4().hex[:8]}"
    config = RunConfig(
        source=SourceConfig(url=f"kafka://{broker.bootstrap_servers}/{stream.topic}", group=group),
        sink=SinkConfig(url=f"jsonl:/tmp/{group}"),
        parallelism=ParallelismConfig(decode_workers=workers),
        large_messages=LargeMessagesConfig(
            claim_check_roots=[stream.root] if stream.root else [], fetch_concurrency=concurrency
        ),
    )
    pipeline = app.build_pipeline(config, sinks=[DropSink()])
    source = KafkaSource(
        broker.bootstrap_servers,
        [stream.topic],
        group,
        partitions=ALL_PARTITIONS,
        listener=pipeline,
    )

    def stop_when_done(p: Pipeline) -> None:
        if p.stats.records >= stream.records:
            raise _Done

    gc.collect()
    server_before = cpu_seconds(server_pid)
    started = time.perf_counter()
    try:
        pipeline.run(source, on_cycle=stop_when_done)
    except _Done:
        pass
    finally:
        seconds = time.perf_counter() - started
        source.close()
        pipeline.close()
    stats = pipeline.stats
    assert stats.records == stream.records, (stream.topic, stats.records, stream.records)
    print(f"  {stream.topic}: {seconds:.2f} s", flush=True)
    return Pass(
        stream,
        seconds,
        stats.rows,
        stats.dead_letters,
        stats.claim_check_fetches,
        stats.claim_check_bytes,
        stats.claim_check_seconds,
        cpu_seconds(server_pid) - server_before,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000, help="DML events per topic (default 10000)")
    parser.add_argument(
        "--large-bytes", type=int, default=32_768, help="table 0's TEXT values (default 32768)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=16, help="claim-check fetches at once (default 16)"
    )
    parser.add_argument("--workers", type=int, default=None, help="decode workers (default: the run default)")
    parser.add_argument("--repeats", type=int, default=2, help="passes per topic, the fastest counts")
    args = parser.parse_args(argv)
    workers = args.workers if args.workers is not None else ParallelismConfig().member_decode_workers()

    with EmbeddedBroker() as broker, LocalS3Server() as s3, tempfile.TemporaryDirectory() as local:
        os.environ.update(s3.environment())
        s3.create_bucket(BUCKET)
        streams = [
            Stream(INLINE, ""),
            Stream(ON_S3, f"s3://{BUCKET}/ticdc/cc"),
            Stream(ON_FILES, f"file://{local}/cc"),
        ]
        print(f"producing {args.rows:,} DML events 3 times (large rows: {args.large_bytes:,} B of TEXT) ...")
        started = time.perf_counter()
        produce(broker, streams, args.rows, args.large_bytes)
        print(f"  produced in {time.perf_counter() - started:.1f} s")
        passes: dict[str, list[Pass]] = {stream.topic: [] for stream in streams}
        for round_ in range(args.repeats):
            print(f"round {round_ + 1}/{args.repeats}:", flush=True)
            for stream in streams:
                passes[stream.topic].append(consume(broker, stream, s3.pid, args.concurrency, workers))

    images = passes[INLINE][0].images
    for runs in passes.values():
        for run in runs:
            assert run.images == images and run.dead_letters == 0, (run.stream.topic, run.images, images)
            expected = run.stream.large if run.stream.root else 0
            assert run.fetches == expected, (run.stream.topic, run.fetches, expected)
    best = {topic: min(runs, key=lambda r: r.seconds) for topic, runs in passes.items()}
    rate = {topic: run.stream.dmls / run.seconds for topic, run in best.items()}
    claimed = best[ON_S3]
    print()
    print(
        f"Claim-check vs inline, one run on a shared 2-core machine; {workers} decode workers, "
        f"{args.concurrency} concurrent fetches; best of {args.repeats}"
    )
    print(
        f"{claimed.stream.dmls:,} DML events per topic ({claimed.stream.records:,} records), "
        f"{TABLES} tables; "
        f"{claimed.stream.large:,} ({claimed.stream.large / claimed.stream.dmls:.1%}) claim-checked, "
        f"objects ~{claimed.fetched_bytes / max(claimed.fetches, 1) / 1024:.1f} KiB"
    )
    print(
        "verified: every pass applied the same changelog images, no dead letters, every object fetched once"
    )
    print()
    print(
        f"{'pass':<22} {'seconds':>8} {'rows/s':>10} {'vs inline':>10} {'fetches':>8} {'ms/fetch':>9} "
        f"{'S3 CPU s':>9}"
    )
    for topic, run in best.items():
        per_fetch = f"{run.fetch_seconds / run.fetches * 1000:.1f}" if run.fetches else "-"
        print(
            f"{topic:<22} {run.seconds:>8.2f} {rate[topic]:>10,.0f} {rate[topic] / rate[INLINE]:>9.2f}x "
            f"{run.fetches:>8,} {per_fetch:>9} {run.server_cpu:>9.2f}"
        )
    ratio = rate[ON_S3] / rate[INLINE]
    verdict = "ok" if ratio >= TARGET_RATIO else "MISSED"
    print(f"\nclaim-check on S3 / inline: {ratio:.2f}x (target >= {TARGET_RATIO}x) {verdict}")
    print(
        f"the S3 server (moto, one Python process on these 2 cores) spent {claimed.server_cpu:.2f} CPU s "
        f"on {claimed.fetches:,} fetches ({claimed.server_cpu / max(claimed.fetches, 1) * 1000:.1f} ms each: "
        "a HEAD and a GET per object, as pyarrow reads)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
