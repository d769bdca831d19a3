"""The sinks and the dead-letter queue a `RunConfig` names: one construction for both engines."""

from __future__ import annotations

from pathlib import Path

from consumer.config import RunConfig, kafka_source_parts
from consumer.sinks.base import Sink
from consumer.sinks.dead_letter import DeadLetterFile, DeadLetterObjects, DeadLetterQueue, DeadLetterTopic


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


def build_dead_letters(config: RunConfig) -> DeadLetterQueue:
    """`errors.dead_letter`: `file:PATH`, an object-store URI (one object per letter) or a Kafka topic;
    default: `_dead_letters.jsonl` (a directory on object stores) at the sink's root."""
    root = config.sink.url.partition(":")[2]
    default = (
        f"{root.rstrip('/')}/_dead_letters" if "://" in root else f"file:{Path(root) / '_dead_letters.jsonl'}"
    )
    target = config.errors.dead_letter or default
    if target.startswith("kafka://"):
        servers, topics = kafka_source_parts(target)
        return DeadLetterTopic(servers, topics[0], config.errors.kafka)
    if "://" in target:
        return DeadLetterObjects(target, config.sink.storage_options)
    return DeadLetterFile(target.partition(":")[2])
