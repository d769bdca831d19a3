"""A fuzz harness: hostile record values through every decoding stage, counting how each case ended.

A case passes when each stage either succeeds or raises a `ConsumerError` other than
`InternalDecodeError` (which means the SDK met something it did not anticipate). Anything else is a
failure, kept with its value and traceback so it can be replayed. The stages are the ones a consumer runs:
`MessageDecoder.decode`; for a DML, `TableCodec.decode`, `decode_batch` or `decode_changes` with the typed
rows a sink writes (in turn, case by case: the Arrow work of a wide table dominates a case's cost), in a batch
with valid rows of both encodings; for a schema message, a `TableCodec` of each schema decoding the corpus's
rows of that table.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from consumer.batches.changes import table_changes, typed_rows
from consumer.errors import ConsumerError, InternalDecodeError, RecordLocation
from consumer.protocol.limits import DecodeLimits
from consumer.protocol.model import DDL, Bootstrap, RawDML, TableSchema
from consumer.protocol.plain import value_object
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.simulate.workload import Workload, WorkloadConfig

SchemaKey = tuple[str, str, int]
# Small limits: a bomb or a huge value is refused after 1 MiB, not 64, so cases stay fast.
FUZZ_LIMITS = DecodeLimits(max_decompressed_bytes=1 << 20, max_value_bytes=1 << 16)
_LOCATION = RecordLocation("fuzz", 0, 0)
CORPUS_MS = 1_767_225_600_000  # the corpus's TSO clock starts at 2026-01-01: one seed, one corpus


@dataclass(frozen=True)
class Corpus:
    """Valid record values of a simulated stream (every message kind and column type, JSON and Avro, plain
    and compressed), with the schemas and decoded rows they imply."""

    values: list[bytes]
    schemas: dict[SchemaKey, TableSchema]
    rows: dict[tuple[str, str], list[RawDML]]  # per table, valid DMLs of both encodings

    @classmethod
    def simulated(cls, rows: int = 120, seed: int = 0) -> Corpus:
        workload = Workload(
            WorkloadConfig(
                rows=rows,
                tables=2,
                partitions=1,
                seed=seed,
                bootstrap_every_rows=40,
                start_physical_ms=CORPUS_MS,
            )
        )
        plain = [MessageEncoder("json"), MessageEncoder("avro")]
        compressed = [MessageEncoder("json", "lz4"), MessageEncoder("avro", "snappy")]
        values: list[bytes] = []
        schemas: dict[SchemaKey, TableSchema] = {}
        table_rows: dict[tuple[str, str], list[RawDML]] = {}
        decoder = MessageDecoder()
        # Encoded as they come (the simulator updates row dicts later); one record in four compressed too:
        # damage to compressed bytes mostly ends in the decompressor, so most of the corpus is plain.
        for number, record in enumerate(workload.records()):
            for encoder in plain + (compressed if number % 4 == 0 else []):
                value = encoder.encode(record.message, record.schema)
                values.append(value)
                message = decoder.decode(value)
                if isinstance(message, RawDML):
                    table_rows.setdefault((message.database, message.table), []).append(message)
                for schema in _schemas_of(message):
                    schemas[schema.key] = schema
        return cls(values, schemas, table_rows)


@dataclass
class FuzzReport:
    cases: int = 0
    decoded: int = 0  # every stage succeeded
    consumer_errors: Counter[str] = field(default_factory=Counter)  # by reason code, first stage to raise
    failures: list[tuple[bytes, str]] = field(default_factory=list)  # value, traceback

    def merge(self, other: FuzzReport) -> None:
        self.cases += other.cases
        self.decoded += other.decoded
        self.consumer_errors.update(other.consumer_errors)
        self.failures += other.failures


class FuzzStages:
    """What every protocol's harness shares: running a case's stages and counting how it ended."""

    def __init__(self, policy: ValuePolicy | None = None) -> None:
        self.policy = policy or ValuePolicy(limits=FUZZ_LIMITS)
        self.report = FuzzReport()

    def run_case(self, value: bytes, case: Callable[[list[str]], None]) -> None:
        """One case (`case` runs its stages); `value` is what a failure keeps to replay it."""
        self.report.cases += 1
        outcome: list[str] = []
        try:
            case(outcome)
        except _Failed as failed:
            self.report.failures.append((value, failed.trace))
            return
        if outcome:
            self.report.consumer_errors[outcome[0]] += 1
        else:
            self.report.decoded += 1

    def stage(self, outcome: list[str], stage: Callable[..., Any], *args: Any) -> Any:
        """`stage(*args)`, or None after a `ConsumerError` (its code noted); anything else fails the case."""
        try:
            return stage(*args)
        except InternalDecodeError as exc:
            raise _Failed(exc) from exc
        except ConsumerError as exc:
            outcome.append(exc.code)
            return None
        except Exception as exc:
            raise _Failed(exc) from exc

    def rows_stage(self, outcome: list[str], codec: TableCodec, raw: RawDML, batch: list[RawDML]) -> None:
        """The row alone, or `batch` (valid rows around it) decoded or turned into the rows a sink writes:
        in turn, case by case (the Arrow work of a wide table dominates a case's cost)."""
        turn = self.report.cases % 3
        if turn == 0:
            self.stage(outcome, codec.decode, raw)
        elif turn == 1:
            self.stage(outcome, codec.decode_batch, batch)
        else:
            self.stage(outcome, self.changes, codec, batch)

    @staticmethod
    def changes(codec: TableCodec, raws: list[RawDML]) -> None:
        """The typed rows a sink writes, each value rendered as the JSONL sink renders it."""
        changes = table_changes(codec, [(raw, _LOCATION) for raw in raws])
        for row in typed_rows(changes, codec):
            for value in row.values():
                value_object(value)


class FuzzHarness(FuzzStages):
    """Runs Simple-protocol values through the decoding stages against a `Corpus`; see the module
    docstring."""

    def __init__(self, corpus: Corpus, policy: ValuePolicy | None = None) -> None:
        super().__init__(policy)
        self.corpus = corpus
        self.decoder = MessageDecoder(policy=self.policy)
        self._codecs = {key: TableCodec(schema, self.policy) for key, schema in corpus.schemas.items()}
        self._latest: dict[tuple[str, str], TableCodec] = {}
        for key, codec in sorted(self._codecs.items(), key=lambda item: item[0][2]):
            self._latest[key[:2]] = codec

    def run_all(self, values: Iterable[bytes]) -> FuzzReport:
        for value in values:
            self.run(value)
        return self.report

    def run(self, value: bytes) -> None:
        """One case; its outcome goes to `self.report`."""
        self.run_case(value, lambda outcome: self._case(outcome, value))

    def _case(self, outcome: list[str], value: bytes) -> None:
        message = self.stage(outcome, self.decoder.decode, value)
        if isinstance(message, RawDML):
            self._rows(outcome, message)
        elif isinstance(message, Bootstrap | DDL):
            for schema in _schemas_of(message):
                self._schema(outcome, schema)

    def _rows(self, outcome: list[str], raw: RawDML) -> None:
        codec = self._codecs.get(raw.schema_key) or self._latest.get((raw.database, raw.table))
        if codec is None:
            return  # a table the corpus never described: a consumer holds it, decodes nothing
        good = self.corpus.rows.get((raw.database, raw.table), [])
        self.rows_stage(outcome, codec, raw, [*good[:1], raw, *good[-1:]])  # both encodings around it

    def _schema(self, outcome: list[str], schema: TableSchema) -> None:
        codec = self.stage(outcome, TableCodec, schema, self.policy)
        if codec is not None:
            rows = self.corpus.rows.get((schema.database, schema.table), [])
            self.stage(outcome, self.changes, codec, rows[:2])


class _Failed(Exception):
    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.trace = "".join(traceback.format_exception(cause))


def _schemas_of(message: Any) -> list[TableSchema]:
    if isinstance(message, Bootstrap):
        return [message.table_schema]
    if isinstance(message, DDL):
        return [schema for schema in (message.table_schema, message.pre_table_schema) if schema is not None]
    return []
