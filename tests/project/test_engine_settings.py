"""Every `RunConfig` field, walked: each engine honours it (it reaches what that engine builds) or refuses
it at start with a `ConfigError`. Nothing is silently ignored, and a new field fails this test until it is
placed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumer import app
from consumer.config import (
    ConfigError,
    ParallelismConfig,
    RunConfig,
    SinkConfig,
    SourceConfig,
    load_config,
)
from consumer.configured import build_policy
from consumer.pipeline import Pipeline
from consumer.spark import engine
from consumer.spark.engine import ChangeBatches
from consumer.spark.source import TicdcOptions

Field = tuple[str, str]
ALL_FIELDS = [
    (section, name)
    for section in RunConfig.__struct_fields__
    for name in getattr(RunConfig(), section).__struct_fields__
]

# A value other than the default for every field (paths under the test's directory: `{tmp}`).
NON_DEFAULT: dict[Field, Any] = {
    ("source", "url"): "kafka://127.0.0.1:9/orders,payments",
    ("source", "group"): "orders-lake",
    ("source", "kafka"): {"fetch.min.bytes": "2048"},
    ("source", "unreachable_timeout_s"): 7.5,
    ("source", "retries"): 9,
    ("source", "retry_backoff_s"): 2.0,
    ("source", "join_grace_s"): 4.0,
    ("decode", "protocol"): "debezium",
    ("decode", "encoding"): "avro",
    ("decode", "compression"): "lz4",
    ("decode", "unrepresentable"): "raise",
    ("decode", "ordering"): "arrival",
    ("decode", "schema_registry"): "http://127.0.0.1:9/registry",
    ("decode", "schema_registry_auth"): "user:secret",
    ("decode", "schema_registry_config"): {"timeout": "3"},
    ("decode", "timestamp_zone"): "Asia/Shanghai",
    ("decode", "unknown_types"): "error",
    ("decode", "max_decompressed_bytes"): 12345,
    ("decode", "max_nesting_depth"): 17,
    ("decode", "max_value_bytes"): 4321,
    ("decode", "max_commit_ts_ahead_s"): 99.0,
    ("sink", "url"): "delta:{tmp}/other-lake",
    ("sink", "mode"): "changelog,history,mirror",
    ("sink", "storage_options"): {"timeout": "5s"},
    ("sink", "target_file_size"): 4096,
    ("sink", "allow_unsafe_commits"): True,
    ("sink", "mirror_interval_s"): 30.0,
    ("sink", "mirror_interval_rows"): 50_000,
    ("sink", "mirror_buckets"): 16,
    ("sink", "mirror_split_rows"): 5000,
    ("errors", "policy"): "fail",
    ("errors", "dead_letter"): "file:{tmp}/letters.jsonl",
    ("errors", "kafka"): {"linger.ms": "5"},
    ("budget", "pending_bytes"): 1234567,
    ("budget", "pending_timeout_s"): 33.0,
    ("budget", "max_batch_records"): 777,
    ("parallelism", "processes"): 3,
    ("parallelism", "decode_workers"): 1,
    ("engine", "kind"): "spark",
    ("engine", "master"): "local[1]",
    ("engine", "checkpoint"): "{tmp}/checkpoints",
    ("engine", "trigger_seconds"): 5.0,
    ("metrics", "port"): 9123,
    ("watchdog", "stall_after_s"): 2.5,
    ("large_messages", "claim_check_roots"): ["file:///claims"],
    ("large_messages", "claim_check_root_override"): "file:///moved",
    ("large_messages", "claim_check_raw_value"): True,
    ("large_messages", "max_object_bytes"): 2048,
    ("large_messages", "fetch_concurrency"): 3,
    ("large_messages", "fetch_retries"): 1,
    ("large_messages", "upstream_dsn"): "mysql://root:pw@127.0.0.1:4000",
    ("integrity", "verify_checksums"): False,
}


@dataclass
class Built:
    """What one engine built from a configuration: the pipeline that applies rows (the loop's member, or
    Spark's driver), how it reads Kafka, what its tasks decode with, and the configurations the shared
    builders (`consumer.configured`) were handed."""

    pipeline: Pipeline
    source: dict[str, Any]
    batch_records: int
    task_policy: Any = None
    builders: dict[str, RunConfig] = field(default_factory=dict)
    checkpoint: str = ""


def _policy(name: str) -> Callable[[Built], Any]:
    """A policy setting, as the driver decodes with it and (Spark) as its tasks do."""

    def read(built: Built) -> Any:
        value = getattr(built.pipeline.policy, name)
        if built.task_policy is not None:
            assert getattr(built.task_policy, name) == value, f"tasks decode with another {name}"
        return value

    return read


def _builder(name: str, section: str, setting: str) -> Callable[[Built], Any]:
    """A setting a shared builder reads, as the engine handed it over."""
    return lambda built: getattr(getattr(built.builders[name], section), setting)


def _limit(name: str) -> Callable[[Built], Any]:
    return lambda built: getattr(_policy("limits")(built), name)


HONOURED: dict[Field, Callable[[Built], Any]] = {
    ("source", "url"): lambda b: (b.source["servers"], b.source["topics"]),
    ("source", "group"): lambda b: b.pipeline.group,
    ("source", "kafka"): lambda b: {"fetch.min.bytes": b.source["kafka"]["fetch.min.bytes"]},
    ("source", "unreachable_timeout_s"): lambda b: b.source["unreachable_timeout"],
    ("decode", "protocol"): lambda b: type(b.pipeline.decoder).__name__,
    ("decode", "encoding"): lambda b: b.pipeline.decoder.encoding,
    ("decode", "compression"): lambda b: b.pipeline.decoder.compression,
    ("decode", "unrepresentable"): _policy("unrepresentable"),
    ("decode", "ordering"): lambda b: b.pipeline.state.ordering,
    ("decode", "schema_registry"): lambda b: b.pipeline.decoder.registry.url,
    ("decode", "schema_registry_auth"): lambda b: b.pipeline.decoder.registry.config["basic.auth.user.info"],
    ("decode", "schema_registry_config"): lambda b: {
        "timeout": b.pipeline.decoder.registry.config["timeout"]
    },
    ("decode", "timestamp_zone"): _policy("timestamp_location"),
    ("decode", "unknown_types"): _policy("unknown_types"),
    ("decode", "max_decompressed_bytes"): _limit("max_decompressed_bytes"),
    ("decode", "max_nesting_depth"): _limit("max_nesting_depth"),
    ("decode", "max_value_bytes"): _limit("max_value_bytes"),
    ("decode", "max_commit_ts_ahead_s"): _limit("max_commit_ts_ahead_s"),
    ("sink", "url"): lambda b: f"delta:{b.pipeline.sinks[0].root.uri}",
    ("sink", "mode"): lambda b: ",".join(sorted(b.pipeline.sinks[0].outputs)),
    ("sink", "storage_options"): lambda b: b.pipeline.sinks[0].root.storage_options,
    ("sink", "target_file_size"): lambda b: b.pipeline.sinks[0].target_file_size,
    ("sink", "allow_unsafe_commits"): _builder("build_sinks", "sink", "allow_unsafe_commits"),
    ("sink", "mirror_interval_s"): lambda b: b.pipeline.sinks[0].mirror_interval_s,
    ("sink", "mirror_interval_rows"): lambda b: b.pipeline.sinks[0].mirror_interval_rows,
    ("sink", "mirror_buckets"): lambda b: b.pipeline.sinks[0].mirror_buckets,
    ("sink", "mirror_split_rows"): lambda b: b.pipeline.sinks[0].split_rows,
    ("errors", "policy"): lambda b: b.pipeline.state.policy,
    ("errors", "dead_letter"): lambda b: f"file:{b.pipeline.dead_letters.path}",
    ("errors", "kafka"): _builder("build_dead_letters", "errors", "kafka"),
    ("budget", "pending_bytes"): lambda b: b.pipeline.state.budget_bytes,
    ("budget", "pending_timeout_s"): lambda b: b.pipeline.state._pending.timeout,
    ("budget", "max_batch_records"): lambda b: b.batch_records,
    ("large_messages", "claim_check_roots"): lambda b: [
        root.uri for root in b.pipeline.large_messages.store.roots
    ],
    ("large_messages", "claim_check_root_override"): lambda b: b.pipeline.large_messages.store.override.uri,
    ("large_messages", "claim_check_raw_value"): lambda b: b.pipeline.large_messages.raw_value,
    ("large_messages", "max_object_bytes"): lambda b: b.pipeline.large_messages.store.max_object_bytes,
    ("large_messages", "fetch_concurrency"): lambda b: b.pipeline.large_messages.concurrency,
    ("large_messages", "fetch_retries"): lambda b: b.pipeline.large_messages.store.retries,
    ("large_messages", "upstream_dsn"): _builder("build_large_messages", "large_messages", "upstream_dsn"),
    ("integrity", "verify_checksums"): _policy("verify_checksums"),
    ("watchdog", "stall_after_s"): lambda b: b.pipeline.watchdog.after,
}
EXPECTED: dict[Field, Any] = {  # where what the engine built reads differently from the TOML value
    ("source", "url"): ("127.0.0.1:9", ["orders", "payments"]),
    ("decode", "protocol"): "DebeziumDecoder",
    ("decode", "schema_registry_config"): {"timeout": 3.0},  # the client takes numbers only
}
LOOP_ONLY: dict[Field, str] = {  # the Spark engine refuses these; the loop engine's `HONOURED` reads them
    ("source", "retries"): "retries a failed task itself",
    ("source", "retry_backoff_s"): "retries a failed task itself",
    ("source", "join_grace_s"): "joins no consumer group",
    ("parallelism", "processes"): "executors scale it",
    ("parallelism", "decode_workers"): "decodes in its executors",
}
LOOP_ONLY_READS: dict[Field, Callable[[Built], Any]] = {
    ("source", "retries"): lambda b: b.pipeline.source_retry.attempts,
    ("source", "retry_backoff_s"): lambda b: b.pipeline.source_retry.backoff,
    ("source", "join_grace_s"): lambda b: b.pipeline.join_grace,
    ("parallelism", "decode_workers"): lambda b: b.pipeline._writer._pool._executor._max_workers,
}
SPARK_ONLY: dict[Field, str] = {  # the loop engine refuses these
    ("engine", "master"): "a setting of the Spark engine",
    ("engine", "checkpoint"): "a setting of the Spark engine",
    ("engine", "trigger_seconds"): "a setting of the Spark engine",
}
SPARK_ONLY_READS: dict[Field, Callable[[Built], Any]] = {
    ("engine", "checkpoint"): lambda b: b.checkpoint.removesuffix("/ticdc"),
}
SPARK_RUN = {  # read by `consumer.spark.engine.run` as it starts the query
    ("engine", "master"): "the session's master (tests/spark/test_spark_cli.py runs on a standalone cluster)",
    ("engine", "trigger_seconds"): "the processingTime trigger of a query run until stopped",
}
BY_THE_COMMAND = {  # read by `run` itself, whatever the engine
    ("engine", "kind"): "chooses the engine",
    ("metrics", "port"): "the run command's progress reporter serves the metrics of either engine",
    ("parallelism", "processes"): "the loop's group of member processes (`consumer.app._run_group`)",
}


def test_every_field_is_placed_for_both_engines() -> None:
    placed = set(HONOURED) | set(LOOP_ONLY) | set(SPARK_ONLY) | set(BY_THE_COMMAND)
    assert set(LOOP_ONLY_READS) | {("parallelism", "processes")} == set(LOOP_ONLY)
    assert set(SPARK_ONLY_READS) | set(SPARK_RUN) == set(SPARK_ONLY)
    assert sorted(set(ALL_FIELDS) - placed) == []
    assert sorted(set(NON_DEFAULT) ^ set(ALL_FIELDS)) == []
    for (section, name), value in NON_DEFAULT.items():
        assert value != getattr(getattr(RunConfig(), section), name), f"{section}.{name} is its default"


def _configured(tmp_path: Path, changed: Field, kind: str = "loop") -> RunConfig:
    """The configuration of engine `kind` with one field changed (its companions set where it needs
    them), as `run` loads it."""
    overrides: dict[str, dict[str, Any]] = {
        "source": {"url": "kafka://127.0.0.1:9/orders"},
        "sink": {"url": f"delta:{tmp_path}/lake"},
        "engine": {"kind": kind},
    }
    value = NON_DEFAULT[changed]
    if isinstance(value, str):
        value = value.format(tmp=tmp_path)
    overrides.setdefault(changed[0], {})[changed[1]] = value
    if changed[0] == "decode" and changed[1].startswith("schema_registry"):
        overrides["decode"].update(protocol="avro", schema_registry="http://127.0.0.1:9/registry")
    if changed == ("errors", "kafka"):
        overrides["errors"]["dead_letter"] = "kafka://127.0.0.1:9/letters"
    return load_config(environ={}, overrides=overrides)


def _record_builders(monkeypatch: pytest.MonkeyPatch, module: Any) -> dict[str, RunConfig]:
    seen: dict[str, RunConfig] = {}
    for name in ("build_sinks", "build_dead_letters", "build_large_messages"):
        real = getattr(module, name)

        def recorded(config: RunConfig, *args: Any, _real: Any = real, _name: str = name) -> Any:
            seen[_name] = config
            return _real(config, *args)

        monkeypatch.setattr(module, name, recorded)
    return seen


@pytest.fixture
def built_by(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, RunConfig], Built]]:
    opened: list[Pipeline | ChangeBatches] = []

    def build(kind: str, config: RunConfig) -> Built:
        if kind == "loop":
            builders = _record_builders(monkeypatch, app)
            pipeline = app.build_pipeline(config)
            opened.append(pipeline)
            sources: list[tuple[Any, Any]] = []
            monkeypatch.setattr(app, "KafkaSource", lambda *args, **kwargs: sources.append((args, kwargs)))
            app.build_source(config, pipeline)
            (servers, topics, _), kwargs = sources[0]
            source = {
                "servers": servers,
                "topics": topics,
                "kafka": kwargs["config"],
                "unreachable_timeout": kwargs["unreachable_timeout"],
            }
            return Built(pipeline, source, pipeline.max_batch_records, builders=builders)
        builders = _record_builders(monkeypatch, engine)
        handler = ChangeBatches(config)
        opened.append(handler)
        handler._start(None)
        assert handler._pipeline is not None
        task = TicdcOptions.parse(handler.options.to_spark())  # what tasks get, through Spark's options
        source = {
            "servers": task.bootstrap_servers,
            "topics": list(task.topics),
            "kafka": task.kafka,
            "unreachable_timeout": task.settings.source.unreachable_timeout_s,
        }
        return Built(
            handler._pipeline,
            source,
            task.max_offsets_per_trigger or 0,
            task_policy=build_policy(task.settings),
            builders=builders,
            checkpoint=handler.options.state_location,
        )

    yield build
    for thing in opened:
        thing.close()


ENGINE_FIELDS = [f for f in ALL_FIELDS if f != ("engine", "kind")]  # engine.kind chooses the engine


@pytest.mark.parametrize("changed", ENGINE_FIELDS, ids=[".".join(f) for f in ENGINE_FIELDS])
@pytest.mark.parametrize("kind", ["loop", "spark"])
def test_each_engine_honours_or_refuses_every_field(
    kind: str, changed: Field, tmp_path: Path, built_by: Callable[[str, RunConfig], Built]
) -> None:
    refused = (LOOP_ONLY if kind == "spark" else SPARK_ONLY).get(changed)
    if refused is not None:
        with pytest.raises(ConfigError, match=refused):
            _configured(tmp_path, changed, kind)
        return
    config = _configured(tmp_path, changed, kind)
    if changed in BY_THE_COMMAND or changed in SPARK_RUN:
        return
    built = built_by(kind, config)
    read = HONOURED.get(changed) or {**LOOP_ONLY_READS, **SPARK_ONLY_READS}[changed]
    expected = EXPECTED.get(changed, getattr(getattr(config, changed[0]), changed[1]))
    assert read(built) == expected


def test_a_refused_setting_stops_the_start(tmp_path: Path) -> None:
    overrides = {"source": {"url": "kafka://127.0.0.1:9/t"}, "sink": {"url": f"delta:{tmp_path}"}}
    with pytest.raises(ConfigError, match="decodes in its executors"):
        load_config(
            environ={"TICDC_CONSUMER_PARALLELISM_DECODE_WORKERS": "2", "TICDC_CONSUMER_ENGINE_KIND": "spark"},
            overrides=overrides,
        )
    config = RunConfig(
        source=SourceConfig(url="kafka://127.0.0.1:9/t"),
        sink=SinkConfig(url=f"delta:{tmp_path}"),
        parallelism=ParallelismConfig(decode_workers=0),
    )
    with pytest.raises(ConfigError, match="decodes in its executors"):
        ChangeBatches(config)  # a configuration built in code is checked too
    environ = {"TICDC_CONSUMER_ENGINE_CHECKPOINT": str(tmp_path / "cp")}
    with pytest.raises(ConfigError, match=r"engine\.checkpoint is a setting of the Spark engine"):
        load_config(environ=environ, overrides=overrides)


def test_spark_refuses_a_mirror_it_cannot_merge_from_the_changelog(tmp_path: Path) -> None:
    """The Spark engine MERGEs mirrors on its executors from the changelog: a mirror without one is refused
    at start, not MERGEd on the driver."""
    for mode in ("mirror", "history,mirror"):
        overrides = {
            "source": {"url": "kafka://127.0.0.1:9/t"},
            "sink": {"url": f"delta:{tmp_path}", "mode": mode},
            "engine": {"kind": "spark"},
        }
        with pytest.raises(ConfigError, match="must keep the changelog too"):
            load_config(environ={}, overrides=overrides)
    overrides["sink"]["mode"] = "changelog,mirror"
    assert load_config(environ={}, overrides=overrides).sink.mode == "changelog,mirror"


def test_tasks_get_the_registry_from_no_option(tmp_path: Path) -> None:
    """The registry's URL and credentials stay with the driver: tasks of TiCDC Avro do not decode rows."""
    config = _configured(tmp_path, ("decode", "schema_registry_auth"))
    options = engine.stream_options(config).to_spark()
    assert options["decode.protocol"] == "avro"
    assert not [name for name in options if "registry" in name]
    assert "secret" not in repr(msgspec.json.encode(engine.stream_options(config)))


REGISTRY_REFUSALS = [  # (settings, the setting named, words of the reason)
    ({"schema_registry_config": {"timeout": "soon"}}, 'decode.schema_registry_config."timeout"', "a number"),
    (
        {"schema_registry_config": {"max.retries": "2.5"}},
        'decode.schema_registry_config."max.retries"',
        "a whole number of retries",
    ),
    ({"schema_registry_config": {"no.such": "1"}}, 'decode.schema_registry_config."no.such"', "no.such"),
    (
        {"schema_registry_config": {"ssl.key.location": "/k", "ssl.key.password": "hunter2"}},
        'decode.schema_registry_config."ssl.key.location"',  # (and ssl.key.password, in what the client said)
        "ssl.certificate.location required",
    ),
    ({"schema_registry_auth": "hunter2"}, "decode.schema_registry_auth", "basic.auth.user.info = ***"),
    ({"schema_registry": "ftp://user:hunter2@127.0.0.1:9"}, "decode.schema_registry", "ftp://***@127.0.0.1"),
]


@pytest.mark.parametrize(("settings", "named", "words"), REGISTRY_REFUSALS)
@pytest.mark.parametrize("kind", ["loop", "spark"])
def test_each_engine_refuses_a_registry_setting_at_start_naming_it_without_secrets(
    kind: str,
    settings: dict[str, Any],
    named: str,
    words: str,
    tmp_path: Path,
    built_by: Callable[[str, RunConfig], Built],
) -> None:
    """What the registry client refuses stops the start with a `ConfigError` that names the setting and
    masks passwords, as loading the configuration does where it can tell without the client."""
    decode = {"protocol": "avro", "schema_registry": "http://127.0.0.1:9/registry", **settings}
    overrides = {
        "source": {"url": "kafka://127.0.0.1:9/orders"},
        "sink": {"url": f"delta:{tmp_path}/lake"},
        "engine": {"kind": kind},
        "decode": decode,
    }
    try:
        config = load_config(environ={}, overrides=overrides)
    except ConfigError as exc:
        refused = exc  # the configuration alone tells: a number that is none
    else:
        with pytest.raises(ConfigError) as caught:
            built_by(kind, config)
        refused = caught.value
    assert str(refused).startswith(named) and words in str(refused)
    assert "hunter2" not in str(refused)


def test_registry_numbers_come_as_numbers_from_toml_and_the_environment(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[decode.schema_registry_config]\ntimeout = "2.5"\n"cache.capacity" = 50\n')
    environ = {
        "TICDC_CONSUMER_DECODE_SCHEMA_REGISTRY_CONFIG_MAX_RETRIES": "4",
        "TICDC_CONSUMER_DECODE_SCHEMA_REGISTRY_CONFIG_RETRIES_WAIT_MS": " 250 ",
    }
    config = load_config(
        toml,
        environ=environ,
        overrides={"source": {"url": "kafka://h:9/t"}, "sink": {"url": f"delta:{tmp_path}"}},
    )
    assert config.decode.registry_config() == {
        "timeout": 2.5,
        "cache.capacity": 50,
        "max.retries": 4,
        "retries.wait.ms": 250,
    }
