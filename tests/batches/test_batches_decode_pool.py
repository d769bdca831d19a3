"""Decoding in worker processes gives exactly what decoding in the loop gives, and never loses a batch."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import signal
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.batches.changes import TableChanges, table_changes
from consumer.batches.decode_pool import PIECE_ROWS, DecodePool
from consumer.errors import RecordLocation, SinkError
from consumer.pipeline import Pipeline
from consumer.protocol.model import (
    DML,
    Bootstrap,
    Column,
    DataType,
    DMLType,
    Index,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sinks.jsonl import JsonLinesSink
from consumer.sources.capture import read_capture, write_capture
from consumer.sources.files import FileSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.state.machine import ConsumerState
from consumer.testing import strategies

SCHEMA = TableSchema(
    database="shop",
    table="people",
    table_id=7,
    version=3,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("born", DataType("date")),
        Column("score", DataType("decimal", length=10, decimal=2)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
TS = 449512873440575500


@pytest.fixture(scope="module")
def pool() -> Iterator[DecodePool]:
    decode_pool = DecodePool(2, ValuePolicy())
    yield decode_pool
    decode_pool.close()


def _rows(schema: TableSchema, dmls: list[DML]) -> tuple[tuple[RawDML, RecordLocation], ...]:
    encoder, decoder = MessageEncoder(), MessageDecoder()
    raws = [decoder.decode(encoder.encode(dml, schema)) for dml in dmls]
    return tuple((raw, RecordLocation("t", 2, 100 + i)) for i, raw in enumerate(raws))  # type: ignore[misc]


@st.composite
def _batches(draw: st.DrawFn) -> tuple[TableSchema, list[DML]]:
    schema = draw(strategies.table_schemas())
    return schema, draw(st.lists(strategies.dml_messages(schema), min_size=1, max_size=12))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=_batches())
def test_a_worker_decodes_every_column_type_exactly_like_the_loop(
    pool: DecodePool, batch: tuple[TableSchema, list[DML]]
) -> None:
    schema, dmls = batch
    rows = _rows(schema, dmls)
    decoding = pool.submit(schema, rows)
    assert decoding is not None
    changes = pool.result(decoding, schema)
    assert changes is not None and changes.schema is schema
    expected = table_changes(TableCodec(schema), rows).changelog
    assert changes.changelog.schema == expected.schema
    assert changes.changelog.to_pylist() == expected.to_pylist()


def _dml(row_id: int) -> DML:
    return DML(
        type=DMLType.INSERT,
        database="shop",
        table="people",
        table_id=7,
        commit_ts=TS + row_id,
        build_ts=0,
        schema_version=3,
        data={"id": row_id, "born": dt.date(1999, 12, 31), "score": Decimal("0.00")},
    )


def _value(row_id: int, born: str, score: str) -> bytes:
    """A DML's record value with wire texts the encoder would refuse to write (zero dates, bad numbers)."""
    value = MessageEncoder().encode(_dml(row_id), SCHEMA)
    return value.replace(b'"1999-12-31"', f'"{born}"'.encode()).replace(b'"0.00"', f'"{score}"'.encode())


def _raw(value: bytes) -> RawDML:
    raw = MessageDecoder().decode(value)
    assert isinstance(raw, RawDML)
    return raw


def test_a_bad_value_or_a_zero_date_comes_back_for_the_loop_and_the_count(pool: DecodePool) -> None:
    zero_date = ((_raw(_value(1, "0000-00-00", "1.50")), RecordLocation("t", 0, 5)),)
    bad_score = ((_raw(_value(2, "2001-02-03", "lots")), RecordLocation("t", 0, 6)),)
    before = pool.stats.unrepresentable
    zero = pool.result(pool.submit(SCHEMA, zero_date), SCHEMA)  # type: ignore[arg-type]
    assert zero is not None and zero.changelog.column("born").to_pylist() == [None]
    assert zero.changelog.column("score").to_pylist() == [Decimal("1.50")]
    assert pool.stats.unrepresentable == before + 1
    assert pool.result(pool.submit(SCHEMA, bad_score), SCHEMA) is None  # type: ignore[arg-type]


