"""Builds a running consumer from a `RunConfig`: sinks, dead letters, state, pipeline and source."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from consumer.config import (
    MetricsConfig,
    ParallelismConfig,
    RunConfig,
    file_source_path,
    kafka_source_parts,
)
from consumer.configured import (
    build_dead_letters,
    build_decoder,
    build_large_messages,
    build_policy,
    build_sinks,
    build_state,
)
from consumer.members import GroupMembers, MemberFailed, MemberProcess
from consumer.pipeline import Pipeline, PipelineStats
from consumer.sinks.base import Sink
from consumer.sources.base import Source
from consumer.sources.files import FileSource
from consumer.sources.groups import GroupDescription, describe_group
from consumer.sources.kafka import KafkaSource
from consumer.sources.retry import SourceRetry
from consumer.stopping import StopRequest
from consumer.watchdog import Watchdog

log = logging.getLogger(__name__)


def build_pipeline(
    config: RunConfig,
    sinks: list[Sink] | None = None,
    *,
    pause_gc: bool = False,
    watchdog: Watchdog | None = None,
) -> Pipeline:
    """`watchdog`: one shared with the metrics endpoint (default: the pipeline's own, as configured)."""
    policy = build_policy(config)
    decoder = build_decoder(config.decode, policy)
    return Pipeline(
        group=config.source.group,
        state=build_state(config, decoder),
        sinks=sinks if sinks is not None else build_sinks(config),
        dead_letters=build_dead_letters(config),
        decoder=decoder,
        policy=policy,
        max_batch_records=config.budget.max_batch_records,
        decode_workers=config.parallelism.member_decode_workers(),
        large_messages=build_large_messages(config, policy),
        source_retry=SourceRetry(attempts=config.source.retries, backoff=config.source.retry_backoff_s),
        pause_gc=pause_gc,
        join_grace=config.source.join_grace_s,
        watchdog=watchdog or Watchdog(config.watchdog.stall_after_s),
    )


def build_source(config: RunConfig, pipeline: Pipeline) -> Source:
    url = config.source.url
    if url.startswith("file:"):
        return FileSource(file_source_path(url), listener=pipeline)
    servers, topics = kafka_source_parts(url)
    return KafkaSource(
        servers,
        topics,
        config.source.group,
        config=config.source.kafka,
        listener=pipeline,
        unreachable_timeout=config.source.unreachable_timeout_s,
    )


def run(
    config: RunConfig,
    *,
    until_idle: float | None = None,
    on_cycle: Any = None,
    pause_gc: bool = False,
    watchdog: Watchdog | None = None,
) -> PipelineStats:
    """Run the configured consumer; returns its totals once stopped (idle, end of file, Ctrl-C or SIGTERM).

    The first Ctrl-C or SIGTERM stops it cleanly (what is resolved is applied and committed); a second
    interrupts at once (KeyboardInterrupt). With `parallelism.processes` > 1 this process is one member of the
    group and starts the others, each a process with its own loop; the totals are every member's,
    `on_cycle` sees this process's member, and a member's failure stops them all. `pause_gc`: see
    `Pipeline` (it changes process-wide state, so only the `run` command turns it on). `watchdog`: this
    process's member's (for the metrics endpoint; the other members log their stalls). With `engine.kind`
    "spark" it runs as a Spark streaming query (`consumer.spark.engine.run`), stopped the same way.

    With `until_idle`, the totals' `unassigned_s` says the run went idle with no member holding a partition.
    """
    with StopRequest.on_signals() as stop:
        if config.engine.kind == "spark":
            from consumer.spark import engine  # Spark loads only for the Spark engine

            return engine.run(config, until_idle=until_idle, on_cycle=on_cycle, stop=stop)
        if config.parallelism.processes == 1:
            return _run_member(config, until_idle, on_cycle, stop, pause_gc, watchdog)
        return _run_group(config, until_idle, on_cycle, stop, pause_gc, watchdog)


def _run_group(
    config: RunConfig,
    until_idle: float | None,
    on_cycle: Any,
    stop: StopRequest,
    pause_gc: bool,
    watchdog: Watchdog | None,
) -> PipelineStats:
    member = msgspec.structs.replace(
        config,
        parallelism=ParallelismConfig(decode_workers=config.parallelism.member_decode_workers()),
        metrics=MetricsConfig(),  # one endpoint: this process's
    )
    others = GroupMembers(config.parallelism.processes - 1, run_member, (member, until_idle, pause_gc))

    def cycle(pipeline: Pipeline) -> None:
        others.check()
        if on_cycle:
            on_cycle(pipeline)

    own = msgspec.structs.replace(member, metrics=config.metrics)
    stopped = False
    try:
        stats = _run_member(own, until_idle, cycle, stop, pause_gc, watchdog)
        stopped = True
    finally:
        totals = others.stop(interrupt=not stopped or stop.requested)
    for total in totals:
        stats = stats.combined(total)
    return stats


def _run_member(
    config: RunConfig,
    until_idle: float | None,
    on_cycle: Any,
    stop: StopRequest,
    pause_gc: bool,
    watchdog: Watchdog | None = None,
) -> PipelineStats:
    """One member's pipeline, until idle or `stop`."""
    pipeline = build_pipeline(config, pause_gc=pause_gc, watchdog=watchdog)
    source = build_source(config, pipeline)
    try:
        return pipeline.run(source, until_idle=until_idle, on_cycle=on_cycle, stop=stop)
    finally:
        source.close()
        pipeline.close()


def run_member(config: RunConfig, until_idle: float | None, pause_gc: bool, asked: Any, reports: Any) -> None:
    """The body of a member process `run` starts: it stops when `asked` is set; its totals, or its error, go
    to `reports`."""
    member = MemberProcess(asked)
    try:
        reports.put((member.name, _run_member(config, until_idle, member.on_cycle, member.stop, pause_gc)))
    except Exception as exc:  # any failure of a member fails the command, with its reason
        reports.put((member.name, MemberFailed(f"{member.name}: {type(exc).__name__}: {exc}")))
        raise SystemExit(1) from exc


def describe_consumer_group(config: RunConfig) -> GroupDescription:
    """The configured group as its Kafka source's brokers describe it."""
    servers, _ = kafka_source_parts(config.source.url)
    return describe_group(servers, config.source.group, config.source.kafka)
