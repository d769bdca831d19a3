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
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import msgspec

from consumer.errors import ConfigError, ConsumerError
from consumer.large_messages.dsn import connection_options
from consumer.large_messages.storage import parse_location
from consumer.protocol.limits import DecodeLimits
from consumer.protocol.protocols import resolves_by_watermark
from consumer.protocol.ticdc_avro import registry_settings
from consumer.watchdog import DEFAULT_STALL_AFTER_S

ENV_PREFIX = "TICDC_CONSUMER_"
SINK_OUTPUTS = ("changelog", "mirror", "history")  # the Delta tables a Delta sink may keep per table
# Value decoding is most of a record's CPU: a lone process on a multi-core machine decodes in worker
# processes beside its loop; two beat one even on 2 cores (benchmarks/lakehouse.py). Several group members
# (`processes`) already keep the cores busy, and decode in their loops: workers would only add copying.
DEFAULT_DECODE_WORKERS = 2 if (os.cpu_count() or 1) > 1 else 0


def described(help_text: str, *, flag: str | bool = True) -> msgspec.Meta:
    """A field's help text and its `run` flag, kept on the field so that one edit adds an option everywhere
    (consumer.config_fields): `flag` True derives it from the field's name, a string names it, False: none.
    Dicts and lists have no flag: they are set in the file or the environment."""
    return msgspec.Meta(description=help_text, extra={"flag": flag})


class SourceConfig(msgspec.Struct, forbid_unknown_fields=True):
    url: Annotated[
        str,
        described("kafka://HOST:PORT/TOPIC[,TOPIC...], or file:PATH.jsonl (a capture file)", flag="--source"),
    ] = ""
    group: Annotated[str, described("consumer group id; also the name sinks record progress under")] = (
        "ticdc-consumer"
    )
    kafka: Annotated[dict[str, str], described("librdkafka settings (TLS, SASL, timeouts)")] = msgspec.field(
        default_factory=dict
    )
    unreachable_timeout_s: Annotated[
        float, described("every broker unreachable this long, once connected: run exits 4")
    ] = 60.0
    retries: Annotated[
        int,
        described(
            "a transient error (a timeout, a rebalance after a slow cycle) is retried this often; "
            "a permanent one stops the run"
        ),
    ] = 5
    retry_backoff_s: Annotated[
        float, described("the first retry's wait, doubling each time (at most 10 s)")
    ] = 0.5
    join_grace_s: Annotated[
        float,
        described(
            "--until-idle: how much longer a member holding no partition waits for one (a join takes up to "
            "about half session.timeout.ms) before exit 5"
        ),
    ] = 30.0


_LIMITS = DecodeLimits()


