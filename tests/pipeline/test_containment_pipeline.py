"""Each class of hostile record of issue 10, alone in an otherwise valid stream, through `ticdc-consumer run
--source file:...` into Delta: `run` exits 0, the record is dead-lettered with its location and reason code,
every valid row lands exactly once, and a restart does nothing more. Valid tables the issue found
unwritable (metadata-named and odd column names, unknown types, raw binary defaults) land, in Delta, Parquet
and Spark."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import lz4.frame
import msgspec
import pytest
from click.testing import CliRunner

from consumer.cli import EXIT_UNAPPLIED, main
from consumer.lakehouse.tables import read_changelog, read_mirror
from consumer.protocol.limits import tso_of
from consumer.protocol.model import DML, Bootstrap, Column, DataType, DMLType, Index, TableSchema, Watermark
from consumer.protocol.simple import avro_messages
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord

TS = tso_of(1_767_225_600)  # 2026-01-01
TEXT = DataType("varchar", "utf8mb4", "utf8mb4_bin", length=64)
SCHEMA = TableSchema(
    "shop",
    "t",
    7,
    TS - 100,
    (
        Column("id", DataType("int", length=11), nullable=False),
        Column("name", TEXT),
        Column("amount", DataType("decimal", length=50, decimal=10)),
        Column("ts", DataType("timestamp", length=19)),
        Column("doc", DataType("json", length=4294967295)),
    ),
    (Index("primary", True, True, False, ("id",)),),
)
IN_PROCESS = {
    "TICDC_CONSUMER_PARALLELISM_DECODE_WORKERS": "0"
}  # workers are exercised by the subprocess cases


def dml(
    schema: TableSchema, row_id: int, *, encoding: str = "json", commit_ts: int | None = None, **values: Any
) -> bytes:
    data = {"id": row_id, **values}
    message = DML(
        type=DMLType.INSERT,
        database=schema.database,
        table=schema.table,
        table_id=schema.table_id,
        commit_ts=commit_ts or TS + row_id,
        build_ts=1,
        schema_version=schema.version,
        data=data,
    )
    return MessageEncoder(encoding).encode(message, schema)  # type: ignore[arg-type]


def valid_row(row_id: int, encoding: str = "json") -> bytes:
    return dml(
        SCHEMA,
        row_id,
        encoding=encoding,
        name=f"n{row_id}",
        amount=Decimal("1.5"),
        ts=dt.datetime(2020, 1, 1, tzinfo=dt.UTC),
        doc={"k": [row_id]},
    )


def bootstrap(schema: TableSchema, encoding: str = "json") -> bytes:
    return MessageEncoder(encoding).encode(Bootstrap(table_schema=schema, build_ts=1))  # type: ignore[arg-type]


def watermark(encoding: str = "json") -> bytes:
    return MessageEncoder(encoding).encode(Watermark(commit_ts=TS + 1000, build_ts=1))  # type: ignore[arg-type]


def json_row(values: dict[str, Any], *, commit_ts: int = TS + 3, schema: TableSchema = SCHEMA) -> bytes:
    """A JSON DML written by hand, so its values can be anything; by default in row 3's transaction (a
    later commit ts would make rows 4-5 older than it on the partition: copies TiCDC re-sent)."""
    return json.dumps(
        {
            "version": 1,
            "database": schema.database,
            "table": schema.table,
            "tableID": schema.table_id,
            "type": "INSERT",
            "commitTs": commit_ts,
            "buildTs": 1,
            "schemaVersion": schema.version,
            "data": {"id": "50", **values},
        }
    ).encode()


BAD_TABLE = msgspec.structs.replace(SCHEMA, table="bad", table_id=8, version=TS - 99)


def bad_schema(*columns: Column) -> list[bytes]:
    """A BOOTSTRAP of a table outside TiDB's limits, then a row of it: both set aside."""
    schema = msgspec.structs.replace(BAD_TABLE, columns=(SCHEMA.columns[0], *columns))
    return [bootstrap(schema), json_row({}, schema=schema)]


def capture(path: Path, values: list[bytes]) -> Path:
    with path.open("wb") as file:
        write_capture(
            [SourceRecord("cdc", 0, offset, None, None, value) for offset, value in enumerate(values)], file
        )
    return path


