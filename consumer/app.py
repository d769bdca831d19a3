"""Builds a running consumer from a `RunConfig`: sinks, dead letters, state, pipeline and source."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import msgspec

from consumer.config import MetricsConfig, RunConfig, file_source_path, kafka_source_parts
from consumer.members import GroupMembers, MemberFailed, MemberProcess
from consumer.pipeline import Pipeline, PipelineStats
from consumer.protocol.codec import MessageDecoder
from consumer.protocol.types import ValuePolicy
from consumer.sinks.base import Sink
from consumer.sinks.dead_letter import DeadLetterFile, DeadLetterSink, DeadLetterTopic
from consumer.sources.base import Source
from consumer.sources.files import FileSource
from consumer.sources.kafka import KafkaSource
from consumer.state.machine import ConsumerState
from consumer.stopping import StopRequest

log = logging.getLogger(__name__)


def build_sinks(config: RunConfig, spark: Any = None) -> list[Sink]:
    kind, _, root = config.sink.url.partition(":")
    if kind == "delta":
        from consumer.sinks.delta import DeltaSink

        return [DeltaSink(root, mode=config.sink.mode)]
    if kind == "parquet":
        from consumer.sinks.parquet import ParquetSink
        from consumer.spark.session import spark_session

        return [ParquetSink(root, spark or spark_session())]
    from consumer.sinks.jsonl import JsonLinesSink

    return [JsonLinesSink(root)]


def build_dead_letters(config: RunConfig) -> DeadLetterSink:
    target = (
        config.errors.dead_letter or f"file:{Path(config.sink.url.partition(':')[2]) / '_dead_letters.jsonl'}"
    )
    if target.startswith("kafka://"):
        servers, topics = kafka_source_parts(target)
        return DeadLetterTopic(servers, topics[0], config.source.kafka)
    return DeadLetterFile(target.partition(":")[2])


def build_pipeline(config: RunConfig, sinks: list[Sink] | None = None) -> Pipeline:
    policy = ValuePolicy(
        unrepresentable=config.decode.unrepresentable,
        unknown_types=config.decode.unknown_types,
        limits=config.decode.limits(),
    )
    state = ConsumerState(
        policy=config.errors.policy,
        budget_bytes=config.budget.pending_bytes,
        pending_timeout=config.budget.pending_timeout_s,
    )
    return Pipeline(
        group=config.source.group,
        state=state,
        sinks=sinks if sinks is not None else build_sinks(config),
        dead_letters=build_dead_letters(config),
        decoder=MessageDecoder(config.decode.encoding, config.decode.compression, policy=policy),
        policy=policy,
        max_batch_records=config.budget.max_batch_records,
        decode_workers=config.budget.workers(),
    )


def build_source(config: RunConfig, pipeline: Pipeline) -> Source:
    url = config.source.url
    if url.startswith("file:"):
        return FileSource(file_source_path(url), on_assign=pipeline.on_assign)
    servers, topics = kafka_source_parts(url)
    return KafkaSource(
        servers,
        topics,
        config.source.group,
        config=config.source.kafka,
        on_assign=pipeline.on_assign,
        on_revoke=pipeline.on_revoke,
        unreachable_timeout=config.source.unreachable_timeout_s,
    )


def run(config: RunConfig, *, until_idle: float | None = None, on_cycle: Any = None) -> PipelineStats:
    """Run the configured consumer; returns its totals once stopped (idle, end of file, Ctrl-C or SIGTERM).

    The first Ctrl-C or SIGTERM stops it cleanly (what is resolved is applied and committed); a second
    interrupts at once (KeyboardInterrupt). With `budget.processes` > 1 this process is one member of the
    group and starts the others, each a process with its own loop; the totals are every member's,
    `on_cycle` sees this process's member, and a member's failure stops them all.
    """
    with StopRequest.on_signals() as stop:
        if config.budget.processes == 1:
            return _run_member(config, until_idle, on_cycle, stop)
        return _run_group(config, until_idle, on_cycle, stop)


def _run_group(
    config: RunConfig, until_idle: float | None, on_cycle: Any, stop: StopRequest
) -> PipelineStats:
    member = msgspec.structs.replace(
        config,
        budget=msgspec.structs.replace(config.budget, processes=1, decode_workers=config.budget.workers()),
        metrics=MetricsConfig(),  # one endpoint: this process's
    )
    others = GroupMembers(config.budget.processes - 1, run_member, (member, until_idle))

    def cycle(pipeline: Pipeline) -> None:
        others.check()
        if on_cycle:
            on_cycle(pipeline)

    stopped = False
    try:
        stats = _run_member(msgspec.structs.replace(member, metrics=config.metrics), until_idle, cycle, stop)
        stopped = True
    finally:
        totals = others.stop(interrupt=not stopped or stop.requested)
    for total in totals:
        stats = stats.combined(total)
    return stats


def _run_member(
    config: RunConfig, until_idle: float | None, on_cycle: Any, stop: StopRequest
) -> PipelineStats:
    """One member's pipeline, until idle or `stop`."""
    pipeline = build_pipeline(config)
    source = build_source(config, pipeline)
    try:
        return pipeline.run(source, until_idle=until_idle, on_cycle=on_cycle, stop=stop)
    finally:
        source.close()
        pipeline.close()


def run_member(config: RunConfig, until_idle: float | None, asked: Any, reports: Any) -> None:
    """The body of a member process `run` starts: it stops when `asked` is set; its totals, or its error, go
    to `reports`."""
    member = MemberProcess(asked)
    try:
        reports.put((member.name, _run_member(config, until_idle, member.on_cycle, member.stop)))
    except Exception as exc:  # any failure of a member fails the command, with its reason
        reports.put((member.name, MemberFailed(f"{member.name}: {type(exc).__name__}: {exc}")))
        raise SystemExit(1) from exc