class DecodeConfig(msgspec.Struct, forbid_unknown_fields=True):
    protocol: Annotated[
        Literal["simple", "avro", "debezium"], described("simple, avro (Confluent) or debezium")
    ] = "simple"
    encoding: Annotated[Literal["auto", "json", "avro"], described("the Simple protocol's: json or avro")] = (
        "auto"
    )
    compression: Annotated[
        Literal["auto", "none", "snappy", "lz4"],
        described(
            "none, snappy or lz4; Debezium's auto recognises LZ4 only: set snappy for a changefeed "
            "compressing with snappy"
        ),
    ] = "auto"
    unrepresentable: Annotated[
        Literal["null", "raise"],
        described("values Python cannot hold (MySQL zero dates): null (counted) or raise"),
    ] = "null"
    ordering: Annotated[
        Literal["auto", "watermark", "arrival"],
        described(
            "watermark: rows wait for every partition's watermark (cross-table consistency); arrival: rows "
            "go out as they arrive, exact per key (streams without watermarks); auto: watermark for Simple, "
            "arrival otherwise"
        ),
    ] = "auto"
    schema_registry: Annotated[
        str, described("TiCDC Avro: the Confluent schema registry URL, may hold user:password@")
    ] = ""
    schema_registry_auth: Annotated[
        str, described("USER:PASSWORD for the registry (HTTP basic auth: basic.auth.user.info)")
    ] = ""
    schema_registry_config: Annotated[
        dict[str, str | int | float | bool],
        described("other settings of the registry's client (SchemaRegistryClient); numbers also as text"),
    ] = msgspec.field(default_factory=dict)
    timestamp_zone: Annotated[str, described("TiCDC Avro: the zone of TIMESTAMP text, TiCDC's --tz")] = "UTC"
    unknown_types: Annotated[
        Literal["lossless", "error"],
        described(
            "unknown mysqlTypes: lossless (a string column of the wire text) or error (table rejected)"
        ),
    ] = "lossless"
    max_decompressed_bytes: Annotated[
        int, described("a compressed value declaring or producing more is refused (per record)")
    ] = _LIMITS.max_decompressed_bytes
    max_nesting_depth: Annotated[
        int, described("JSON nesting accepted in a message and in a JSON column's document")
    ] = _LIMITS.max_nesting_depth
    max_value_bytes: Annotated[int, described("the longest single column value accepted")] = (
        _LIMITS.max_value_bytes
    )
    max_commit_ts_ahead_s: Annotated[
        float, described("a commitTs further than this past this machine's clock is corrupt")
    ] = _LIMITS.max_commit_ts_ahead_s

    def registry_config(self) -> dict[str, Any]:
        """The registry client's settings, its numbers as numbers (`RegistrySettingsError` for one that is
        none)."""
        auth = {"basic.auth.user.info": self.schema_registry_auth} if self.schema_registry_auth else {}
        return registry_settings.typed({**self.schema_registry_config, **auth})

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
    url: Annotated[
        str,
        described(
            "delta:ROOT, parquet:ROOT or jsonl:DIR (local); ROOT a directory or an object-store URI (s3://...)",
            flag="--sink",
        ),
    ] = ""
    mode: Annotated[
        str,
        described(
            "Delta tables kept per table: a comma list of changelog, mirror, history; both = changelog,mirror"
        ),
    ] = "both"
    storage_options: Annotated[
        dict[str, str],
        described("for delta-rs and pyarrow.fs; the AWS_*, AZURE_* and GOOGLE_* variables work too"),
    ] = msgspec.field(default_factory=dict)
    target_file_size: Annotated[
        int, described("bytes per mirror file: a MERGE rewrites only the files holding changed keys")
    ] = 1024 * 1024
    allow_unsafe_commits: Annotated[
        bool, described("accept a store without conditional writes, for one writer process only")
    ] = False
    mirror_interval_s: Annotated[
        float,
        described(
            "MERGE a mirror at most this often, each key's net change since its last MERGE (0: every batch); "
            "the changelog is written every batch and reads combine both"
        ),
    ] = 0.0
    mirror_interval_rows: Annotated[
        int,
        described("MERGE a mirror once this many changelog rows await it (0: no row threshold)"),
    ] = 0
    mirror_buckets: Annotated[
        int,
        described(
            "new mirrors get this many hash buckets of their key (a partition column, _bucket): a MERGE "
            "names its buckets and touches only their files (0: none)"
        ),
    ] = 0
    mirror_split_rows: Annotated[
        int,
        described(
            "a bucketed mirror's MERGE of this many keys or more, in two buckets or more, runs in bucket "
            "groups in parallel (Spark tasks; the loop engine's threads), one commit (0: never; local roots)"
        ),
    ] = 0


class ErrorsConfig(msgspec.Struct, forbid_unknown_fields=True):
    policy: Annotated[
        Literal["dead-letter", "fail"], described("dead-letter or fail (exit 2)", flag="--error-policy")
    ] = "dead-letter"
    dead_letter: Annotated[
        str,
        described(
            "file:PATH, an object-store URI (an object per record) or kafka://HOST:PORT/TOPIC; "
            "default <sink root>/_dead_letters.jsonl"
        ),
    ] = ""
    kafka: Annotated[dict[str, str], described("a dead-letter topic's producer settings")] = msgspec.field(
        default_factory=dict
    )


class BudgetConfig(msgspec.Struct, forbid_unknown_fields=True):
    pending_bytes: Annotated[
        int, described("rows waiting for a schema or the watermark: beyond this many bytes partitions pause")
    ] = 256 * 1024 * 1024
    pending_timeout_s: Annotated[
        float, described("a row still without its schema after this long goes to the error policy")
    ] = 240.0
    max_batch_records: Annotated[
        int,
        described(
            "records per cycle: larger means fewer Delta commits and MERGEs. A member applying in its loop "
            "(no decode workers, e.g. --processes 2) applies for about 2 s a cycle, then polls again, and "
            "pauses every partition while more than this many rows wait (it stays in its group, within "
            "max.poll.interval.ms)"
        ),
    ] = 100_000


