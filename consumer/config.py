"""Run configuration: a TOML file, overridden by environment variables, overridden by CLI flags.

Validated once at start into typed structs. Environment variables are named
`TICDC_CONSUMER_<SECTION>_<FIELD>` (e.g. `TICDC_CONSUMER_SOURCE_GROUP=orders`); Kafka client settings
pass through from `[source.kafka]` (or `TICDC_CONSUMER_KAFKA_<SETTING>`, dots as underscores:
`TICDC_CONSUMER_KAFKA_SASL_PASSWORD` sets `sasl.password`); those of a dead-letter topic's producer from
`[errors.kafka]` (or `TICDC_CONSUMER_ERRORS_KAFKA_<SETTING>`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import msgspec

from consumer.errors import ConfigError, ConsumerError
from consumer.large_messages.storage import parse_location
from consumer.large_messages.upstream import connection_options
from consumer.protocol.limits import DecodeLimits
from consumer.protocol.protocols import resolves_by_watermark
from consumer.watchdog import DEFAULT_STALL_AFTER_S

ENV_PREFIX = "TICDC_CONSUMER_"
# Value decoding is most of a record's CPU: a lone process on a multi-core machine decodes in worker
# processes beside its loop; two beat one even on 2 cores (benchmarks/lakehouse.py). Several group members
# (`processes`) already keep the cores busy, and decode in their loops: workers would only add copying.
DEFAULT_DECODE_WORKERS = 2 if (os.cpu_count() or 1) > 1 else 0


class SourceConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str = ""  # kafka://HOST:PORT/TOPIC[,TOPIC...] or file:PATH.jsonl
    group: str = "ticdc-consumer"
    kafka: dict[str, str] = msgspec.field(default_factory=dict)
    unreachable_timeout_s: float = 60.0  # every broker unreachable this long, once connected: `run` fails
    retries: int = 5  # a transient error (a timeout, the group rebalancing) is retried this often...
    retry_backoff_s: float = 0.5  # ...after this long, doubling each time (at most 10 s)
    join_grace_s: float = 30.0  # `--until-idle`: a member holding no partition waits this much longer


_LIMITS = DecodeLimits()


class DecodeConfig(msgspec.Struct, forbid_unknown_fields=True):
    protocol: Literal["simple", "avro", "debezium"] = "simple"
    encoding: Literal["auto", "json", "avro"] = "auto"  # the Simple protocol's
    compression: Literal["auto", "none", "snappy", "lz4"] = "auto"
    unrepresentable: Literal["null", "raise"] = "null"
    # "watermark": rows wait for every partition's watermark (cross-table consistency); "arrival": rows go out
    # as they arrive, exact per key (streams without watermarks); "auto": watermark for Simple only
    ordering: Literal["auto", "watermark", "arrival"] = "auto"
    schema_registry: str = ""  # TiCDC Avro: the Confluent registry URL (may carry user:password@)
    schema_registry_auth: str = ""  # USER:PASSWORD, HTTP basic auth (basic.auth.user.info)
    schema_registry_config: dict[str, str] = msgspec.field(default_factory=dict)  # more client settings
    timestamp_zone: str = "UTC"  # TiCDC Avro: the zone TIMESTAMP text is in (TiCDC's --tz)
    unknown_types: Literal["lossless", "error"] = "lossless"
    max_decompressed_bytes: int = _LIMITS.max_decompressed_bytes
    max_nesting_depth: int = _LIMITS.max_nesting_depth
    max_value_bytes: int = _LIMITS.max_value_bytes
    max_commit_ts_ahead_s: float = _LIMITS.max_commit_ts_ahead_s

    def registry_config(self) -> dict[str, str]:
        auth = {"basic.auth.user.info": self.schema_registry_auth} if self.schema_registry_auth else {}
        return {**self.schema_registry_config, **auth}

    def watermark_ordering(self) -> bool:
        return self.ordering == "watermark" or (
            self.ordering == "auto" and resolves_by_watermark(self.protocol)
        )

    def limits(self) -> DecodeLimits:
        return DecodeLimits(
            max_decompressed_bytes=self.max_decompressed_bytes,
            max_nesting_depth=self.max_nesting_depth,
            max_value_bytes=self.max_value_bytes,
            max_commit_ts_ahead_s=self.max_commit_ts_ahead_s,
        )


class SinkConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str = (
        ""  # delta:ROOT | parquet:ROOT | jsonl:ROOT; ROOT a directory or an object-store URI (s3://...)
    )
    mode: Literal["changelog", "mirror", "both"] = "both"
    storage_options: dict[str, str] = msgspec.field(default_factory=dict)  # passed to delta-rs and pyarrow.fs
    target_file_size: int = 1024 * 1024  # bytes per mirror file: a MERGE rewrites the files of its keys
    allow_unsafe_commits: bool = False  # accept a store without conditional writes: one writer process only


class ErrorsConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: Literal["dead-letter", "fail"] = "dead-letter"
    dead_letter: str = ""  # file:PATH | kafka://HOST:PORT/TOPIC ; default: <sink root>/_dead_letters.jsonl
    kafka: dict[str, str] = msgspec.field(default_factory=dict)  # a dead-letter topic's producer settings


class BudgetConfig(msgspec.Struct, forbid_unknown_fields=True):
    pending_bytes: int = 256 * 1024 * 1024
    pending_timeout_s: float = 240.0
    max_batch_records: int = 100_000  # records per cycle: fewer, larger commits and MERGEs


class ParallelismConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How many processes a `run` command uses."""

    processes: int = 1  # members of the consumer group this command runs, one process each (Kafka only)
    decode_workers: int | None = None  # processes decoding values beside a loop; 0: in it; None: automatic

    def member_decode_workers(self) -> int:
        """Decode workers per member: as configured, else the default for a lone process, else none."""
        if self.decode_workers is not None:
            return self.decode_workers
        return DEFAULT_DECODE_WORKERS if self.processes == 1 else 0


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    kind: Literal["loop", "spark"] = "loop"
    master: str = ""  # spark: local[N], spark://HOST:PORT, yarn...; default: spark-submit's, or local[2]
    checkpoint: str = ""  # spark: the query's checkpoint directory; default <sink root>/_spark/<group>
    trigger_seconds: float = 0.0  # spark without --until-idle: the processingTime trigger (0: back to back)


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True):
    port: int = 0  # 0: no Prometheus endpoint


