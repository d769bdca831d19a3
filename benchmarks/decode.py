"""Decode throughput on one core: every protocol's path against Simple JSON, a naive consumer and fastavro.

Run: `python benchmarks/decode.py [--rows N] [--batch N] [--tz ZONE]`.

Every path decodes the same record values (INSERT DMLs of one 13-column table version, produced by
`MessageEncoder` from generated typed rows) and, where it produces Arrow, the results are asserted equal
before any figure is printed, so the comparison is like for like:

- JSON ours: `MessageDecoder().decode_records` (routing envelopes -> RawDMLs, as the pipeline's intake
  calls it per poll) and `TableCodec.decode_batch`, per `--batch` DMLs -> typed Arrow record batches.
- JSON naive: `json.loads` of the whole value, one Python conversion per value (int, Decimal,
  fromisoformat, zone conversion, enum labels, JSON validation), `RecordBatch.from_pylist`.
- Avro ours: the same two calls on the Avro encoding of the same rows.
- Avro bare fastavro: `fastavro.schemaless_reader` of each value into dicts (parsing only, no Arrow).
- Envelope only: `MessageDecoder().decode_records` alone, what routing a record costs (Avro DML headers of
  known routes are read for the whole batch at once).
- JSON ours, change images: the same through `TableCodec.decode_changes` (what the pipeline calls), the
  baseline of the other protocols' targets.
- TiCDC Avro ours: `ConfluentAvroDecoder.decode_records` (Confluent frame, writer schemas from a registry on
  localhost, the TiDB extension's op and commit ts read from the datum's end), then `decode_changes`: the
  datums of a batch read columnar by polars-avro's native reader into typed Arrow. With the TiDB extension.
- TiCDC Avro fastavro per datum: `fastavro.schemaless_reader` of each datum into dicts (parsing only): the
  generic reader, rejected as the decode path.
- Debezium ours: `DebeziumDecoder.decode_records` (envelope, schema identified by its bytes), then
  `decode_changes` (a msgspec Struct per table), with the Connect schema and the TiDB extension.
- Simple change images of rows carrying TiDB row checksums (spec §8), without and with `verify_changes`
  (every image must verify), JSON and Avro: the cost of `[integrity] verify_checksums`.

Ours also builds the (all-NULL) `old` image and `has_data`/`has_old`, which the naive path skips.
TIMESTAMP values are written in `--tz` (default Asia/Shanghai), so both paths convert zones.
The process is pinned to one core; each figure is the best of 5 rounds that interleave the paths,
timed with `time.perf_counter`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import io
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import fastavro
import pyarrow as pa

from consumer.protocol.base import RowImages
from consumer.protocol.debezium.decoder import DebeziumDecoder
from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
from consumer.protocol.model import DML, Checksum, Column, DataType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.simple import avro_messages
from consumer.protocol.simple.checksum import row_checksum, verify_changes
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.ticdc_avro.decoder import ConfluentAvroDecoder
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.protocol.types import ValuePolicy
from consumer.sources.record import SourceRecord
from consumer.testing.registry import LocalSchemaRegistry

try:  # optional: a faster naive baseline, shown for reference when installed
    import orjson
except ImportError:  # pragma: no cover - depends on the environment
    orjson = None

REPEATS = 5
JSON_ENVELOPE = "JSON envelope only (routing)"
JSON_OURS = "JSON ours (envelope + typed Arrow)"
JSON_NAIVE = "JSON naive (json.loads + Python + from_pylist)"
JSON_NAIVE_ORJSON = "JSON naive, orjson.loads (reference)"
AVRO_ENVELOPE = "Avro envelope only (routing)"
AVRO_OURS = "Avro ours (envelope + typed Arrow)"
AVRO_BARE = "Avro bare fastavro.schemaless_reader"
JSON_CHANGES = "JSON ours, change images (decode_changes)"
TICDC_AVRO_OURS = "TiCDC Avro ours (frame + typed Arrow, columnar)"
TICDC_AVRO_FASTAVRO = "TiCDC Avro fastavro per datum (parse only)"
DEBEZIUM_OURS = "Debezium JSON ours (envelope + typed Arrow)"
JSON_CHECKSUMMED = "JSON change images, checksummed rows"
JSON_VERIFIED = "JSON change images + verify checksums"
AVRO_CHECKSUMMED = "Avro change images, checksummed rows"
AVRO_VERIFIED = "Avro change images + verify checksums"
TARGET_TICDC_AVRO_VS_JSON = 1.0
TARGET_DEBEZIUM_VS_JSON = 0.8
STATUSES = ("active", "inactive", "banned", "pending")
TARGET_JSON_VS_NAIVE = 3.0
TARGET_JSON_ROWS_PER_S = 250_000
TARGET_AVRO_VS_FASTAVRO = 0.8


# -- the table and its rows -------------------------------------------------------------------------
def _col(name: str, mysql_type: str, nullable: bool = True, **kw: Any) -> Column:
    return Column(name=name, data_type=DataType(mysql_type=mysql_type, **kw), nullable=nullable)


SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=104,
    version=449_811_223_446_634_498,
    columns=(
        _col("id", "int", nullable=False, length=11),
        _col("customer_id", "bigint", length=20),
        _col("counter", "bigint", length=20, unsigned=True),
        _col("name", "varchar", charset="utf8mb4", collate="utf8mb4_bin", length=64),
        _col("amount", "decimal", length=12, decimal=2),
        _col("created_at", "datetime", length=23, decimal=3),
        _col("updated_at", "timestamp", length=19),
        _col("birthday", "date", length=10),
        _col("score", "double", length=22),
        _col("flag", "tinyint", length=4),
        _col("bio", "text", charset="utf8mb4", collate="utf8mb4_bin", length=65535),
        _col("status", "enum", charset="utf8mb4", collate="utf8mb4_bin", elements=STATUSES),
        _col("attrs", "json", length=4294967295),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)

WORDS = (
    *("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"),
    *("kilo", "lima", "mike", "november", "oscar", "papa", "quebec", "romeo", "sierra", "tango"),
    *("uniform", "victor", "whiskey", "xray", "yankee", "zulu", "café", "naïve", "<b>&amp;</b>", "東京"),
)


def typed_rows(count: int, seed: int = 7) -> list[dict[str, Any]]:
    """Realistic typed values, ~5% NULL in every nullable column."""
    not_null = {c.name for c in SCHEMA.columns if not c.nullable}
    rng = random.Random(seed)
    epoch = dt.datetime(2018, 1, 1)
    rows = []
    for i in range(count):
        created = epoch + dt.timedelta(seconds=rng.randrange(200_000_000), milliseconds=rng.randrange(1000))
        row: dict[str, Any] = {
            "id": i + 1,
            "customer_id": rng.randrange(1, 1 << 40),
            "counter": rng.randrange(1 << 64),
            "name": " ".join(rng.choices(WORDS, k=rng.randint(1, 4)))[:64],
            "amount": Decimal(rng.randint(-(10**10), 10**10)).scaleb(-2),
            "created_at": created,
            "updated_at": (created + dt.timedelta(seconds=rng.randrange(10**6))).replace(
                microsecond=0, tzinfo=dt.UTC
            ),
            "birthday": dt.date(1950, 1, 1) + dt.timedelta(days=rng.randrange(22_000)),
            "score": rng.uniform(-1e6, 1e6),
            "flag": rng.randint(-128, 127),
            "bio": " ".join(rng.choices(WORDS, k=rng.randint(3, 30))),
            "status": rng.choice(STATUSES),
            "attrs": {"tags": rng.sample(WORDS[:10], k=rng.randint(0, 3)), "vip": rng.random() < 0.1},
        }
        for name in row:
            if name not in not_null and rng.random() < 0.05:
                row[name] = None
        rows.append(row)
    return rows


def encode_all(
    rows: list[dict[str, Any]], encoding: str, policy: ValuePolicy, *, checksums: bool = False
) -> list[bytes]:
    encoder = MessageEncoder(encoding, policy=policy)  # type: ignore[arg-type]
    codec = encoder.table_codec(SCHEMA)
    base_ts = 449_811_300_000_000_000
    return [
        encoder.encode(
            DML(
                type=DMLType.INSERT,
                database=SCHEMA.database,
                table=SCHEMA.table,
                table_id=SCHEMA.table_id,
                commit_ts=base_ts + i,
                build_ts=1_735_689_600_000 + i // 100,
                schema_version=SCHEMA.version,
                data=row,
                checksum=Checksum(1, False, row_checksum(codec, row), 0) if checksums else None,
            ),
            SCHEMA,
        )
        for i, row in enumerate(rows)
    ]


def verified_changes(records: Sequence[SourceRecord], codec: TableCodec, batch: int, verify: bool) -> int:
    """Envelopes, then change images per batch (the pipeline's decode), then optionally their checksums;
    returns the images verified."""
    decode = MessageDecoder().decode_records
    verified = 0
    for start in range(0, len(records), batch):
        raws: list[Any] = decode(records[start : start + batch])
        images = codec.decode_changes(raws)
        if verify:
            count, rejected = verify_changes(codec, images, raws)
            assert not rejected, rejected
            verified += count
    return verified


# -- the paths --------------------------------------------------------------------------------------
def ours(records: Sequence[SourceRecord], codec: TableCodec, batch: int) -> list[RowImages]:
    """Envelope of every value, then typed Arrow images per batch (all values are one table version)."""
    decode = MessageDecoder().decode_records
    out = []
    for start in range(0, len(records), batch):
        raws: list[Any] = decode(records[start : start + batch])
        out.append(codec.decode_batch(raws))
    return out


def changes(
    records: Sequence[SourceRecord], decoder: Any, codec: TableCodec, batch: int
) -> list[pa.RecordBatch]:
    """Records of any protocol -> typed change images per batch, as the pipeline decodes them."""
    decode = decoder.decode_records
    out = []
    for start in range(0, len(records), batch):
        raws: list[Any] = decode(records[start : start + batch])
        out.append(codec.decode_changes(raws).rows)
    return out


def avro_records(rows: list[dict[str, Any]], registry: SchemaRegistry, policy: ValuePolicy) -> list[Any]:
    encoder = ConfluentAvroEncoder(registry, AvroOptions(tidb_extension=True), policy)
    return [encoder.encode_dml(dml, SCHEMA, "tidb_shop_orders") for dml in _dmls(rows)]


def debezium_records(rows: list[dict[str, Any]], policy: ValuePolicy) -> list[Any]:
    encoder = DebeziumEncoder(DebeziumOptions(tidb_extension=True), policy)
    return [encoder.encode_dml(dml, SCHEMA) for dml in _dmls(rows)]


def _dmls(rows: list[dict[str, Any]]) -> list[DML]:
    base_ts = 449_811_300_000_000_000
    return [
        DML(
            type=DMLType.INSERT,
            database=SCHEMA.database,
            table=SCHEMA.table,
            table_id=SCHEMA.table_id,
            commit_ts=base_ts + i,
            build_ts=0,
            schema_version=SCHEMA.version,
            data=row,
        )
        for i, row in enumerate(rows)
    ]


def fastavro_datums(records: Sequence[Any], registry: SchemaRegistry) -> list[Any]:
    parsed = fastavro.parse_schema(registry.schema(int.from_bytes(records[0][1][1:5], "big")))
    reader, bytes_io = fastavro.schemaless_reader, io.BytesIO
    out = []
    for _, value in records:
        stream = bytes_io(value)
        stream.seek(5)
        out.append(reader(stream, parsed, None))
    return out


def envelope_only(records: Sequence[SourceRecord], batch: int) -> list[Any]:
    decode = MessageDecoder().decode_records
    return [decode(records[start : start + batch]) for start in range(0, len(records), batch)]


def polled(pairs: Iterable[tuple[bytes | None, bytes]]) -> list[SourceRecord]:
    """(key, value) pairs as the source hands records to the pipeline."""
    return [SourceRecord("bench", 0, offset, None, key, value) for offset, (key, value) in enumerate(pairs)]


def bare_fastavro(values: Sequence[bytes]) -> list[Any]:
    reader, schema, bytes_io = fastavro.schemaless_reader, avro_messages._SCHEMA, io.BytesIO
    return [reader(bytes_io(v), schema, None) for v in values]


# The naive consumer writes its own Arrow schema and one converter per column.
NAIVE_SCHEMA = pa.schema(
    [
        ("id", pa.int32()),
        ("customer_id", pa.int64()),
        ("counter", pa.decimal128(20, 0)),
        ("name", pa.string()),
        ("amount", pa.decimal128(12, 2)),
        ("created_at", pa.timestamp("us")),
        ("updated_at", pa.timestamp("us", tz="UTC")),
        ("birthday", pa.date32()),
        ("score", pa.float64()),
        ("flag", pa.int8()),
        ("bio", pa.string()),
        ("status", pa.string()),
        ("attrs", pa.string()),
    ]
)
_ENUM_LABELS = ("", *STATUSES)


def _timestamp(value: dict[str, str]) -> dt.datetime:
    local = dt.datetime.fromisoformat(value["value"]).replace(tzinfo=ZoneInfo(value["location"]))
    return local.astimezone(dt.UTC)


def _json_text(loads: Callable[[Any], Any]) -> Callable[[str], str]:
    def checked(value: str) -> str:
        loads(value)  # our path validates JSON documents too
        return value

    return checked


def _converters(loads: Callable[[Any], Any]) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    return (
        ("id", int),
        ("customer_id", int),
        ("counter", Decimal),
        ("name", str),
        ("amount", Decimal),
        ("created_at", dt.datetime.fromisoformat),
        ("updated_at", _timestamp),
        ("birthday", dt.date.fromisoformat),
        ("score", float),
        ("flag", int),
        ("bio", str),
        ("status", lambda v: _ENUM_LABELS[int(v)]),
        ("attrs", _json_text(loads)),
    )


def naive(
    values: Sequence[bytes], batch: int, loads: Callable[[Any], Any] = json.loads
) -> list[pa.RecordBatch]:
    converters = _converters(loads)
    out = []
    for start in range(0, len(values), batch):
        rows = []
        for value in values[start : start + batch]:
            data = loads(value)["data"]
            rows.append(
                {name: None if (v := data.get(name)) is None else conv(v) for name, conv in converters}
            )
        out.append(pa.RecordBatch.from_pylist(rows, schema=NAIVE_SCHEMA))
    return out


# -- measuring --------------------------------------------------------------------------------------
def timed(run: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    result = run()
    return time.perf_counter() - start, result


def pin_one_core() -> str:
    if hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {0})
            return "pinned to CPU 0"
        except OSError as exc:
            return f"not pinned ({exc})"
    return "not pinned (no sched_setaffinity)"


def _table(batches: Sequence[pa.RecordBatch]) -> pa.Table:
    return pa.Table.from_batches(list(batches))


def verify(json_ours: list[RowImages], json_naive: list[pa.RecordBatch], avro_ours: list[RowImages]) -> None:
    ours_data = _table([images.data for images in json_ours])
    naive_data = _table(json_naive)
    assert ours_data.schema.equals(naive_data.schema), (ours_data.schema, naive_data.schema)
    for name in ours_data.column_names:
        assert ours_data[name].equals(naive_data[name]), f"JSON ours and naive differ in column {name}"
    assert ours_data.equals(naive_data), "JSON ours and naive tables differ"
    assert _table([images.data for images in avro_ours]).equals(ours_data), "Avro and JSON data differ"
    assert _table([images.old for images in avro_ours]).equals(_table([images.old for images in json_ours]))
    for name in ("has_data", "has_old"):
        assert [getattr(i, name) for i in avro_ours] == [getattr(i, name) for i in json_ours], name
    assert all(all(i.has_data) and not any(i.has_old) for i in json_ours), "INSERTs: data, no old"
    assert ours_data.num_rows > 0 and sum(c.null_count for c in ours_data.columns) > 0, "NULLs expected"


def verify_protocols(
    json_changes: list[pa.RecordBatch], avro: list[pa.RecordBatch], dbz: list[pa.RecordBatch]
) -> None:
    """Same values as the Simple JSON path: TiCDC Avro exactly (its coarse types, e.g. TINYINT as INT, compare
    by value), Debezium but for DECIMAL, which that protocol sends as a float64."""
    reference = _table(json_changes).to_pydict()
    for name, table in (("TiCDC Avro", _table(avro).to_pydict()), ("Debezium", _table(dbz).to_pydict())):
        for column, values in reference.items():
            if name == "Debezium" and column == "amount":
                assert table[column] == [None if v is None else float(v) for v in values], name
                continue
            assert table[column] == values, f"{name} differs from Simple JSON in column {column}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="DML messages per path (default 200000)")
    parser.add_argument("--batch", type=int, default=10_000, help="DMLs per decode_batch (default 10000)")
    parser.add_argument("--tz", default="Asia/Shanghai", help="zone TIMESTAMPs are written in (TiCDC --tz)")
    args = parser.parse_args(argv)
    if args.rows <= 0 or args.batch <= 0:
        parser.error("--rows and --batch must be positive")

    pinned = pin_one_core()
    policy = ValuePolicy(timestamp_location=args.tz)
    print(f"generating {args.rows:,} INSERT DMLs ({len(SCHEMA.columns)} columns, --tz {args.tz}) ...")
    rows = typed_rows(args.rows)
    json_values = encode_all(rows, "json", policy)
    avro_values = encode_all(rows, "avro", policy)
    json_checksummed = polled((None, v) for v in encode_all(rows, "json", policy, checksums=True))
    avro_checksummed = polled((None, v) for v in encode_all(rows, "avro", policy, checksums=True))
    registry_server = LocalSchemaRegistry().start()  # a real HTTP registry on localhost (a test fixture)
    registry = SchemaRegistry(registry_server.url)
    ticdc_avro = avro_records(rows, registry, policy)
    debezium = debezium_records(rows, policy)
    del rows
    avro_decoder = ConfluentAvroDecoder(SchemaRegistry(registry_server.url), policy)
    avro_decoder.decode_record(*ticdc_avro[0])
    (avro_raw,) = [avro_decoder.decode_record(*ticdc_avro[0])]
    avro_codec_ = TableCodec(
        avro_decoder.described_schema(avro_raw.schema_key), policy, protocol=avro_decoder.protocol
    )  # type: ignore[arg-type]
    dbz_decoder = DebeziumDecoder()
    dbz_raw = dbz_decoder.decode_record(*debezium[0])
    dbz_codec = TableCodec(
        dbz_decoder.described_schema(dbz_raw.schema_key), policy, protocol=dbz_decoder.protocol
    )  # type: ignore[arg-type]
    json_polled, avro_polled = polled((None, v) for v in json_values), polled((None, v) for v in avro_values)
    ticdc_polled, debezium_polled = polled(ticdc_avro), polled(debezium)
    assert isinstance(MessageDecoder().decode(json_values[0]), RawDML)
    assert isinstance(MessageDecoder().decode(avro_values[0]), RawDML)
    codec = TableCodec(SCHEMA)

    n, batch = args.rows, args.batch
    paths: list[tuple[str, Callable[[], Any]]] = [
        (JSON_ENVELOPE, lambda: envelope_only(json_polled, batch)),
        (JSON_OURS, lambda: ours(json_polled, codec, batch)),
        (JSON_NAIVE, lambda: naive(json_values, batch)),
    ]
    if orjson is not None:
        paths.append((JSON_NAIVE_ORJSON, lambda: naive(json_values, batch, orjson.loads)))
    paths += [
        (AVRO_ENVELOPE, lambda: envelope_only(avro_polled, batch)),
        (AVRO_OURS, lambda: ours(avro_polled, codec, batch)),
        (AVRO_BARE, lambda: bare_fastavro(avro_values)),
        (JSON_CHANGES, lambda: changes(json_polled, MessageDecoder(), codec, batch)),
        (TICDC_AVRO_OURS, lambda: changes(ticdc_polled, avro_decoder, avro_codec_, batch)),
        (TICDC_AVRO_FASTAVRO, lambda: fastavro_datums(ticdc_avro, registry)),
        (DEBEZIUM_OURS, lambda: changes(debezium_polled, dbz_decoder, dbz_codec, batch)),
        (JSON_CHECKSUMMED, lambda: verified_changes(json_checksummed, codec, batch, verify=False)),
        (JSON_VERIFIED, lambda: verified_changes(json_checksummed, codec, batch, verify=True)),
        (AVRO_CHECKSUMMED, lambda: verified_changes(avro_checksummed, codec, batch, verify=False)),
        (AVRO_VERIFIED, lambda: verified_changes(avro_checksummed, codec, batch, verify=True)),
    ]
    # Rounds interleave the paths, so a burst of load on the machine does not favour one of them.
    timings: dict[str, float] = {}
    for round_ in range(REPEATS):
        print(f"  round {round_ + 1}/{REPEATS} ...", flush=True)
        results: dict[str, Any] = {}
        for name, run in paths:
            seconds, result = timed(run)
            timings[name] = min(timings.get(name, float("inf")), seconds)
            if round_ == 0 and name in (
                JSON_OURS,
                JSON_NAIVE,
                AVRO_OURS,
                JSON_CHANGES,
                TICDC_AVRO_OURS,
                DEBEZIUM_OURS,
            ):
                results[name] = result
            if name in (JSON_VERIFIED, AVRO_VERIFIED):
                assert result == n, f"{name}: {result} of {n} images verified"
            del result
        if round_ == 0:
            verify(results[JSON_OURS], results[JSON_NAIVE], results[AVRO_OURS])
            verify_protocols(results[JSON_CHANGES], results[TICDC_AVRO_OURS], results[DEBEZIUM_OURS])
        del results

    rate = {name: n / seconds for name, seconds in timings.items()}

    json_size = sum(map(len, json_values)) / n
    avro_size = sum(map(len, avro_values)) / n
    print()
    print(
        f"Decode speed, {pinned}; Python {sys.version.split()[0]}, pyarrow {pa.__version__}, "
        f"fastavro {fastavro.__version__}"
    )
    print(
        f"{n:,} INSERT DMLs, batch {batch:,}; JSON {json_size:.0f} B/msg, Avro {avro_size:.0f} B/msg; "
        f"best of {REPEATS}"
    )
    print("verified: JSON ours == naive Arrow table; Avro ours == JSON ours (data, old, has_data, has_old)")
    print("verified: TiCDC Avro and Debezium change images == Simple JSON's (Debezium DECIMAL as float64)")
    print(
        f"TiCDC Avro {sum(len(v) for _, v in ticdc_avro) / n:.0f} B/msg, "
        f"Debezium {sum(len(v) for _, v in debezium) / n:.0f} B/msg (with its schema)"
    )
    print()
    width = max(map(len, rate)) + 2
    print(f"{'path':<{width}} {'rows/s':>12} {'us/row':>8}")
    print("-" * (width + 22))
    for name, value in rate.items():
        print(f"{name:<{width}} {value:>12,.0f} {1e6 / value:>8.2f}")
    print()

    json_ours = rate[JSON_OURS]
    checks = [
        ("JSON ours / naive", json_ours / rate[JSON_NAIVE], TARGET_JSON_VS_NAIVE, "x"),
        ("JSON ours, absolute", json_ours, TARGET_JSON_ROWS_PER_S, " rows/s"),
        ("Avro ours / bare fastavro", rate[AVRO_OURS] / rate[AVRO_BARE], TARGET_AVRO_VS_FASTAVRO, "x"),
        (
            "TiCDC Avro / JSON (changes)",
            rate[TICDC_AVRO_OURS] / rate[JSON_CHANGES],
            TARGET_TICDC_AVRO_VS_JSON,
            "x",
        ),
        ("TiCDC Avro / JSON ours", rate[TICDC_AVRO_OURS] / json_ours, TARGET_TICDC_AVRO_VS_JSON, "x"),
        ("Debezium / JSON (changes)", rate[DEBEZIUM_OURS] / rate[JSON_CHANGES], TARGET_DEBEZIUM_VS_JSON, "x"),
        ("Simple Avro / JSON ours", rate[AVRO_OURS] / json_ours, TARGET_TICDC_AVRO_VS_JSON, "x"),
    ]
    print(f"{'ratio':<{width}} {'value':>12} {'target':>12}  verdict")
    print("-" * (width + 36))
    for name, value, target, unit in checks:
        ratio = unit == "x"
        shown = f"{value:.2f}x" if ratio else f"{value:,.0f}"
        goal = f">= {target:.1f}x" if ratio else f">= {target:,.0f}"
        print(f"{name:<{width}} {shown:>12} {goal:>12}  {'ok' if value >= target else 'MISSED'}")
    info = []
    if orjson is not None:
        info.append(("JSON ours / naive with orjson", json_ours / rate[JSON_NAIVE_ORJSON]))
    info += [
        ("JSON envelope / JSON ours", rate[JSON_ENVELOPE] / json_ours),
        ("Avro envelope / Avro ours", rate[AVRO_ENVELOPE] / rate[AVRO_OURS]),
        ("TiCDC Avro ours / its fastavro parse", rate[TICDC_AVRO_OURS] / rate[TICDC_AVRO_FASTAVRO]),
        ("JSON with / without verification", rate[JSON_VERIFIED] / rate[JSON_CHECKSUMMED]),
        ("Avro with / without verification", rate[AVRO_VERIFIED] / rate[AVRO_CHECKSUMMED]),
    ]
    for name, value in info:
        print(f"{name:<{width}} {value:>11.2f}x {'(info)':>12}")
    registry_server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