class ParallelismConfig(msgspec.Struct, forbid_unknown_fields=True):
    """How many processes a `run` command uses."""

    processes: Annotated[
        int,
        described(
            "members of the consumer group this command runs, a process each (several cores); "
            "a Kafka source and a Delta or JSONL sink"
        ),
    ] = 1
    decode_workers: Annotated[
        int | None,
        described(
            "processes decoding values beside a member's loop, 0: in it; unset: 2 on a multi-core machine "
            "if processes = 1, else 0"
        ),
    ] = None

    def member_decode_workers(self) -> int:
        """Decode workers per member: as configured, else the default for a lone process, else none."""
        if self.decode_workers is not None:
            return self.decode_workers
        return DEFAULT_DECODE_WORKERS if self.processes == 1 else 0


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    kind: Annotated[
        Literal["loop", "spark"],
        described("loop: consume in this process; spark: as a Spark streaming query", flag="--engine"),
    ] = "loop"
    master: Annotated[
        str, described("spark: local[N], spark://HOST:PORT, yarn...; default spark-submit's, else local[2]")
    ] = ""
    checkpoint: Annotated[
        str,
        described(
            "spark: the query's checkpoint directory, required for a non-local sink root; "
            "default <sink root>/_spark/<group>"
        ),
    ] = ""
    trigger_seconds: Annotated[
        float, described("spark without --until-idle: the processingTime trigger (0: back to back)")
    ] = 0.0


class MetricsConfig(msgspec.Struct, forbid_unknown_fields=True):
    port: Annotated[
        int, described("serve Prometheus metrics on this port (0: no endpoint)", flag="--metrics-port")
    ] = 0


class WatchdogConfig(msgspec.Struct, forbid_unknown_fields=True):
    stall_after_s: Annotated[
        float,
        described(
            "a sink write, DDL or progress commit, a dead-letter write, a claim-check fetch or an upstream "
            "lookup in progress this long is a stall: logged every as often while it lasts, and shown by the "
            "ticdc_stall_seconds gauge"
        ),
    ] = DEFAULT_STALL_AFTER_S


class LargeMessagesConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Key-only DMLs (docs/protocols/simple.md §7): claim-checks read only under configured roots,
    handle-key-only rows looked up upstream."""

    claim_check_roots: Annotated[
        list[str],
        described(
            "URIs claim-checks may be read under (file:///DIR, s3://BUCKET/PREFIX, gs://..., abfss://...; "
            "pyarrow.fs options after a ?); none: all refused; comma-separated in the environment"
        ),
    ] = msgspec.field(default_factory=list)
    claim_check_root_override: Annotated[
        str,
        described(
            "read each object's base name from this one root instead (TiCDC's own consumer does, for "
            "users who moved the files)"
        ),
    ] = ""
    claim_check_raw_value: Annotated[
        bool | Literal["auto"],
        described("objects hold bare values: true, false or auto (the key/value envelope is recognised)"),
    ] = "auto"
    max_object_bytes: Annotated[int, described("larger claim-check objects are refused unread")] = (
        128 * 1024 * 1024
    )
    fetch_concurrency: Annotated[int, described("claim-checks of a poll fetched at once")] = 16
    fetch_retries: Annotated[int, described("retries of a storage error (exponential backoff)")] = 4
    upstream_dsn: Annotated[
        str,
        described(
            "mysql://USER:PASSWORD@HOST:PORT: look handle-key-only rows up in upstream TiDB (without it "
            "they go to the error policy); set it in the environment to keep the password out of files",
            flag=False,  # a password on a command line is visible to every user of the machine
        ),
    ] = ""


class IntegrityConfig(msgspec.Struct, forbid_unknown_fields=True):
    verify_checksums: Annotated[
        bool, described("rows carrying TiDB row checksums are verified; others pass")
    ] = True


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
            client_section, table = _CLIENT_SETTINGS[client]
            settings = found.setdefault(client_section, {}).setdefault(table, {})
            settings[rest[len(client) :].replace("_", ".")] = value
            continue
        section = next((s for s in RunConfig.__struct_fields__ if rest.startswith(s + "_")), None)
        if section is not None:
            field = rest[len(section) + 1 :]
            found.setdefault(section, {})[field] = value.split(",") if field in _LIST_FIELDS else value
    return found


# Client settings in the environment, by prefix (dots as underscores): the source's consumer, a dead-letter
# topic's producer (librdkafka's), the schema registry's client
_CLIENT_SETTINGS = {
    "kafka_": ("source", "kafka"),
    "errors_kafka_": ("errors", "kafka"),
    "decode_schema_registry_config_": ("decode", "schema_registry_config"),
}
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
    _check_budget(config.budget)
    if config.decode.protocol == "avro" and not config.decode.schema_registry:
        raise ConfigError("decode.protocol = avro needs decode.schema_registry (the registry URL)")
    try:
        config.decode.registry_config()
    except registry_settings.RegistrySettingsError as exc:
        raise registry_setting_error(exc, config.decode) from exc
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


def _check_budget(budget: BudgetConfig) -> None:
    """A budget of nothing would stall a run (no record ever taken, every row over budget), and a run that
    takes nothing must not look like one that applied everything. A pending timeout of 0 is a choice: rows
    without their schema go to the error policy at once."""
    for name in ("pending_bytes", "max_batch_records"):
        value = getattr(budget, name)
        if not value > 0:
            raise ConfigError(f"budget.{name} = {value}: it must be positive")
    if not budget.pending_timeout_s >= 0:
        raise ConfigError(f"budget.pending_timeout_s = {budget.pending_timeout_s}: it must be 0 or more")


def registry_setting_error(exc: registry_settings.RegistrySettingsError, decode: DecodeConfig) -> ConfigError:
    """The refusal of a registry client setting, named as the configuration names it: the URL is
    `decode.schema_registry`, the credentials `decode.schema_registry_auth` when set, any other a key of
    `decode.schema_registry_config`."""
    names = [
        "decode.schema_registry"
        if name == "url"
        else "decode.schema_registry_auth"
        if name == "basic.auth.user.info" and decode.schema_registry_auth
        else f'decode.schema_registry_config."{name}"'
        for name in exc.settings
    ]
    return ConfigError(f"{', '.join(names)}: {exc}")


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
    kind, _, root = config.sink.url.partition(":")
    outputs = sink_outputs(config.sink.mode)
    if kind == "delta" and "mirror" in outputs and "changelog" not in outputs:
        raise ConfigError(
            "engine.kind = spark MERGEs mirrors on its executors from the changelog: "
            f"sink.mode {config.sink.mode!r} must keep the changelog too (e.g. changelog,mirror)"
        )
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


def sink_outputs(mode: str) -> frozenset[str]:
    """The Delta tables `sink.mode` keeps per upstream table: a comma list of changelog, mirror and history,
    where `both` (the default since before history tables) still means changelog and mirror."""
    outputs: set[str] = set()
    for part in mode.split(","):
        name = part.strip().lower()
        if name not in (*SINK_OUTPUTS, "both"):
            raise ValueError(f"sink mode {mode!r}: expected a comma list of {', '.join(SINK_OUTPUTS)}, both")
        outputs.update(("changelog", "mirror") if name == "both" else (name,))
    return frozenset(outputs)


def _check_sink(config: RunConfig) -> None:
    kind, _, root = config.sink.url.partition(":")
    try:
        sink_outputs(config.sink.mode)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if kind not in ("delta", "parquet", "jsonl"):
        raise ConfigError(f"sink {config.sink.url!r}: expected delta:ROOT, parquet:ROOT or jsonl:ROOT")
    if not root.strip():
        raise ConfigError(
            f"sink {config.sink.url!r} names no root: give a directory or an object-store URI after "
            f"'{kind}:' (the current directory is no default)"
        )
    sink = config.sink
    if (
        min(sink.mirror_interval_s, sink.mirror_interval_rows, sink.mirror_buckets, sink.mirror_split_rows)
        < 0
    ):
        raise ConfigError(
            "sink.mirror_interval_s, mirror_interval_rows, mirror_buckets and mirror_split_rows must be >= 0"
        )
    outputs = sink_outputs(sink.mode)
    lazy = bool(sink.mirror_interval_s or sink.mirror_interval_rows) and "mirror" in outputs
    if lazy and "changelog" not in outputs:
        raise ConfigError(
            "sink.mirror_interval_s / mirror_interval_rows MERGE a mirror from its changelog: "
            "sink.mode must keep the changelog too"
        )
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
