"""Fuzzing (issue 10): hostile bytes, hostile values and a seeded mutation corpus through the decoders
(`MessageDecoder`, `TableCodec.decode` / `decode_batch` / `decode_changes`, the typed rows a sink writes) and
through the whole pipeline. The only exception allowed is a `ConsumerError`, and never an
`InternalDecodeError` (the SDK meeting something it did not anticipate).

Cases in the default run: 16,000 seeded mutations + 2,000 hostile byte strings + 1,000 hypothesis-damaged
records + 1,000 hostile column values + 3 x 350 hostile records inside valid streams through `run` + 3,000
hostile TiCDC Avro and 3,000 hostile Debezium records: 27,050 (and 300 hostile schemas in
test_containment.py); besides, every Avro message of the corpus with a varint over 10 bytes, and every
Debezium record with a value or key that is no JSON object. The long runs are
`python benchmarks/fuzz.py [--protocol avro|debezium]`.
"""

from __future__ import annotations

import functools
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer import app
from consumer.config import load_config
from consumer.errors import ConsumerError, MalformedMessageError
from consumer.protocol.debezium.decoder import DebeziumDecoder
from consumer.protocol.model import DML, DMLType, RawDML
from consumer.protocol.simple import avro_messages
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord
from consumer.testing.fuzz import FUZZ_LIMITS, Corpus, FuzzHarness, FuzzReport
from consumer.testing.hostile import (
    OVERLONG_VARINT,
    Mutator,
    hostile_bytes,
    hostile_json_values,
    hostile_records,
    mutations,
)
from consumer.testing.protocol_fuzz import (
    FOREIGN_PROTOCOLS,
    ForeignProtocol,
    ProtocolCorpus,
    ProtocolFuzzHarness,
    RecordMutator,
    record_mutations,
)
from consumer.testing.registry import LocalSchemaRegistry

MUTATION_CASES = 16_000
PROTOCOL_CASES = 3_000
PIPELINE_HOSTILE_RECORDS = 350
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _fuzz_settings(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, suppress_health_check=_SLOW_OK)


@functools.cache
def corpus() -> Corpus:
    return Corpus.simulated()


@functools.cache
def harness() -> FuzzHarness:
    return FuzzHarness(corpus())


def _assert_contained(report: FuzzReport) -> None:
    if report.failures:
        value, trace = report.failures[0]
        pytest.fail(
            f"{len(report.failures)} case(s) raised outside ConsumerError; first {value[:200]!r}:\n{trace}"
        )
    assert report.decoded + sum(report.consumer_errors.values()) == report.cases


def test_seeded_mutations_of_a_valid_corpus_end_decoded_or_as_consumer_errors() -> None:
    report = FuzzHarness(corpus()).run_all(mutations(corpus().values, seed=20_261_124, count=MUTATION_CASES))
    _assert_contained(report)
    assert report.cases == MUTATION_CASES
    # The mutations reach every kind of refusal, not just the first parser's.
    assert {
        "malformed-message",
        "value-decode",
        "compression-invalid",
        "compression-bomb",
        "nesting-too-deep",
        "commit-ts-implausible",
        "schema-rejected",
    } <= set(report.consumer_errors)
    assert report.decoded > 0.02 * report.cases  # and a share still decodes: damage that stays valid


def test_polls_of_mutated_avro_records_decode_at_once_as_each_alone() -> None:
    """`decode_records` reads a poll's Avro DML headers at once: seeded mutations of the corpus's plain Avro
    values, in polls, each get exactly what `decode` gives that value alone (message, or error and reason)."""
    avro = [value for value in corpus().values if value[:1] == b"\x16"]
    cases = list(mutations(avro, seed=20_261_125, count=4_000))
    decoder = MessageDecoder()
    read_at_once = 0
    for start in range(0, len(cases), 400):
        poll: list[bytes | None] = [avro[0], *cases[start : start + 400]]  # an Avro first: read at once
        read_at_once += sum(known is not None for known in avro_messages.known_headers(poll, decoder._checks))
        got = decoder.decode_records([SourceRecord("t", 0, n, value=value) for n, value in enumerate(poll)])
        assert [_outcome(message) for message in got] == [_alone(decoder, value) for value in poll]
    assert read_at_once > 1_000  # the mutations that leave a header alone are read by the columnar path


