"""Decode throughput on one core: our JSON/Avro paths against a naive consumer and bare fastavro.

Run: `python benchmarks/decode.py [--rows N] [--batch N] [--tz ZONE]`.

Every path decodes the same record values (INSERT DMLs of one 13-column table version, produced by
`MessageEncoder` from generated typed rows) and, where it produces Arrow, the results are asserted equal
before any figure is printed, so the comparison is like for like:

- JSON ours: `MessageDecoder().decode` (routing envelope -> RawDML), then `TableCodec.decode_batch` per
  `--batch` DMLs -> typed Arrow record batches.
- JSON naive: `json.loads` of the whole value, one Python conversion per value (int, Decimal,
  fromisoformat, zone conversion, enum labels, JSON validation), `RecordBatch.from_pylist`.
- Avro ours: the same two calls on the Avro encoding of the same rows.
- Avro bare fastavro: `fastavro.schemaless_reader` of each value into dicts (parsing only, no Arrow).
- Envelope only: `MessageDecoder().decode` alone, what routing a record costs.
- Change images, without and with checksum verification: the same rows carrying TiDB row checksums
  (spec §8), decoded by `TableCodec.decode_changes` (what the pipeline runs), then, in the second path,
  verified by `verify_changes` (every image must verify): the cost of `[integrity] verify_checksums`.

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
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

import fastavro
import pyarrow as pa

from consumer.protocol import avro_codec
from consumer.protocol.checksum import row_checksum, verify_changes
from consumer.protocol.codec import MessageDecoder, MessageEncoder
from consumer.protocol.model import DML, Checksum, Column, DataType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.rows import RowImages, TableCodec
from consumer.protocol.types import ValuePolicy

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
JSON_CHANGES = "JSON change images (checksummed rows)"
JSON_VERIFIED = "JSON change images + verify checksums"
AVRO_CHANGES = "Avro change images (checksummed rows)"
AVRO_VERIFIED = "Avro change images + verify checksums"
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


# -- the paths --------------------------------------------------------------------------------------
def ours(values: Sequence[bytes], codec: TableCodec, batch: int) -> list[RowImages]:
    """Envelope of every value, then typed Arrow images per batch (all values are one table version)."""
    decode = MessageDecoder().decode
    out = []
    for start in range(0, len(values), batch):
        raws: list[Any] = [decode(v) for v in values[start : start + batch]]
        out.append(codec.decode_batch(raws))
    return out


def changes(values: Sequence[bytes], codec: TableCodec, batch: int, verify: bool) -> int:
    """Envelopes, then change images per batch (the pipeline's decode), then optionally their checksums;
    returns the images verified."""
    decode = MessageDecoder().decode
    verified = 0
    for start in range(0, len(values), batch):
        raws: list[Any] = [decode(v) for v in values[start : start + batch]]
        images = codec.decode_changes(raws)
        if verify:
            count, rejected = verify_changes(codec, images, raws)
            assert not rejected, rejected
            verified += count
    return verified


def envelope_only(values: Sequence[bytes]) -> list[Any]:
    decode = MessageDecoder().decode
    return [decode(v) for v in values]


def bare_fastavro(values: Sequence[bytes]) -> list[Any]:
    reader, schema, bytes_io = fastavro.schemaless_reader, avro_codec._SCHEMA, io.BytesIO
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
    json_checksummed = encode_all(rows, "json", policy, checksums=True)
    avro_checksummed = encode_all(rows, "avro", policy, checksums=True)
    del rows
    assert isinstance(MessageDecoder().decode(json_values[0]), RawDML)
    assert isinstance(MessageDecoder().decode(avro_values[0]), RawDML)
    codec = TableCodec(SCHEMA)

    n, batch = args.rows, args.batch
    paths: list[tuple[str, Callable[[], Any]]] = [
        (JSON_ENVELOPE, lambda: envelope_only(json_values)),
        (JSON_OURS, lambda: ours(json_values, codec, batch)),
        (JSON_NAIVE, lambda: naive(json_values, batch)),
    ]
    if orjson is not None:
        paths.append((JSON_NAIVE_ORJSON, lambda: naive(json_values, batch, orjson.loads)))
    paths += [
        (AVRO_ENVELOPE, lambda: envelope_only(avro_values)),
        (AVRO_OURS, lambda: ours(avro_values, codec, batch)),
        (AVRO_BARE, lambda: bare_fastavro(avro_values)),
        (JSON_CHANGES, lambda: changes(json_checksummed, codec, batch, verify=False)),
        (JSON_VERIFIED, lambda: changes(json_checksummed, codec, batch, verify=True)),
        (AVRO_CHANGES, lambda: changes(avro_checksummed, codec, batch, verify=False)),
        (AVRO_VERIFIED, lambda: changes(avro_checksummed, codec, batch, verify=True)),
    ]
    # Rounds interleave the paths, so a burst of load on the machine does not favour one of them.
    timings: dict[str, float] = {}
    for round_ in range(REPEATS):
        print(f"  round {round_ + 1}/{REPEATS} ...", flush=True)
        results: dict[str, Any] = {}
        for name, run in paths:
            seconds, result = timed(run)
            timings[name] = min(timings.get(name, float("inf")), seconds)
            if round_ == 0 and name in (JSON_OURS, JSON_NAIVE, AVRO_OURS):
                results[name] = result
            if name in (JSON_VERIFIED, AVRO_VERIFIED):
                assert result == n, f"{name}: {result} of {n} images verified"
            del result
        if round_ == 0:
            verify(results[JSON_OURS], results[JSON_NAIVE], results[AVRO_OURS])
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
        ("JSON with / without verification", rate[JSON_VERIFIED] / rate[JSON_CHANGES]),
        ("Avro with / without verification", rate[AVRO_VERIFIED] / rate[AVRO_CHANGES]),
    ]
    for name, value in info:
        print(f"{name:<{width}} {value:>11.2f}x {'(info)':>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
