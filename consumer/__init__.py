"""Consumer SDK for TiCDC change streams (Simple protocol; TiCDC's Avro and Debezium beside it).

The names most programs need, importable from here; everything else lives in its stage's subpackage
(`consumer.protocol`, `consumer.state`, `consumer.batches`, `consumer.sinks`, `consumer.lakehouse`,
`consumer.spark`, ...). Each name is imported on first use, so `import consumer` loads neither delta-rs,
Spark nor hypothesis:

- decoding: `MessageDecoder`, `MessageEncoder`, `TableCodec`, `ValuePolicy`
- running: `load_config`, `RunConfig`, `run` (what the `run` command does), or by hand `Pipeline` with a
  source (`KafkaSource`, `FileSource`), sinks (`DeltaSink`, `ParquetSink`, `JsonLinesSink`) and a
  dead-letter destination (`DeadLetterFile`); `PipelineStats` is what a run returns
- reading a lakehouse without Spark: `read_changelog`, `read_mirror` (Arrow tables)
- errors: `ConsumerError` (everything bad input raises), `ConfigError`, `DecodeError`, `SinkError`,
  `SourceError`
- property tests: `strategies` (hypothesis strategies for schemas, messages and values)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from consumer.exports import exported

if TYPE_CHECKING:
    __version__: str
    from consumer.app import run
    from consumer.config import RunConfig, load_config
    from consumer.errors import ConfigError, ConsumerError, DecodeError, SinkError
    from consumer.lakehouse.tables import read_changelog, read_mirror
    from consumer.pipeline import Pipeline, PipelineStats
    from consumer.protocol.simple.decoder import MessageDecoder
    from consumer.protocol.simple.encoder import MessageEncoder
    from consumer.protocol.table import TableCodec
    from consumer.protocol.types import ValuePolicy
    from consumer.sinks.dead_letter import DeadLetterFile
    from consumer.sinks.delta import DeltaSink
    from consumer.sinks.jsonl import JsonLinesSink
    from consumer.sinks.parquet import ParquetSink
    from consumer.sources.errors import SourceError
    from consumer.sources.files import FileSource
    from consumer.sources.kafka import KafkaSource
    from consumer.testing import strategies

__all__ = [
    "ConfigError",
    "ConsumerError",
    "DeadLetterFile",
    "DecodeError",
    "DeltaSink",
    "FileSource",
    "JsonLinesSink",
    "KafkaSource",
    "MessageDecoder",
    "MessageEncoder",
    "ParquetSink",
    "Pipeline",
    "PipelineStats",
    "RunConfig",
    "SinkError",
    "SourceError",
    "TableCodec",
    "ValuePolicy",
    "__version__",
    "load_config",
    "read_changelog",
    "read_mirror",
    "run",
    "strategies",
]

_HOMES = {  # public name -> the module defining it
    "MessageDecoder": "consumer.protocol.simple.decoder",
    "MessageEncoder": "consumer.protocol.simple.encoder",
    "TableCodec": "consumer.protocol.table",
    "ValuePolicy": "consumer.protocol.types",
    "RunConfig": "consumer.config",
    "load_config": "consumer.config",
    "run": "consumer.app",
    "Pipeline": "consumer.pipeline",
    "PipelineStats": "consumer.pipeline",
    "KafkaSource": "consumer.sources.kafka",
    "FileSource": "consumer.sources.files",
    "DeltaSink": "consumer.sinks.delta",
    "ParquetSink": "consumer.sinks.parquet",
    "JsonLinesSink": "consumer.sinks.jsonl",
    "DeadLetterFile": "consumer.sinks.dead_letter",
    "read_changelog": "consumer.lakehouse.tables",
    "read_mirror": "consumer.lakehouse.tables",
    "ConfigError": "consumer.errors",
    "ConsumerError": "consumer.errors",
    "DecodeError": "consumer.errors",
    "SinkError": "consumer.errors",
    "SourceError": "consumer.sources.errors",
}
_MODULES = {"strategies": "consumer.testing.strategies"}  # public name -> a module


def __getattr__(name: str) -> Any:
    if name == "__version__":
        value: Any = _installed_version()
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        return exported(__name__, _HOMES, globals(), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)


def _installed_version() -> str:
    """The installed distribution's version: looked up when asked for (importlib.metadata and the lookup
    take ~15 ms, which every Spark worker and decode process would pay for nothing)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ticdc-consumer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"