def _alone(decoder: MessageDecoder, value: bytes | None) -> object:
    try:
        return _outcome(decoder.decode(value))
    except ConsumerError as exc:
        return _outcome(exc)


def _outcome(message: object) -> object:
    if isinstance(message, ConsumerError):  # a commitTs refusal names the clock's TSO, which moves
        return type(message), re.sub(r"TSO \d+", "TSO", str(message))
    return message


@_fuzz_settings(2_000)
@given(hostile_bytes())
def test_hostile_bytes(value: bytes) -> None:
    before = len(harness().report.failures)
    harness().run(value)
    assert len(harness().report.failures) == before, harness().report.failures[-1][1]


@_fuzz_settings(1_000)
@given(st.data())
def test_hypothesis_damaged_records(data: st.DataObject) -> None:
    value = data.draw(hostile_records(corpus().values))
    before = len(harness().report.failures)
    harness().run(value)
    assert len(harness().report.failures) == before, harness().report.failures[-1][1]


@_fuzz_settings(1_000)
@given(st.data(), hostile_json_values())
def test_hostile_values_in_every_column_type(data: st.DataObject, hostile: object) -> None:
    """A valid JSON DML with one column's value replaced by a value of the wrong type, size or depth."""
    table = data.draw(st.sampled_from(sorted(corpus().rows)))
    raw = data.draw(st.sampled_from([r for r in corpus().rows[table] if r.encoding == "json"]))
    document = json.loads(raw.payload)
    image = document.get("data") or document.get("old")
    image[data.draw(st.sampled_from(sorted(image)))] = hostile
    before = len(harness().report.failures)
    harness().run(json.dumps(document).encode())
    assert len(harness().report.failures) == before, harness().report.failures[-1][1]


@pytest.mark.parametrize(
    "varint", [OVERLONG_VARINT, b"\x82" + b"\x80" * 9 + b"\x00"], ids=["issue", "padded"]
)
def test_avro_values_with_a_varint_over_10_bytes_never_decode(varint: bytes) -> None:
    """Known bug of issue 26: every Avro message of the corpus (watermarks, schemas, DMLs) with its
    `version`, always its first field at byte 3, written as 12 bytes or padded to 11 (the value 1 still, to
    a reader of any length) is refused as malformed, not read."""
    avro = [value for value in corpus().values if value[:1] == b"\x16"]
    assert {value[3] for value in avro} == {0x02}  # version 1
    decoder = MessageDecoder()
    for value in avro:
        with pytest.raises(MalformedMessageError, match="varint at byte 3 is longer than 10 bytes"):
            decoder.decode(value[:3] + varint + value[4:])


def test_debezium_values_and_keys_that_are_no_json_are_malformed_never_a_guessed_compression() -> None:
    """Known bug of issue 26: under compression `auto` such bytes were taken for snappy blocks."""
    corpus = ProtocolCorpus.simulated("debezium")
    mutator = RecordMutator(corpus, seed=26)
    decoder = DebeziumDecoder()
    codes = Counter[str]()
    for pair in corpus.pairs:
        try:
            decoder.decode_record(*mutator.not_json(*pair))  # type: ignore[arg-type]
            codes["decoded"] += 1  # a DDL or WATERMARK whose key was damaged: their keys are not read
        except ConsumerError as exc:
            codes[exc.code] += 1
    assert set(codes) <= {"malformed-message", "decoded"} and codes["malformed-message"] > 0.9 * len(
        corpus.pairs
    ), codes


# The refusals each protocol's mutations must reach: proof they get past the first parser.
_PROTOCOL_REFUSALS: dict[str, set[str]] = {
    "avro": {
        "malformed-message",
        "value-decode",
        "schema-id-unknown",
        "commit-ts-implausible",
        "schema-rejected",
    },
    "debezium": {
        "malformed-message",
        "value-decode",
        "compression-invalid",
        "compression-bomb",
        "unsupported-type",
        "schema-rejected",
        "commit-ts-implausible",
    },
}


