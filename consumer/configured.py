"""What a `RunConfig` names, built: the decoder, the large-message resolver, the sinks and the dead-letter
queue. One construction for both engines (the loop in `consumer.app`, Spark in `consumer.spark.engine`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from consumer.config import (
    ConfigError,
    DecodeConfig,
    RunConfig,
    kafka_source_parts,
    registry_setting_error,
)
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.protocol.base import DecoderSettings, RecordDecoder
from consumer.protocol.protocols import record_decoder
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.ticdc_avro.registry_settings import RegistrySettingsError
from consumer.protocol.types import ValuePolicy
from consumer.sinks.base import Sink
from consumer.sinks.dead_letter import (
    DeadLetterFile,
    DeadLetterObjects,
    DeadLetterQueue,
    DeadLetterTopic,
)
from consumer.state.machine import ConsumerState

if TYPE_CHECKING:
    from consumer.large_messages.upstream import UpstreamLookup


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
                mirror_split_rows=sink.mirror_split_rows,
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
    """The configured protocol's decoder; a registry setting its client refuses stops the start, named."""
    try:
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
    except RegistrySettingsError as exc:
        raise registry_setting_error(exc, decode) from exc


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
        upstream=_upstream_lookup(settings.upstream_dsn),
        concurrency=settings.fetch_concurrency,
    )


def _upstream_lookup(dsn: str | None) -> UpstreamLookup | None:
    """Upstream TiDB when `large_messages.upstream_dsn` names it; only then is the MySQL client loaded."""
    if not dsn:
        return None
    from consumer.large_messages.upstream import UpstreamLookup

    return UpstreamLookup(dsn)