def stream(hostile: list[bytes], encoding: str = "json") -> tuple[list[bytes], list[int], list[int]]:
    """BOOTSTRAP, rows 1-3, the hostile records, rows 4-5, WATERMARK: the values, the valid rows' offsets
    and the hostile records' offsets."""
    head = [bootstrap(SCHEMA, encoding), *(valid_row(n, encoding) for n in (1, 2, 3))]
    tail = [valid_row(n, encoding) for n in (4, 5)]
    values = [*head, *hostile, *tail, watermark(encoding)]
    hostile_offsets = list(range(len(head), len(head) + len(hostile)))
    valid = [1, 2, 3, *(offset + len(head) + len(hostile) for offset in range(len(tail)))]
    return values, valid, hostile_offsets


def run(source: Path, sink: str, env: dict[str, str] | None = None) -> Any:
    result = CliRunner().invoke(
        main,
        ["run", "--source", f"file:{source}", "--sink", sink, "--until-idle", "0.5"],
        env={**IN_PROCESS, **(env or {})},
        catch_exceptions=False,
    )
    return result


def changelog_offsets(root: Path, database: str = "shop", table: str = "t") -> list[int]:
    changelog = read_changelog(root, database, table, ["_offset"])
    assert changelog is not None
    return sorted(changelog["_offset"].to_pylist())


