"""Fuzzing TiCDC's Avro (Confluent) and Debezium protocols: hostile Kafka records (key and value) through
the protocol's `decode_record` and the row decode, as `consumer.testing.fuzz` does for the Simple protocol.

A corpus is a simulated stream encoded with several of the protocol's options. For Avro its writer schemas
live in a schema registry (the `LocalSchemaRegistry` fixture, reached through confluent-kafka's client),
together with hostile variants of them (`hostile_writer_schemas`: wrong Avro types, unknown `tidb_type`s,
decimals and BITs beyond TiDB's limits, arrays, maps, fixed, recursion...) that a mutation may frame a datum
with. `RecordMutator` damages a record's value or key: every `Mutator` operator, plus re-framing an Avro
datum with another schema id, edits of a Debezium record's Connect schema or DDL `tableChanges`, and a
Debezium value or key that is no JSON object (`not_json`).

`ProtocolFuzzHarness` runs each case as a consumer does: `decode_record`; for a row, a `TableCodec` of the
version the record described decoding it alone (`decode`), in a batch with valid rows of that version
(`decode_batch`), or into the typed rows a sink writes (`table_changes`); for a DDL, a `TableCodec` of each
schema it carries decoding valid rows of its table. Outcomes are counted in a `FuzzReport`.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from consumer.protocol.base import DecoderSettings, RecordDecoder
from consumer.protocol.compression import compress
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import DDL, RawDML, TableSchema
from consumer.protocol.protocols import record_decoder
from consumer.protocol.table import TableCodec
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.protocol.types import ValuePolicy
from consumer.simulate.output import AvroStream, DebeziumStream, KafkaPair, encoded
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.testing.fuzz import CORPUS_MS, FUZZ_LIMITS, FuzzReport, FuzzStages
from consumer.testing.hostile import INVALID_UTF8, Mutator

ForeignProtocol = Literal["avro", "debezium"]
FOREIGN_PROTOCOLS: tuple[ForeignProtocol, ...] = ("avro", "debezium")
TOPIC = "fuzz"
AVRO_OPTIONS = (
    AvroOptions(),
    AvroOptions(tidb_extension=True, checksum=True, decimal="string", bigint_unsigned="string"),
    AvroOptions(tidb_extension=True, include_before=True, bit_bytes="minimal"),
    AvroOptions(tidb_extension=True, watermark=True),
)
DEBEZIUM_OPTIONS = (
    DebeziumOptions(),
    DebeziumOptions(tidb_extension=True),
    DebeziumOptions(tidb_extension=True, disable_schema=True),
    DebeziumOptions(disable_schema=True, output_old_value=False),
    DebeziumOptions(tidb_extension=True, compression="lz4"),
)


@dataclass(frozen=True)
class ProtocolCorpus:
    """Valid records of one protocol; for Avro, the registry holding their writer schemas and the ids of
    hostile variants of them (`hostile_ids`) that a mutation may frame a datum with."""

    protocol: ForeignProtocol
    pairs: list[KafkaPair]
    registry_url: str = ""
    schema_ids: tuple[int, ...] = ()  # valid writer schemas
    hostile_ids: tuple[int, ...] = ()

    @classmethod
    def simulated(
        cls, protocol: ForeignProtocol, registry_url: str = "", rows: int = 60, seed: int = 0
    ) -> ProtocolCorpus:
        """`rows` DMLs per set of options (two tables, every column type, DDLs); Avro needs `registry_url`."""
        config = WorkloadConfig(
            rows=rows, tables=2, partitions=1, seed=seed, bootstrap_every_rows=40, start_physical_ms=CORPUS_MS
        )
        pairs: list[KafkaPair] = []
        if protocol == "debezium":
            for debezium in DEBEZIUM_OPTIONS:
                stream = DebeziumStream(DebeziumEncoder(debezium))
                pairs += [pair for _, pair in encoded(Workload(config), stream)]
            return cls(protocol, pairs)
        registry = SchemaRegistry(registry_url)
        for avro in AVRO_OPTIONS:
            avro_stream = AvroStream(ConfluentAvroEncoder(registry, avro), TOPIC)
            pairs += [pair for _, pair in encoded(Workload(config), avro_stream)]
        valid = sorted(
            {int.from_bytes(part[1:5], "big") for pair in pairs for part in pair if part and _framed(part)}
        )
        rng = random.Random(seed)
        hostile = [
            registry.register(f"hostile-{schema_id}-{number}-value", variant)
            for schema_id in valid
            for number, variant in enumerate(hostile_writer_schemas(registry.schema(schema_id), rng))
        ]
        return cls(protocol, pairs, registry_url, tuple(valid), tuple(sorted(set(hostile))))


def _framed(part: bytes | None) -> bool:
    return part is not None and len(part) >= 5 and part[0] == 0


# -- hostile writer schemas -----------------------------------------------------------------------------
_AVRO_TYPES: tuple[Any, ...] = (
    "int",
    "long",
    "float",
    "double",
    "string",
    "bytes",
    "boolean",
    "null",
    {"type": "array", "items": "long"},
    {"type": "map", "values": "string"},
    {"type": "enum", "name": "E", "symbols": ["a", "b"]},
    {"type": "fixed", "name": "F", "size": 3},
    {"type": "record", "name": "Nested", "fields": [{"name": "x", "type": "long"}]},
    {"type": "bytes", "logicalType": "decimal", "precision": 39, "scale": 2},
    {"type": "bytes", "logicalType": "decimal", "precision": 0, "scale": 0},
    {"type": "bytes", "logicalType": "decimal", "precision": 10, "scale": 12},
    {"type": "bytes", "logicalType": "decimal", "precision": 100, "scale": 30},
    {"type": "int", "logicalType": "date"},
    {"type": "long", "logicalType": "timestamp-micros"},
    {"type": "string", "logicalType": "uuid"},
)
_TIDB_TYPES = (
    "INT", "INT UNSIGNED", "BIGINT", "BIGINT UNSIGNED", "FLOAT", "DOUBLE", "TEXT", "BLOB", "DATE", "DATETIME",
    "TIMESTAMP", "TIME", "YEAR", "JSON", "TiDBVECTORFloat32", "DECIMAL", "BIT", "ENUM", "SET", "GEOMETRY", "",
)  # fmt: skip
_PARAMETERS: tuple[dict[str, Any], ...] = (
    {"length": "0"},
    {"length": "-3"},
    {"length": "65"},
    {"length": "99999999999999999999"},
    {"length": "x"},
    {"allowed": ""},
    {"allowed": ",,"},
    {"allowed": "a\\"},
    {"allowed": ",".join(map(str, range(70)))},
    {},
)


def hostile_writer_schemas(writer: Any, rng: random.Random, count: int = 12) -> list[Any]:
    """Variants of a TiCDC writer schema that no TiCDC writes: each changes one column field's Avro type,
    `tidb_type` or parameters, or the record's shape (extension fields' types, duplicate or missing fields,
    recursion, a non-record `_ticdc_before`)."""
    out = []
    for _ in range(count):
        variant = copy.deepcopy(writer)
        fields = variant.get("fields") or []
        if not fields:
            continue
        field = rng.choice(fields)
        edit = rng.randrange(8)
        branches = field["type"] if isinstance(field["type"], list) else [field["type"]]
        typed = [b for b in branches if b != "null"]
        wire = typed[0] if typed and isinstance(typed[0], dict) else None
        if edit == 0 and wire is not None:
            replacement = copy.deepcopy(rng.choice(_AVRO_TYPES))
            if isinstance(replacement, dict):
                wire.clear()
                wire.update(replacement)
            else:
                wire["type"] = replacement
            wire.setdefault("connect.parameters", {"tidb_type": rng.choice(_TIDB_TYPES)})
        elif edit == 1 and wire is not None:
            wire["connect.parameters"] = {"tidb_type": rng.choice(_TIDB_TYPES), **rng.choice(_PARAMETERS)}
        elif edit == 2:
            field["type"] = rng.choice(
                (["null", "long", "string"], ["long", "null"], [], "long", ["null"], [wire, wire])
            )
        elif edit == 3:
            fields.append(copy.deepcopy(field))  # a duplicate name
        elif edit == 4:
            fields.remove(field)  # a datum longer than its schema
        elif edit == 5:
            field["type"] = variant["name"]  # the record itself: recursion
        elif edit == 6:
            field["name"] = rng.choice(("", "1a", "a-b", "_tidb_op", "_ticdc_before", "x" * 300))
        else:
            extension = [f for f in fields if str(f.get("name", "")).startswith(("_tidb", "_ticdc"))]
            target = rng.choice(extension) if extension else field
            target["type"] = rng.choice(("int", "string", "long", "boolean", ["null", "long"], "bytes"))
        out.append(variant)
    return out


# -- mutations ------------------------------------------------------------------------------------------
_CONNECT_TYPES = (
    "int8", "int16", "int32", "int64", "float", "double", "boolean", "string", "bytes", "struct",
)  # fmt: skip
_SEMANTICS = (
    "io.debezium.time.Date", "io.debezium.time.Timestamp", "io.debezium.time.MicroTimestamp",
    "io.debezium.time.ZonedTimestamp", "io.debezium.time.MicroTime", "io.debezium.time.Year",
    "io.debezium.data.Json", "io.debezium.data.TiDBVectorFloat32", "io.debezium.data.Bits",
    "io.debezium.data.Enum", "io.debezium.data.EnumSet", "io.debezium.data.Unknown", "",
)  # fmt: skip
_DEBEZIUM_TIDB_TYPES = (
    "int", "bigint unsigned", "decimal", "text", "blob", "varbinary", "geometry", "float unsigned", "",
    "x y z",
)  # fmt: skip
_DDL_TYPES = ("INT", "BIGINT UNSIGNED", "ENUM", "SET", "BIT", "DECIMAL", "DATETIME", "GEOMETRY", "", "VECTOR")


class RecordMutator:
    """Damages (key, value) records of a `ProtocolCorpus`, deterministically from `seed`."""

    def __init__(self, corpus: ProtocolCorpus, seed: int, *, max_bytes: int = 1 << 18) -> None:
        self.corpus = corpus
        self.bytes = Mutator(seed, max_bytes=max_bytes, bomb_bytes=FUZZ_LIMITS.max_decompressed_bytes + 1)
        self.random = self.bytes.random

    def mutate(self, pair: KafkaPair) -> KafkaPair:
        key, value = pair
        choice = self.random.random()
        if choice < 0.03:
            return (None, value) if self.random.random() < 0.5 else (key, None)
        if choice < 0.15 and key:
            return self.bytes.mutate(key), value
        if value is None:
            return (self.bytes.mutate(key) if key else None), self.random.randbytes(9)
        if self.corpus.protocol == "avro" and _framed(value) and choice < 0.35:
            value = self.reframe(value)
            return key, self.bytes.mutate(value) if self.random.random() < 0.3 else value
        if self.corpus.protocol == "debezium" and choice < 0.35:
            return key, self.debezium_schema(value)
        if self.corpus.protocol == "debezium" and choice < 0.45:
            return self.not_json(key, value)
        return key, self.bytes.mutate(value)

    def not_json(self, key: bytes | None, value: bytes) -> KafkaPair:
        """The value, or the key, as bytes that are no JSON object: invalid UTF-8, a top-level array or
        string, a snappy block (which a decoder's `auto` does not guess), random bytes."""
        on_key = bool(key) and self.random.random() < 0.3
        target = key if on_key and key else value
        how = self.random.randrange(5)
        if how == 0:
            damaged = self.random.choice(INVALID_UTF8[:5]) + target
        elif how == 1:
            damaged = b"[" + target + b"]"
        elif how == 2:
            damaged = json.dumps(target.decode("utf-8", "replace")).encode()
        elif how == 3:
            damaged = compress(target, "snappy")
        else:
            damaged = self.random.randbytes(self.random.randint(1, 64))
        return (damaged, value) if on_key else (key, damaged)

    def reframe(self, value: bytes) -> bytes:
        """The datum framed with another writer schema's id: mostly a hostile variant, sometimes another
        table's or option's schema, sometimes an id the registry does not have."""
        pick = self.random.random()
        if pick < 0.7 and self.corpus.hostile_ids:
            schema_id = self.random.choice(self.corpus.hostile_ids)
        elif pick < 0.95 and self.corpus.schema_ids:
            schema_id = self.random.choice(self.corpus.schema_ids)
        else:
            schema_id = self.random.choice((0, 2**31 - 1, 2**32 - 1, 10_000))
        return value[:1] + schema_id.to_bytes(4, "big") + value[5:]

    def debezium_schema(self, value: bytes) -> bytes:
        """An edit of a column's Connect schema (type, semantic name, parameters, tidb_type, optional,
        name) or of a DDL's `tableChanges` column (typeName, length, enumValues)."""
        try:
            document = json.loads(value)
        except (ValueError, RecursionError):
            return self.bytes.mutate(value)
        columns = _connect_columns(document) + _ddl_columns(document)
        if not columns:
            return self.bytes.mutate(value)
        column = self.random.choice(columns)
        if "typeName" in column or "jdbcType" in column:
            self._ddl_edit(column)
        else:
            self._connect_edit(column)
        return json.dumps(document, separators=(",", ":")).encode()

    def _connect_edit(self, column: dict[str, Any]) -> None:
        edit = self.random.randrange(7)
        if edit == 0:
            column["type"] = self.random.choice(_CONNECT_TYPES)
        elif edit == 1:
            column["name"] = self.random.choice(_SEMANTICS)
        elif edit == 2:
            column["parameters"] = dict(self.random.choice(_PARAMETERS))
        elif edit == 3:
            column["tidb_type"] = self.random.choice(_DEBEZIUM_TIDB_TYPES)
        elif edit == 4:
            column["optional"] = not column.get("optional")
        elif edit == 5:
            column["field"] = self.random.choice(("", "\\", "a.b", "before", "x" * 300, None, 5))
        else:
            column.pop(self.random.choice(("type", "field", "name", "parameters")), None)

    def _ddl_edit(self, column: dict[str, Any]) -> None:
        edit = self.random.randrange(5)
        if edit == 0:
            column["typeName"] = self.random.choice(_DDL_TYPES)
        elif edit == 1:
            column["length"] = self.random.choice((-1, 0, 66, 2**31, 2**64, "x", None))
        elif edit == 2:
            column["enumValues"] = self.random.choice(
                (["'a'", "'a'"], [], ["a"], [5], None, ["'" + "x" * 70], ["'a\\'", "'b'"])
            )
        elif edit == 3:
            column["name"] = self.random.choice(("", "\\", "id", None, "x" * 300))
        else:
            column["scale"] = self.random.choice((-1, 31, 2**40))


def _connect_columns(document: Any) -> list[dict[str, Any]]:
    schema = document.get("schema") if isinstance(document, dict) else None
    fields = schema.get("fields") if isinstance(schema, dict) else None
    out: list[dict[str, Any]] = []
    for image in fields if isinstance(fields, list) else ():
        if isinstance(image, dict) and image.get("field") in ("before", "after"):
            out += [c for c in image.get("fields") or () if isinstance(c, dict)]
    return out


def _ddl_columns(document: Any) -> list[dict[str, Any]]:
    payload = document.get("payload") if isinstance(document, dict) else None
    changes = payload.get("tableChanges") if isinstance(payload, dict) else None
    out: list[dict[str, Any]] = []
    for change in changes if isinstance(changes, list) else ():
        table = change.get("table") if isinstance(change, dict) else None
        if isinstance(table, dict):
            out += [c for c in table.get("columns") or () if isinstance(c, dict)]
    return out


def record_mutations(corpus: ProtocolCorpus, seed: int, count: int) -> Iterator[KafkaPair]:
    """`count` hostile records made from the corpus, deterministically from `seed`."""
    mutator = RecordMutator(corpus, seed)
    for _ in range(count):
        yield mutator.mutate(mutator.random.choice(corpus.pairs))


# -- the harness ----------------------------------------------------------------------------------------
class ProtocolFuzzHarness(FuzzStages):
    """Runs hostile records of a `ProtocolCorpus` through its protocol's decoder; see the module docstring."""

    def __init__(self, corpus: ProtocolCorpus, policy: ValuePolicy | None = None) -> None:
        super().__init__(policy)
        self.corpus = corpus
        settings = DecoderSettings(
            protocol=corpus.protocol, registry_url=corpus.registry_url, policy=self.policy
        )
        self.decoder: RecordDecoder = record_decoder(settings)
        self.protocol = self.decoder.protocol
        self.rows: dict[tuple[str, str, int], list[RawDML]] = {}
        self.table_rows: dict[tuple[str, str], list[RawDML]] = {}
        self._codecs: dict[tuple[str, str, int], TableCodec] = {}
        for key, value in corpus.pairs:
            message = self.decoder.decode_record(key, value)
            if isinstance(message, RawDML):
                self.rows.setdefault(message.schema_key, []).append(message)
                self.table_rows.setdefault((message.database, message.table), []).append(message)
        for schema_key in self.rows:
            schema = self.decoder.described_schema(schema_key)
            assert schema is not None
            self._codecs[schema_key] = TableCodec(schema, self.policy, protocol=self.protocol)

    def run_all(self, pairs: Iterable[KafkaPair]) -> FuzzReport:
        for pair in pairs:
            self.run(pair)
        return self.report

    def run(self, pair: KafkaPair) -> None:
        """One case; its outcome goes to `self.report` (a failure keeps the value, or the key when the
        value is absent)."""
        key, value = pair
        self.run_case(value if value is not None else key or b"", lambda outcome: self._case(outcome, pair))

    def _case(self, outcome: list[str], pair: KafkaPair) -> None:
        message = self.stage(outcome, self.decoder.decode_record, *pair)
        if isinstance(message, RawDML):
            self._row(outcome, message)
        elif isinstance(message, DDL):
            for schema in (message.table_schema, message.pre_table_schema):
                if schema is not None:
                    self._schema(outcome, schema)

    def _row(self, outcome: list[str], raw: RawDML) -> None:
        codec = self._codecs.get(raw.schema_key)
        if codec is None:
            schema = self.decoder.described_schema(raw.schema_key)
            if schema is None:
                return
            codec = self.stage(outcome, self._codec, schema)
            if codec is None:
                return
        good = self.rows.get(raw.schema_key, [])
        self.rows_stage(outcome, codec, raw, [*good[:1], raw, *good[-1:]])

    def _codec(self, schema: TableSchema) -> TableCodec:
        return TableCodec(schema, self.policy, protocol=self.protocol)

    def _schema(self, outcome: list[str], schema: TableSchema) -> None:
        codec = self.stage(outcome, self._codec, schema)
        if codec is not None and self.corpus.protocol == "debezium":  # Debezium rows decode by column name
            rows = self.table_rows.get((schema.database, schema.table), [])
            self.stage(outcome, self.changes, codec, rows[:2])


def protocol_fuzz(
    protocol: ForeignProtocol, registry_url: str, seed: int, count: int, *, corpus_seed: int = 0
) -> FuzzReport:
    """`count` seeded hostile records of `protocol` through a fresh harness (Avro needs `registry_url`)."""
    corpus = ProtocolCorpus.simulated(protocol, registry_url, seed=corpus_seed)
    return ProtocolFuzzHarness(corpus).run_all(record_mutations(corpus, seed, count))