def test_a_batch_larger_than_a_piece_comes_back_whole_and_in_order(pool: DecodePool) -> None:
    raw = _raw(_value(1, "0000-00-00", "2.50"))
    rows = tuple((raw, RecordLocation("t", 0, offset)) for offset in range(2 * PIECE_ROWS + 7))
    before = pool.stats.unrepresentable
    decoding = pool.submit(SCHEMA, rows)
    assert decoding is not None and len(decoding.pieces) == 3
    changes = pool.result(decoding, SCHEMA)
    assert changes is not None
    assert changes.changelog.column("_offset").to_pylist() == list(range(len(rows)))
    assert changes.changelog.equals(table_changes(TableCodec(SCHEMA), rows).changelog)
    assert pool.stats.unrepresentable == before + len(rows)


def test_a_worker_starts_with_pandas_imported_once_for_all() -> None:
    """pyarrow imports pandas with its first array built from Python objects: the forkserver imports it
    before the workers fork, so a fresh worker, before any batch, already holds it."""
    pytest.importorskip("pandas")
    fresh = DecodePool(1, ValuePolicy())
    try:
        imported = fresh._executor.submit(eval, "'pandas' in __import__('sys').modules").result(timeout=60)
    finally:
        fresh.close()
    assert imported


def test_a_dead_worker_costs_no_batch(caplog: pytest.LogCaptureFixture) -> None:
    doomed = DecodePool(1, ValuePolicy())
    try:
        rows = _rows(SCHEMA, [_dml(1)])
        first = doomed.submit(SCHEMA, rows)
        assert first is not None and doomed.result(first, SCHEMA) is not None
        for process in list(doomed._executor._processes.values()):  # type: ignore[union-attr]
            os.kill(process.pid, signal.SIGKILL)
        with caplog.at_level(logging.WARNING):
            late = doomed.submit(SCHEMA, rows)
            assert late is None or doomed.result(late, SCHEMA) is None
            assert doomed.submit(SCHEMA, rows) is None  # from now on the caller decodes itself
        assert "decoding in the consumer loop from now on" in caplog.text
    finally:
        doomed.close()


def _stream(path: Path) -> None:
    """One table: inserts with a zero date and a bad decimal among them, on two partitions; a WATERMARK
    on both every 40 rows."""
    encoder = MessageEncoder()
    values = []
    for partition in (0, 1):
        values.append((partition, encoder.encode(Bootstrap(table_schema=SCHEMA, build_ts=0))))
    for row_id in range(1, 401):
        born = "0000-00-00" if row_id % 50 == 0 else f"2000-01-{row_id % 28 + 1:02d}"
        score = "oops" if row_id == 123 else f"{row_id}.25"
        values.append((row_id % 2, _value(row_id, born, score)))
        if row_id % 40 == 0:
            watermark = encoder.encode(Watermark(commit_ts=TS + row_id, build_ts=0))
            values += [(0, watermark), (1, watermark)]
    for partition in (0, 1):
        values.append((partition, encoder.encode(Watermark(commit_ts=TS + 1000, build_ts=0))))
    offsets = {0: 0, 1: 0}
    records = []
    for partition, value in values:
        records.append(SourceRecord(topic="t", partition=partition, offset=offsets[partition], value=value))
        offsets[partition] += 1
    with path.open("wb") as fp:
        write_capture(records, fp)


class _Claims:
    """A sink that keeps, per write, the watermark the commit claims and the commit_ts of its rows."""

    def __init__(self) -> None:
        self.writes: list[tuple[int, list[int]]] = []

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        self.writes.append((context.resolved_ts, changes.changelog.column("_commit_ts").to_pylist()))

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        raise AssertionError("the stream has no DDL")

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        return {}

    def recorded_schema_snapshot(self) -> bytes | None:
        return None

    def close(self) -> None:
        return None


def _run(capture: Path, root: Path, workers: int) -> tuple[Pipeline, list[Any], list[Any]]:
    pipeline = Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[JsonLinesSink(root), _Claims()],
        dead_letters=DeadLetterFile(root / "_dead_letters.jsonl"),
        max_batch_records=60,
        decode_workers=workers,
    )
    try:
        pipeline.run(FileSource(capture, listener=pipeline), until_idle=0.2)
    finally:
        pipeline.close()
    rows = [json.loads(line) for line in (root / "shop" / "people.jsonl").read_text().splitlines()]
    dead = [json.loads(line) for line in (root / "_dead_letters.jsonl").read_text().splitlines()]
    return pipeline, rows, dead