def dead_letters(root: Path) -> list[dict[str, Any]]:
    path = root / "_dead_letters.jsonl"
    return [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


HOSTILE: dict[str, tuple[Callable[[], list[bytes]], list[str]]] = {
    "decimal-scale-2^31": (
        lambda: bad_schema(Column("x", DataType("decimal", length=12, decimal=2**31))),
        ["schema-rejected", "schema-rejected"],
    ),
    "duplicate-column": (lambda: bad_schema(Column("a", TEXT), Column("A", TEXT)), ["schema-rejected"] * 2),
    "utf8-in-header": (lambda: [json_row({}).replace(b'"shop"', b'"sh\xffop"')], ["malformed-message"]),
    "utf8-in-value": (lambda: [json_row({"name": "@@"}).replace(b"@@", b"\xff\xfe")], ["value-decode"]),
    "nesting-in-watermark": (
        lambda: [watermark()[:-1] + b',"x":' + b"[" * 1000 + b"]" * 1000 + b"}"],
        ["nesting-too-deep"],
    ),
    "nesting-in-json-column": (lambda: [json_row({"doc": "[" * 1000 + "]" * 1000})], ["nesting-too-deep"]),
    "text-in-decimal": (lambda: [json_row({"amount": "abc"})], ["value-decode"]),
    "timestamp-as-text": (lambda: [json_row({"ts": "2020-01-01 00:00:00"})], ["value-decode"]),
    "timestamp-in-europe": (
        lambda: [json_row({"ts": {"location": "Europe", "value": "2020-01-01 00:00:00"}})],
        ["value-decode"],
    ),
    "timestamp-zone-300-chars": (
        lambda: [json_row({"ts": {"location": "A" * 300, "value": "2020-01-01 00:00:00"}})],
        ["value-decode"],
    ),
    "lz4-bomb": (lambda: [lz4.frame.compress(b"{" + b" " * (65 << 20) + b"}")], ["compression-bomb"]),
    "commit-ts-2^64-1": (lambda: [json_row({}, commit_ts=2**64 - 1)], ["commit-ts-implausible"]),
    "commit-ts-minus-5": (lambda: [json_row({}, commit_ts=-5)], ["commit-ts-implausible"]),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_record_is_set_aside_and_everything_else_lands_once(tmp_path: Path, case: str) -> None:
    make, codes = HOSTILE[case]
    values, valid, hostile = stream(make())
    source, root = capture(tmp_path / "capture.jsonl", values), tmp_path / "lake"

    first = run(source, f"delta:{root}")
    assert first.exit_code == 0, first.output
    letters = dead_letters(root)
    assert [(d["topic"], d["partition"], d["offset"], d["reason_code"]) for d in letters] == [
        ("cdc", 0, offset, code) for offset, code in zip(hostile, codes, strict=True)
    ]
    assert all(d["reason"] and d["value"] for d in letters)
    assert changelog_offsets(root) == valid

    again = run(source, f"delta:{root}")
    assert again.exit_code == 0, again.output
    assert dead_letters(root) == letters
    assert changelog_offsets(root) == valid


def test_an_avro_timestamp_as_a_string_in_an_avro_stream(tmp_path: Path) -> None:
    message = DML(
        type=DMLType.INSERT,
        database="shop",
        table="t",
        table_id=7,
        commit_ts=TS + 3,
        build_ts=1,
        schema_version=SCHEMA.version,
    )
    hostile = avro_messages.encode(message, {"id": ("long", 50), "ts": ("string", "2020-01-01 00:00:00")})
    values, valid, offsets = stream([hostile], "avro")
    root = tmp_path / "lake"
    assert run(capture(tmp_path / "c.jsonl", values), f"delta:{root}").exit_code == 0
    assert [(d["offset"], d["reason_code"]) for d in dead_letters(root)] == [(offsets[0], "value-decode")]
    assert changelog_offsets(root) == valid


def test_json_and_avro_rows_of_one_table_land_together(tmp_path: Path) -> None:
    values = [
        bootstrap(SCHEMA),
        valid_row(1),
        valid_row(2, "avro"),
        valid_row(3),
        valid_row(4, "avro"),
        watermark(),
    ]
    root = tmp_path / "lake"
    result = run(capture(tmp_path / "c.jsonl", values), f"delta:{root}")
    assert result.exit_code == 0, result.output
    assert dead_letters(root) == []
    assert changelog_offsets(root) == [1, 2, 3, 4]


def test_an_unknown_type_lands_as_text_or_goes_to_the_error_policy_on_request(tmp_path: Path) -> None:
    schema = msgspec.structs.replace(
        SCHEMA, table="geo", columns=(SCHEMA.columns[0], Column("shape", DataType("geometry")))
    )
    values = [bootstrap(schema), json_row({"shape": "POINT(1 2)"}, schema=schema), watermark()]
    source = capture(tmp_path / "c.jsonl", values)
    lossless = tmp_path / "lossless"
    result = run(source, f"delta:{lossless}")
    assert result.exit_code == 0, result.output
    changelog = read_changelog(lossless, "shop", "geo", ["shape"])
    assert changelog is not None and changelog["shape"].to_pylist() == ["POINT(1 2)"]
    refused = tmp_path / "refused"
    result = run(source, f"delta:{refused}", {"TICDC_CONSUMER_DECODE_UNKNOWN_TYPES": "error"})
    assert result.exit_code == 0, result.output
    assert [(d["offset"], d["reason_code"]) for d in dead_letters(refused)] == [
        (0, "schema-rejected"),
        (1, "schema-rejected"),
    ]


def test_an_avro_binary_default_that_is_no_text_does_not_stop_the_run(tmp_path: Path) -> None:
    """Its raw bytes once made every Delta commit fail (the schema snapshot could not be encoded)."""
    schema = msgspec.structs.replace(
        SCHEMA,
        table="bin",
        columns=(SCHEMA.columns[0], Column("b", DataType("binary", length=2), default="\u00ff")),
    )
    boot = bootstrap(schema, "avro").replace("\u00ff".encode(), b"\xff\x00")
    values = [boot, dml(schema, 1, encoding="avro", b=b"\x01\x02"), watermark()]
    root = tmp_path / "lake"
    result = run(capture(tmp_path / "c.jsonl", values), f"delta:{root}")
    assert result.exit_code == 0, result.output
    assert changelog_offsets(root, table="bin") == [1]


def test_hostile_names_stay_inside_a_jsonl_root(tmp_path: Path) -> None:
    values = []
    for number, database in enumerate(("../../x", "/abs/path", "..")):
        schema = msgspec.structs.replace(SCHEMA, database=database, table_id=20 + number)
        values += [bootstrap(schema), dml(schema, 1, name="x")]
    root = tmp_path / "deep" / "lake"
    result = run(capture(tmp_path / "c.jsonl", [*values, watermark()]), f"jsonl:{root}")
    assert result.exit_code == 0, result.output
    outside = [
        p for p in tmp_path.rglob("*") if p.is_file() and root not in p.parents and p.name != "c.jsonl"
    ]
    assert outside == []
    written = sorted(p.relative_to(root).as_posix() for p in root.glob("*/*.jsonl"))
    assert written == ["~2E./t.jsonl", "~2E.~2F..~2Fx/t.jsonl", "~2Fabs~2Fpath/t.jsonl"]


def test_until_idle_with_rows_waiting_for_a_watermark_says_so_and_exits_3(tmp_path: Path) -> None:
    values, _, _ = stream([])
    held = msgspec.structs.replace(SCHEMA, table="later", version=TS - 7)
    values = [*values[:-1], json_row({}, schema=held)]  # no closing WATERMARK; a row whose schema never came
    result = run(capture(tmp_path / "c.jsonl", values), f"delta:{tmp_path / 'lake'}")
    assert result.exit_code == EXIT_UNAPPLIED, result.output
    assert "6 row(s) and 0 DDL(s) not applied" in result.output
    assert "cdc[0]: 5 row(s) wait for a WATERMARK >= " in result.output
    assert "(this one's: none yet); 1 row(s) wait for a schema (shop.later version" in result.output


def test_the_decimal_that_segfaulted_pyarrow_in_a_real_run_with_decode_workers(tmp_path: Path) -> None:
    """`python -m consumer run` in a child, decode workers on (the default): once rc 139, now rc 0."""
    values, valid, _ = stream(bad_schema(Column("x", DataType("decimal", length=12, decimal=2147483647))))
    root = tmp_path / "lake"
    command = [
        sys.executable,
        "-m",
        "consumer",
        "run",
        "--source",
        f"file:{capture(tmp_path / 'c.jsonl', values)}",
    ]
    result = subprocess.run(
        [*command, "--sink", f"delta:{root}", "--until-idle", "0.5"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [d["reason_code"] for d in dead_letters(root)] == ["schema-rejected", "schema-rejected"]
    assert changelog_offsets(root) == valid


# -- valid tables the issue found unwritable ------------------------------------------------------------
ODD_NAMES = (
    "_offset",
    "__offset",
    "_Deleted",
    "_change_type",
    "_COMMIT_TS",
    'a"b',
    "a`b",
    "a b",
    "ü名",
    "a,b;c",
)
ODD = TableSchema(
    "shop",
    "odd",
    30,
    TS - 5,
    (Column("id", DataType("int", length=11), nullable=False), *(Column(n, TEXT) for n in ODD_NAMES)),
    (Index("primary", True, True, False, ("id",)),),
)
STORED = (
    "__offset",
    "___offset",
    "__Deleted",
    "__change_type",
    "__COMMIT_TS",
    'a"b',
    "a`b",
    "a b",
    "ü名",
    "a,b;c",
)


def _odd_stream(tmp_path: Path) -> Path:
    rows = [dml(ODD, n, **{name: f"{name}-{n}" for name in ODD_NAMES}) for n in (1, 2)]
    return capture(tmp_path / "odd.jsonl", [bootstrap(ODD), *rows, watermark()])


def _expected_rows() -> list[dict[str, Any]]:
    return [
        {"id": n, **{s: f"{name}-{n}" for name, s in zip(ODD_NAMES, STORED, strict=True)}} for n in (1, 2)
    ]


def _by_id(row: dict[str, Any]) -> int:
    return int(row["id"])


def test_metadata_named_and_odd_columns_land_in_delta(tmp_path: Path) -> None:
    root = tmp_path / "lake"
    result = run(_odd_stream(tmp_path), f"delta:{root}")
    assert result.exit_code == 0, result.output
    changelog = read_changelog(root, "shop", "odd")
    assert changelog is not None
    assert sorted(changelog.select(["id", *STORED]).to_pylist(), key=_by_id) == _expected_rows()
    assert sorted(changelog["_offset"].to_pylist()) == [1, 2]
    mirror = read_mirror(root, "shop", "odd")
    assert mirror is not None
    assert sorted(mirror.select(["id", *STORED]).to_pylist(), key=_by_id) == _expected_rows()
    assert mirror.num_rows == 2


def test_metadata_named_and_odd_columns_land_in_parquet_and_spark(tmp_path: Path, spark: Any) -> None:
    from consumer.spark.readers import read_changelog

    root = tmp_path / "lake"
    result = run(_odd_stream(tmp_path), f"parquet:{root}")
    assert result.exit_code == 0, result.output
    frame = read_changelog(spark, root, "shop", "odd", format="parquet")
    assert frame.columns[: len(STORED) + 1] == ["id", *STORED]
    quoted = [f"`{name.replace('`', '``')}`" for name in STORED]
    rows = [row.asDict() for row in frame.select("id", *quoted).orderBy("id").collect()]
    assert rows == _expected_rows()
    assert sorted(row["_offset"] for row in frame.select("_offset").collect()) == [1, 2]
