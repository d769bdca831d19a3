"""What a `RunConfig` names, built: the decoder, the large-message resolver, the sinks and the dead-letter
queue. One construction for both engines (the loop in `consumer.app`, Spark in `consumer.spark.engine`);
and the status of what they wrote (`lake_status`), read where the configuration says it went."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pyarrow as pa

from consumer.config import ConfigError, DecodeConfig, RunConfig, kafka_source_parts
from consumer.lakehouse.status import DeadLetterStatus, LakeStatus, read_status, with_kafka
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.large_messages.upstream import UpstreamLookup
from consumer.protocol.base import DecoderSettings, RecordDecoder
from consumer.protocol.protocols import record_decoder
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.types import ValuePolicy
from consumer.sinks.base import Sink
from consumer.sinks.dead_letter import (
    DeadLetterFile,
    DeadLetterObjects,
    DeadLetterQueue,
    DeadLetterTopic,
    count_letters,
)
from consumer.sources.lookups import count_by_header, group_offsets
from consumer.state.machine import ConsumerState


def build_sinks(config: RunConfig) -> list[Sink]:
    """The configured sink (both engines use these: the Parquet sink writes its files with pyarrow, so it
    needs no Spark session and any root works)."""
    kind, _, root = config.sink.url.partition(":")
    sink = config.sink
    if kind == "delta":
        from consumer.sinks.delta import DeltaSink

        return [
            DeltaSink(
                root,
                mode=sink.mode,
                storage_options=sink.storage_options,
                target_file_size=sink.target_file_size,
                allow_unsafe_commits=sink.allow_unsafe_commits,
                mirror_interval_s=sink.mirror_interval_s,
                mirror_interval_rows=sink.mirror_interval_rows,
                mirror_buckets=sink.mirror_buckets,
            )
        ]
    if kind == "parquet":
        from consumer.sinks.parquet import ParquetSink

        return [
            ParquetSink(
                root, storage_options=sink.storage_options, allow_unsafe_commits=sink.allow_unsafe_commits
            )
        ]
    from consumer.sinks.jsonl import JsonLinesSink

    return [JsonLinesSink(root)]


def dead_letter_target(config: RunConfig) -> str:
    """`errors.dead_letter`: `file:PATH`, an object-store URI (one object per letter) or a Kafka topic;
    default: `_dead_letters.jsonl` (a directory on object stores) at the sink's root."""
    root = config.sink.url.partition(":")[2]
    default = (
        f"{root.rstrip('/')}/_dead_letters" if "://" in root else f"file:{Path(root) / '_dead_letters.jsonl'}"
    )
    return config.errors.dead_letter or default


def build_dead_letters(config: RunConfig) -> DeadLetterQueue:
    target = dead_letter_target(config)
    if target.startswith("kafka://"):
        servers, topics = kafka_source_parts(target)
        return DeadLetterTopic(servers, topics[0], config.errors.kafka)
    if "://" in target:
        return DeadLetterObjects(target, config.sink.storage_options)
    return DeadLetterFile(target.partition(":")[2])


def lake_status(
    config: RunConfig, *, group: str | None = None, brokers: str | None = None, topic: str | None = None
) -> LakeStatus:
    """The configured sink root's status (`consumer.lakehouse.status`): with each group's Kafka offsets in
    `topic` when `brokers` and `topic` are given (`group`, else every group the lake recorded), and the
    dead letters wherever the configuration sends them."""
    root = config.sink.url.partition(":")[2]
    status = read_status(root, config.sink.storage_options, group=group)
    if brokers and topic:
        groups = [group] if group else sorted({p.group for p in status.partitions})
        status = with_kafka(status, group_offsets(brokers, topic, groups, config=config.source.kafka))
    return msgspec.structs.replace(status, dead_letters=_dead_letter_status(config))


def _dead_letter_status(config: RunConfig) -> DeadLetterStatus:
    target = dead_letter_target(config)
    if target.startswith("kafka://"):
        servers, topics = kafka_source_parts(target)
        counts = count_by_header(
            servers, topics[0], "ticdc.reason_code", distinct_by="ticdc.source", config=config.errors.kafka
        )
    else:
        where = target if "://" in target else target.partition(":")[2]
        counts = count_letters(where, config.sink.storage_options)
    return DeadLetterStatus(
        destination=target, total=sum(counts.values()), by_reason_code=dict(sorted(counts.items()))
    )


def build_policy(config: RunConfig) -> ValuePolicy:
    """How values are typed and checked: the same for the loop's decoder, Spark's tasks and its driver."""
    decode = config.decode
    return ValuePolicy(
        unrepresentable=decode.unrepresentable,
        timestamp_location=decode.timestamp_zone,
        verify_checksums=config.integrity.verify_checksums,
        unknown_types=decode.unknown_types,
        limits=decode.limits(),
    )


def build_state(config: RunConfig, decoder: RecordDecoder) -> ConsumerState:
    """The state machine under the configured error policy, budget and ordering."""
    return ConsumerState(
        policy=config.errors.policy,
        budget_bytes=config.budget.pending_bytes,
        pending_timeout=config.budget.pending_timeout_s,
        ordering="watermark" if config.decode.watermark_ordering() else "arrival",
        described=decoder.described_schema,
    )


def build_decoder(decode: DecodeConfig, policy: ValuePolicy) -> RecordDecoder:
    return record_decoder(
        DecoderSettings(
            protocol=decode.protocol,
            encoding=decode.encoding,
            compression=decode.compression,
            registry_url=decode.schema_registry,
            registry_config=decode.registry_config(),
            policy=policy,
        )
    )


def build_large_messages(config: RunConfig, policy: ValuePolicy) -> LargeMessageResolver:
    """What makes key-only DMLs (Simple protocol, docs/protocols/simple.md §7) whole: claim-check storage
    under the configured roots, and upstream TiDB. A claim-check object is held to the same `DecodeLimits` as
    a Kafka record."""
    settings = config.large_messages
    try:
        store = ClaimCheckStore.from_uris(
            settings.claim_check_roots,
            settings.claim_check_root_override,
            max_object_bytes=settings.max_object_bytes,
            retries=settings.fetch_retries,
        )
    except (pa.ArrowException, OSError) as exc:  # pyarrow.fs refused a root URI or its options
        raise ConfigError(f"large_messages.claim_check_roots: {exc}") from exc
    return LargeMessageResolver(
        MessageDecoder(config.decode.encoding, config.decode.compression, policy=policy),
        store,
        raw_value=settings.claim_check_raw_value,
        upstream=UpstreamLookup(settings.upstream_dsn) if settings.upstream_dsn else None,
        concurrency=settings.fetch_concurrency,
    )