@pytest.mark.parametrize("protocol", FOREIGN_PROTOCOLS)
def test_seeded_mutations_of_avro_and_debezium_records_end_decoded_or_as_consumer_errors(
    protocol: ForeignProtocol, schema_registry: LocalSchemaRegistry
) -> None:
    """Hostile keys and values (Avro datums framed with hostile writer schemas from the registry, Debezium
    Connect schemas and DDL structures edited) through `decode_record` and the row decode, which for Avro
    is polars-avro's native reader."""
    corpus = ProtocolCorpus.simulated(protocol, schema_registry.url)
    assert corpus.hostile_ids or protocol == "debezium"
    report = ProtocolFuzzHarness(corpus).run_all(
        record_mutations(corpus, seed=20_261_124, count=PROTOCOL_CASES)
    )
    _assert_contained(report)
    assert report.cases == PROTOCOL_CASES
    assert _PROTOCOL_REFUSALS[protocol] <= set(report.consumer_errors)
    assert report.decoded > 0.02 * report.cases


# -- the whole pipeline ---------------------------------------------------------------------------------
def _images(message: DML) -> int:
    return 2 if message.type is DMLType.UPDATE else 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hostile_records_inside_a_valid_stream_never_stop_the_pipeline(tmp_path: Path, seed: int) -> None:
    """Each hostile record goes in after the record it was made from (so a damaged copy of a schema never
    comes first): `run` ends, every original row lands exactly once, and no original is dead-lettered."""
    encoder = MessageEncoder("json" if seed % 2 else "avro")
    workload = Workload(WorkloadConfig(rows=150, tables=2, partitions=1, seed=seed, bootstrap_every_rows=50))
    originals = [(encoder.encode(r.message, r.schema), r.message) for r in workload.records()]
    rng = random.Random(seed)
    mutator = Mutator(seed, bomb_bytes=FUZZ_LIMITS.max_decompressed_bytes + 1)
    after: dict[int, list[bytes]] = {}
    for _ in range(PIPELINE_HOSTILE_RECORDS):
        source = rng.randrange(len(originals))
        after.setdefault(rng.randrange(source, len(originals)), []).append(
            mutator.mutate(originals[source][0])
        )
    records, expected, hostile = [], Counter[int](), set()
    for index, (value, message) in enumerate(originals):
        for item, is_original in [(value, True), *((h, False) for h in after.get(index, []))]:
            offset = len(records)
            records.append(SourceRecord("fuzz", 0, offset, None, None, item))
            if not is_original:
                hostile.add(offset)
            elif isinstance(message, DML):
                expected[offset] = _images(message)
    capture = tmp_path / "capture.jsonl"
    with capture.open("wb") as file:
        write_capture(records, file)
    out = tmp_path / "out"
    config = load_config(
        environ={},
        overrides={
            "source": {"url": f"file:{capture}"},
            "sink": {"url": f"jsonl:{out}"},
            "budget": {"pending_timeout_s": 0.2},  # held hostile rows expire quickly
            "parallelism": {"decode_workers": 0},
            "decode": {"max_decompressed_bytes": FUZZ_LIMITS.max_decompressed_bytes},
        },
    )
    stats = app.run(config, until_idle=1.0)

    assert stats.records == len(records)
    landed = Counter(
        row["_offset"]
        for path in out.glob("*/*.jsonl")
        for row in map(json.loads, path.read_bytes().splitlines())
    )
    assert {offset: landed[offset] for offset in expected} == dict(expected)
    dead = [json.loads(line) for line in (out / "_dead_letters.jsonl").read_bytes().splitlines()]
    assert {letter["offset"] for letter in dead} <= hostile
    assert all(letter["reason_code"] for letter in dead)
    assert stats.dead_letters == len(dead) > PIPELINE_HOSTILE_RECORDS // 2


def test_every_stage_met_a_dml() -> None:
    """The corpus holds DMLs of both encodings for every table, so row stages always run."""
    for rows in corpus().rows.values():
        assert {raw.encoding for raw in rows} == {"json", "avro"}
        assert all(isinstance(raw, RawDML) for raw in rows)