class WatchdogConfig(msgspec.Struct, forbid_unknown_fields=True):
    # a sink write or commit, a dead-letter write, a claim-check fetch in progress this long is a stall:
    # logged every as often while it lasts, and shown by the ticdc_stall_seconds gauge
    stall_after_s: float = DEFAULT_STALL_AFTER_S


class LargeMessagesConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Key-only DMLs (docs/protocols/simple.md §7). A claim-check is read only under `claim_check_roots`
    (URIs: file:///DIR, s3://BUCKET/PREFIX, gs://..., abfss://...; pyarrow.fs options may follow a `?`); none:
    all refused.
    `claim_check_root_override` reads each object's base name from that one root instead (TiCDC's own
    consumer does, for users who moved the files). `upstream_dsn` (mysql://USER:PASSWORD@HOST:PORT) looks
    handle-key-only rows up in upstream TiDB; without it they go to the error policy."""

    claim_check_roots: list[str] = msgspec.field(default_factory=list)
    claim_check_root_override: str = ""
    claim_check_raw_value: bool | Literal["auto"] = "auto"
    max_object_bytes: int = 128 * 1024 * 1024
    fetch_concurrency: int = 16
    fetch_retries: int = 4
    upstream_dsn: str = ""


class IntegrityConfig(msgspec.Struct, forbid_unknown_fields=True):
    # rows that carry TiDB checksums (docs/protocols/simple.md §8) are verified; others pass
    verify_checksums: bool = True


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    source: SourceConfig = msgspec.field(default_factory=SourceConfig)
    decode: DecodeConfig = msgspec.field(default_factory=DecodeConfig)
    sink: SinkConfig = msgspec.field(default_factory=SinkConfig)
    errors: ErrorsConfig = msgspec.field(default_factory=ErrorsConfig)
    budget: BudgetConfig = msgspec.field(default_factory=BudgetConfig)
    parallelism: ParallelismConfig = msgspec.field(default_factory=ParallelismConfig)
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    watchdog: WatchdogConfig = msgspec.field(default_factory=WatchdogConfig)
    large_messages: LargeMessagesConfig = msgspec.field(default_factory=LargeMessagesConfig)
    integrity: IntegrityConfig = msgspec.field(default_factory=IntegrityConfig)


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    sink_only: bool = False,
) -> RunConfig:
    """The layered configuration, validated; `sink_only`: for commands that only touch the sink's root
    (`maintain`), the source is not checked."""
    layered: dict[str, dict[str, Any]] = {}
    if path is not None:
        try:
            layered = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    _merge(layered, _from_environment(environ))
    _merge(
        layered,
        {
            section: {k: v for k, v in values.items() if v is not None}
            for section, values in (overrides or {}).items()
        },
    )
    try:
        config = msgspec.convert(layered, RunConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    if sink_only:
        _check_sink(config)
    else:
        _check_urls(config)
    _check_large_messages(config.large_messages)
    return config


def _from_environment(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        client = next((s for s in _CLIENT_SETTINGS if rest.startswith(s)), None)
        if client is not None:
            settings = found.setdefault(_CLIENT_SETTINGS[client], {}).setdefault("kafka", {})
            settings[rest[len(client) :].replace("_", ".")] = value
            continue
        section = next((s for s in RunConfig.__struct_fields__ if rest.startswith(s + "_")), None)
        if section is not None:
            field = rest[len(section) + 1 :]
            found.setdefault(section, {})[field] = value.split(",") if field in _LIST_FIELDS else value
    return found


# librdkafka settings in the environment, by prefix: the source's consumer, a dead-letter topic's producer
_CLIENT_SETTINGS = {"kafka_": "source", "errors_kafka_": "errors"}
_LIST_FIELDS = frozenset(("claim_check_roots",))  # comma-separated in the environment


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> None:
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = dict(value) if isinstance(value, Mapping) else value


def _check_urls(config: RunConfig) -> None:
    source = urlparse(config.source.url)
    if source.scheme == "kafka" and not (source.netloc and source.path.strip("/")):
        raise ConfigError(f"source {config.source.url!r}: expected kafka://HOST:PORT/TOPIC[,TOPIC...]")
    if source.scheme not in ("kafka", "file"):
        raise ConfigError(
            f"source {config.source.url!r}: expected kafka://HOST:PORT/TOPIC or file:PATH.jsonl"
        )
    _check_sink(config)
    if config.decode.protocol == "avro" and not config.decode.schema_registry:
        raise ConfigError("decode.protocol = avro needs decode.schema_registry (the registry URL)")
    limits = config.decode
    if min(limits.max_decompressed_bytes, limits.max_nesting_depth, limits.max_value_bytes) < 1:
        raise ConfigError(
            "decode limits (max_decompressed_bytes, max_nesting_depth, max_value_bytes) must be >= 1"
        )
    if config.source.retries < 0 or config.source.retry_backoff_s < 0 or config.source.join_grace_s < 0:
        raise ConfigError("source.retries, source.retry_backoff_s and source.join_grace_s must be >= 0")
    if not config.watchdog.stall_after_s > 0:
        raise ConfigError("watchdog.stall_after_s must be positive")
    if not limits.max_commit_ts_ahead_s > 0:
        raise ConfigError("decode.max_commit_ts_ahead_s must be positive")
    processes = config.parallelism.processes
    if processes < 1:
        raise ConfigError(f"parallelism.processes = {processes}: at least one process runs")
    if processes > 1 and source.scheme != "kafka":
        raise ConfigError(
            "parallelism.processes > 1 needs a Kafka source: the processes share its partitions"
        )
    if processes > 1 and config.sink.allow_unsafe_commits:
        raise ConfigError(
            "sink.allow_unsafe_commits accepts a store without conditional writes for ONE writer process: "
            "parallelism.processes must be 1"
        )
    if processes > 1 and config.sink.url.startswith("parquet:"):
        raise ConfigError(
            "parallelism.processes > 1 needs a Delta or JSONL sink: Parquet takes one writer per root"
        )
    check_engine(config)


def check_engine(config: RunConfig, kind: Literal["loop", "spark"] | None = None) -> None:
    """Refuse what engine `kind` (default: the configured one) cannot do, rather than ignore it: every other
    setting reaches both engines."""
    if (kind or config.engine.kind) == "loop":
        _check_loop(config)
    else:
        _check_spark(config)


def _check_loop(config: RunConfig) -> None:
    engine, defaults = config.engine, EngineConfig()
    for name in ("master", "checkpoint", "trigger_seconds"):
        if getattr(engine, name) != getattr(defaults, name):
            raise ConfigError(f"engine.{name} is a setting of the Spark engine: set engine.kind = spark")


def _check_spark(config: RunConfig) -> None:
    if not config.source.url.startswith("kafka:"):
        raise ConfigError("engine.kind = spark needs a Kafka source: Spark reads partition offset ranges")
    if config.parallelism.processes > 1:
        raise ConfigError("engine.kind = spark runs one query: executors scale it, not parallelism.processes")
    if config.parallelism.decode_workers is not None:
        raise ConfigError(
            "engine.kind = spark decodes in its executors: parallelism.decode_workers is the loop's"
        )
    source, defaults = config.source, SourceConfig()
    if (source.retries, source.retry_backoff_s) != (defaults.retries, defaults.retry_backoff_s):
        raise ConfigError(
            "engine.kind = spark retries a failed task itself (spark.task.maxFailures): "
            "source.retries and source.retry_backoff_s are the loop engine's"
        )
    if source.join_grace_s != defaults.join_grace_s:
        raise ConfigError("engine.kind = spark joins no consumer group: source.join_grace_s is the loop's")
    root = config.sink.url.partition(":")[2]
    if not config.engine.checkpoint and "://" in root and not root.startswith("file://"):
        raise ConfigError(f"sink {config.sink.url!r} is not a local directory: set engine.checkpoint")


def _check_large_messages(config: LargeMessagesConfig) -> None:
    roots = [*config.claim_check_roots, *filter(None, [config.claim_check_root_override])]
    try:
        for root in roots:
            parse_location(root.partition("?")[0])
        if config.upstream_dsn:
            connection_options(config.upstream_dsn)
    except (ConsumerError, ValueError) as exc:
        raise ConfigError(f"large_messages: {exc}") from exc
    if config.fetch_concurrency < 1 or config.max_object_bytes < 1 or config.fetch_retries < 0:
        raise ConfigError("large_messages: fetch_concurrency and max_object_bytes >= 1, fetch_retries >= 0")


def _check_sink(config: RunConfig) -> None:
    kind, _, root = config.sink.url.partition(":")
    if kind not in ("delta", "parquet", "jsonl"):
        raise ConfigError(f"sink {config.sink.url!r}: expected delta:ROOT, parquet:ROOT or jsonl:ROOT")
    if kind == "jsonl" and "://" in root:
        raise ConfigError(
            f"sink {config.sink.url!r}: the JSON-lines sink appends to files in a local directory"
        )


def kafka_source_parts(url: str) -> tuple[str, list[str]]:
    """kafka://HOST:PORT/T1,T2 -> ("HOST:PORT", ["T1", "T2"])."""
    parsed = urlparse(url)
    return parsed.netloc, [t for t in parsed.path.strip("/").split(",") if t]


def file_source_path(url: str) -> Path:
    return Path(url.partition(":")[2])
