"""Run configuration: a TOML file, overridden by environment variables, overridden by CLI flags.

Validated once at start into typed structs. Environment variables are named
`TICDC_CONSUMER_<SECTION>_<FIELD>` (e.g. `TICDC_CONSUMER_SOURCE_GROUP=orders`); Kafka client settings
pass through from `[source.kafka]` (or `TICDC_CONSUMER_KAFKA_<SETTING>`, dots as underscores:
`TICDC_CONSUMER_KAFKA_SASL_PASSWORD` sets `sasl.password`).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import msgspec

from consumer.protocol.limits import DecodeLimits

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


_LIMITS = DecodeLimits()


class DecodeConfig(msgspec.Struct, forbid_unknown_fields=True):
    encoding: Literal["auto", "json", "avro"] = "auto"
    compression: Literal["auto", "none", "snappy", "lz4"] = "auto"
    unrepresentable: Literal["null", "raise"] = "null"
    unknown_types: Literal["lossless", "error"] = "lossless"
    max_decompressed_bytes: int = _LIMITS.max_decompressed_bytes
    max_nesting_depth: int = _LIMITS.max_nesting_depth
    max_value_bytes: int = _LIMITS.max_value_bytes
    max_commit_ts_ahead_s: float = _LIMITS.max_commit_ts_ahead_s

    def limits(self) -> DecodeLimits:
        return DecodeLimits(
            max_decompressed_bytes=self.max_decompressed_bytes,
            max_nesting_depth=self.max_nesting_depth,
            max_value_bytes=self.max_value_bytes,
            max_commit_ts_ahead_s=self.max_commit_ts_ahead_s,
        )


class SinkConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: str = ""  # delta:ROOT | parquet:ROOT | jsonl:ROOT
    mode: Literal["changelog", "mirror", "both"] = "both"


class ErrorsConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: Literal["dead-letter", "fail"] = "dead-letter"
    dead_letter: str = ""  # file:PATH | kafka://HOST:PORT/TOPIC ; default: <sink root>/_dead_letters.jsonl


class BudgetConfig(msgspec.Struct, forbid_unknown_fields=True):
    pending_bytes: int = 256 * 1024 * 1024
    pending_timeout_s: float = 240.0
    max_batch_records: int = 100_000  # records per cycle: fewer, larger commits and MERGEs
    processes: int = 1  # members of the consumer group this command runs, one process each (Kafka only)
    decode_workers: int | None = None  # processes decoding values beside a loop; 0: in it; None: automatic

    def workers(self) -> int:
        """Decode workers per member: as configured, else the default for a lone process, else none."""
        if self.decode_workers is not None:
            return self.decode_workers
        return DEFAULT_DECODE_WORKERS if self.processes == 1 else 0


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True):
    port: int = 0  # 0: no Prometheus endpoint


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    source: SourceConfig = msgspec.field(default_factory=SourceConfig)
    decode: DecodeConfig = msgspec.field(default_factory=DecodeConfig)
    sink: SinkConfig = msgspec.field(default_factory=SinkConfig)
    errors: ErrorsConfig = msgspec.field(default_factory=ErrorsConfig)
    budget: BudgetConfig = msgspec.field(default_factory=BudgetConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)


class ConfigError(ValueError):
    """The configuration is invalid; the message says which setting and why."""


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] = os.environ,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> RunConfig:
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
    _check_urls(config)
    return config


def _from_environment(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    sections = {name for name in RunConfig.__struct_fields__}
    found: dict[str, dict[str, Any]] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        section, _, field = rest.partition("_")
        if section == "kafka":
            found.setdefault("source", {}).setdefault("kafka", {})[field.replace("_", ".")] = value
        elif section in sections and field:
            found.setdefault(section, {})[field] = value
    return found


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
    if config.sink.url.partition(":")[0] not in ("delta", "parquet", "jsonl"):
        raise ConfigError(f"sink {config.sink.url!r}: expected delta:ROOT, parquet:ROOT or jsonl:ROOT")
    limits = config.decode
    if min(limits.max_decompressed_bytes, limits.max_nesting_depth, limits.max_value_bytes) < 1:
        raise ConfigError(
            "decode limits (max_decompressed_bytes, max_nesting_depth, max_value_bytes) must be >= 1"
        )
    if not limits.max_commit_ts_ahead_s > 0:
        raise ConfigError("decode.max_commit_ts_ahead_s must be positive")
    if config.budget.processes < 1:
        raise ConfigError(f"budget.processes = {config.budget.processes}: at least one process runs")
    if config.budget.processes > 1 and source.scheme != "kafka":
        raise ConfigError("budget.processes > 1 needs a Kafka source: the processes share its partitions")
    if config.budget.processes > 1 and config.sink.url.startswith("parquet:"):
        raise ConfigError(
            "budget.processes > 1 needs a Delta or JSONL sink: Parquet takes one writer per root"
        )


def kafka_source_parts(url: str) -> tuple[str, list[str]]:
    """kafka://HOST:PORT/T1,T2 -> ("HOST:PORT", ["T1", "T2"])."""
    parsed = urlparse(url)
    return parsed.netloc, [t for t in parsed.path.strip("/").split(",") if t]


def file_source_path(url: str) -> Path:
    return Path(url.partition(":")[2])
