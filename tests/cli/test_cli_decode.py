"""`ticdc-consumer decode`: one JSON line per message, DMLs held until their schema, exit codes 0/2/3."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

EXAMPLES = Path(str(resources.files("consumer") / "examples"))


def _decode(*paths: Path | str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "consumer", "decode", *map(str, paths)],
        capture_output=True,
        text=True,
        check=False,
    )


def test_decodes_examples_in_stream_order_holding_the_dml_before_its_bootstrap() -> None:
    result = _decode(*sorted((EXAMPLES / "json").iterdir()))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["kind"], line.get("type")) for line in lines] == [
        ("BOOTSTRAP", None),
        ("DML", "INSERT"),
        ("DML", "UPDATE"),
        ("WATERMARK", None),
        ("DML", "DELETE"),
    ]
    insert = lines[1]
    assert insert["data"] == {
        "id": 1,
        "customer": "Zoë",
        "amount": "19.90",
        "status": "new",
        "created": "2026-11-22T08:00:00.123000",
        "updated": "2026-11-22T08:00:00+00:00",
        "note": {"gift": True},
        "wait": "30:00:05",
    }
    assert insert["old"] is None
    assert lines[2]["old"]["status"] == "new" and lines[2]["data"]["status"] == "paid"


def test_avro_examples_decode_to_the_same_lines_as_json() -> None:
    json_lines = _decode(*sorted((EXAMPLES / "json").iterdir())).stdout
    avro_lines = _decode(*sorted((EXAMPLES / "avro").iterdir())).stdout
    assert avro_lines == json_lines


def test_bad_file_is_reported_and_processing_continues(tmp_path: Path) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b'{"version":1,"type":"WATERMARK","commitTs":')
    result = _decode(bad, EXAMPLES / "json" / "04-watermark.bin")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and str(bad) in result.stderr and "invalid JSON" in result.stderr
    assert json.loads(result.stdout)["kind"] == "WATERMARK"


def test_dml_whose_schema_never_arrives_exits_3() -> None:
    result = _decode(EXAMPLES / "json" / "01-dml.bin", EXAMPLES / "json" / "04-watermark.bin")
    assert result.returncode == 3
    assert "1 DML(s) of shop.orders" in result.stderr
    assert [json.loads(line)["kind"] for line in result.stdout.splitlines()] == ["WATERMARK"]