def test_a_pipeline_with_workers_writes_what_one_without_writes(tmp_path: Path) -> None:
    capture = tmp_path / "capture.jsonl"
    _stream(capture)
    alone, alone_rows, alone_dead = _run(capture, tmp_path / "alone", workers=0)
    pooled, pooled_rows, pooled_dead = _run(capture, tmp_path / "pooled", workers=2)
    assert len(pooled_rows) == 399 and pooled_rows == alone_rows
    assert [(d["partition"], d["offset"]) for d in pooled_dead] == [(1, 65)]
    assert pooled_dead == alone_dead
    assert pooled.decode_stats.unrepresentable == alone.decode_stats.unrepresentable == 8
    assert pooled.stats.rows == alone.stats.rows == 399 and pooled.stats.dead_letters == 1


def test_a_commit_never_claims_a_watermark_its_table_has_not_reached(tmp_path: Path) -> None:
    """Decoding a batch in a worker delays applying it past later resolutions: a commit still claims only
    the watermark its rows were resolved at, so the table holds every row up to the claim."""
    capture = tmp_path / "capture.jsonl"
    _stream(capture)
    every_row = sorted(TS + row_id for row_id in range(1, 401) if row_id != 123)
    for workers in (0, 2):
        pipeline, _, _ = _run(capture, tmp_path / f"claims-{workers}", workers)
        claims = pipeline.sinks[1]
        assert isinstance(claims, _Claims) and len(claims.writes) >= 4
        written: list[int] = []
        for resolved_ts, commit_ts in claims.writes:
            written += commit_ts
            assert max(commit_ts) <= resolved_ts
            assert sorted(written) == every_row[: len(written)]  # in order, nothing skipped
            assert {ts for ts in every_row if ts <= resolved_ts} <= set(written)  # the claim holds
        assert sorted(written) == every_row


class _FailingSink(_Claims):
    """Applies its first `good` writes, then fails: the sink of a lakehouse that went away."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good
        self.offsets: list[tuple[int, int]] = []

    def write(self, changes: TableChanges, context: CommitContext) -> None:
        if len(self.writes) == self.good:
            raise SinkError("the lakehouse went away")
        super().write(changes, context)
        table = changes.changelog
        partitions, offsets = table.column("_partition").to_pylist(), table.column("_offset").to_pylist()
        self.offsets += zip(partitions, offsets, strict=True)


def test_a_failed_write_stops_the_run_with_nothing_after_it_applied_or_committed(tmp_path: Path) -> None:
    capture = tmp_path / "capture.jsonl"
    _stream(capture)
    sink = _FailingSink(good=2)
    pipeline = Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[sink],
        dead_letters=DeadLetterFile(tmp_path / "_dead_letters.jsonl"),
        max_batch_records=60,
        decode_workers=1,
    )
    source = FileSource(capture, listener=pipeline)
    try:
        with pytest.raises(SinkError, match="went away"):
            pipeline.run(source, until_idle=0.2)
    finally:
        pipeline.close()
    assert len(sink.writes) == 2  # the writer applied nothing after the failed unit
    letters = map(json.loads, (tmp_path / "_dead_letters.jsonl").read_text().splitlines())
    applied = set(sink.offsets) | {(letter["partition"], letter["offset"]) for letter in letters}
    committed = source.committed([("t", 0), ("t", 1)])
    for partition in (0, 1):
        offset = committed[("t", partition)]
        assert offset is not None and offset > 1  # the applied units were committed
        # every DML before the committed offset was applied or dead-lettered
        dml_offsets = {o for p, o in _dml_offsets(capture) if p == partition and o < offset}
        assert dml_offsets <= {o for p, o in applied if p == partition}


def _dml_offsets(capture: Path) -> list[tuple[int, int]]:
    decoder = MessageDecoder()
    return [
        (record.partition, record.offset)
        for record in read_capture(capture)
        if isinstance(decoder.decode(record.value), RawDML)
    ]
