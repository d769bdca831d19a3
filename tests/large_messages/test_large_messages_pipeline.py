"""Large messages and row integrity through the whole consumer: the simulator writes claim-check,
handle-key-only and checksummed streams as TiCDC does; `run` applies every row whole and verified, or sets
it aside with a machine-readable reason, or stops on a storage outage without committing past the row."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest

from consumer import app
from consumer.config import load_config
from consumer.errors import ClaimCheckUnavailableError
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import produce_to_kafka, write_ground_truth
from consumer.simulate.truth import delta_mirror_state, differences, load_truth, replay_changelog
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.capture import read_capture, write_capture
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.s3 import LocalS3Server

ROWS = 1500
# Per encoding and compression, a limit the all-types table's DMLs exceed and the narrow tables' do not:
# with three tables, about a third of the rows take the large-message path.
MAX_MESSAGE_BYTES = {("json", "none"): 850, ("json", "lz4"): 600, ("avro", "snappy"): 350}


def _cli(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "consumer", *args], capture_output=True, text=True, check=False
    )
    if ok:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def _simulate(
    tmp_path: Path, *options: str, encoding: str = "json", compression: str = "none"
) -> tuple[Path, Path]:
    capture, truth = tmp_path / "capture.jsonl", tmp_path / "truth.json"
    limit = MAX_MESSAGE_BYTES[(encoding, compression)]
    _cli(
        "simulate", "--topic", "shop", "--out", str(capture), "--truth", str(truth), "--rows", str(ROWS),
        "--tables", "3", "--max-message-bytes", str(limit), "--encoding", encoding, "--compression",
        compression, *options,
    )  # fmt: skip
    return capture, truth


def _run(tmp_path: Path, capture: Path, config: str = "") -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    (tmp_path / "run.toml").write_text(config)
    ran = _cli(
        "run", "--source", f"file:{capture}", "--sink", f"jsonl:{out}", "--until-idle", "0.5",
        "--config", str(tmp_path / "run.toml"),
    )  # fmt: skip
    return ran, out


def _mirror_differences(out: Path, truth: Path) -> list[str]:
    rows = {
        f"{p.parent.name}.{p.stem}": [json.loads(x) for x in p.read_text().splitlines()]
        for p in out.glob("*/*.jsonl")
    }
    ddls = [json.loads(x) for x in (out / "_ddl.jsonl").read_text().splitlines()]
    return differences(replay_changelog(rows, ddls), load_truth(truth))


def _dead_letters(out: Path) -> list[dict[str, Any]]:
    path = out / "_dead_letters.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    ("encoding", "compression", "raw_value"), [("json", "lz4", False), ("avro", "snappy", True)]
)
def test_a_claim_checked_stream_on_local_files_equals_the_ground_truth(
    tmp_path: Path, encoding: str, compression: str, raw_value: bool
) -> None:
    claims = tmp_path / "claims"
    raw = ["--claim-check-raw-value"] if raw_value else []
    capture, truth = _simulate(
        tmp_path, "--large-message", "claim-check", "--claim-check-uri", f"file://{claims}", "--checksum",
        *raw, encoding=encoding, compression=compression,
    )  # fmt: skip
    objects = len(list(claims.iterdir()))
    assert 0.25 * ROWS < objects < 0.45 * ROWS  # about a third of the rows
    ran, out = _run(tmp_path, capture, f'[large_messages]\nclaim_check_roots = ["file://{claims}"]\n')
    assert "0 dead letters" in ran.stdout, ran.stdout
    assert f"large messages: {objects} claim-checks fetched" in ran.stdout
    verified = int(ran.stdout.split("checksums: ")[1].split(" ")[0])
    assert verified > ROWS  # every image of every row (an UPDATE has two)
    assert _mirror_differences(out, truth) == []


def test_without_roots_claim_checks_are_set_aside_with_their_reason(tmp_path: Path) -> None:
    claims = tmp_path / "claims"
    capture, _ = _simulate(
        tmp_path, "--large-message", "claim-check", "--claim-check-uri", f"file://{claims}"
    )
    objects = len(list(claims.iterdir()))
    ran, out = _run(tmp_path, capture)
    assert f"{objects} dead letters" in ran.stdout
    letters = _dead_letters(out)
    assert {letter["reason_code"] for letter in letters} == {"claim-check-not-allowed"}
    assert all("claim-check location not allowed" in letter["reason"] for letter in letters)
    assert "large messages:" not in ran.stdout  # nothing was fetched


def test_handle_key_only_rows_are_set_aside_never_applied_as_rows(tmp_path: Path) -> None:
    capture, _ = _simulate(tmp_path, "--large-message", "handle-key-only")
    key_only = sum(1 for r in read_capture(capture) if r.value and b'"handleKeyOnly":true' in r.value)
    assert key_only > 0.25 * ROWS
    ran, out = _run(tmp_path, capture)
    letters = _dead_letters(out)
    assert len(letters) == key_only and f"{key_only} dead letters" in ran.stdout
    assert {letter["reason_code"] for letter in letters} == {"handle-key-only"}
    assert all("handle-key-only row needs an upstream lookup" in letter["reason"] for letter in letters)
    set_aside = {(letter["partition"], letter["offset"]) for letter in letters}
    changelog = [json.loads(x) for p in out.glob("*/*.jsonl") for x in p.read_text().splitlines()]
    assert not set_aside & {(row["_partition"], row["_offset"]) for row in changelog}  # none reached a table


def _tampered(capture: Path, target: Path, change: Any) -> list[tuple[int, int]]:
    """The capture with `change(message)` applied to the first checksummed UPDATE of each partition."""
    changed: list[tuple[int, int]] = []
    records = []
    for record in read_capture(capture):
        message = json.loads(record.value) if record.value else {}
        partition_done = any(p == record.partition for p, _ in changed)
        if message.get("type") == "UPDATE" and message.get("checksum") and not partition_done:
            change(message)
            record = msgspec.structs.replace(record, value=json.dumps(message).encode())
            changed.append((record.partition, record.offset))
        records.append(record)
    with target.open("wb") as fp:
        write_capture(records, fp)
    return changed


def _corrupt(message: dict[str, Any]) -> None:
    message["checksum"]["corrupted"] = True


def _change_a_value(message: dict[str, Any]) -> None:
    message["data"]["id"] = str(int(message["data"]["id"]) + 10**9)  # the key itself: a different row


@pytest.mark.parametrize(
    ("change", "code"), [(_corrupt, "checksum-corrupted"), (_change_a_value, "checksum-mismatch")]
)
def test_rows_failing_verification_are_set_aside_and_counted(tmp_path: Path, change: Any, code: str) -> None:
    capture, truth = _simulate(tmp_path, "--checksum", "--no-ddl")
    tampered = _tampered(capture, tmp_path / "tampered.jsonl", change)
    assert tampered
    ran, out = _run(tmp_path, tmp_path / "tampered.jsonl")
    letters = _dead_letters(out)
    assert sorted((letter["partition"], letter["offset"]) for letter in letters) == sorted(tampered)
    assert {letter["reason_code"] for letter in letters} == {code}
    if code == "checksum-mismatch":
        assert all("on the new image: TiCDC sent current=" in letter["reason"] for letter in letters)
    assert f"{len(tampered)} rows failed verification" in ran.stdout
    assert len(_mirror_differences(out, truth)) <= len(tampered)  # only the rows set aside differ


def test_integrity_verification_can_be_turned_off(tmp_path: Path) -> None:
    capture, _ = _simulate(tmp_path, "--checksum", "--no-ddl")
    _tampered(capture, tmp_path / "tampered.jsonl", _change_a_value)
    ran, _ = _run(tmp_path, tmp_path / "tampered.jsonl", "[integrity]\nverify_checksums = false\n")
    assert "0 dead letters" in ran.stdout and "checksums:" not in ran.stdout


@pytest.mark.slow  # the S3 client's own retries against a closed port take ~6 s a read
def test_a_storage_outage_stops_the_consumer_before_any_commit_past_the_row(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture, _ = _simulate(
        tmp_path, "--large-message", "claim-check", "--claim-check-uri", f"file://{tmp_path}/c"
    )
    first_claim = next(r for r in read_capture(capture) if r.value and b"claimCheckLocation" in r.value)
    # the objects were written locally, but the consumer reads them from an S3 endpoint that is down
    relocated = tmp_path / "relocated.jsonl"
    with relocated.open("wb") as fp:
        write_capture(
            (
                msgspec.structs.replace(
                    r, value=r.value.replace(f"file://{tmp_path}/c".encode(), b"s3://bucket/c")
                )
                if r.value
                else r
                for r in read_capture(capture)
            ),
            fp,
        )
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    (tmp_path / "run.toml").write_text(
        '[large_messages]\nclaim_check_roots = ["s3://bucket/c"]\nfetch_retries = 0\nfetch_concurrency = 1\n'
        f'[source]\nurl = "file:{relocated}"\n[sink]\nurl = "jsonl:{tmp_path / "out"}"\n'
        "[budget]\nmax_batch_records = 40\n[parallelism]\ndecode_workers = 0\n"
    )
    config = load_config(tmp_path / "run.toml")
    pipeline = app.build_pipeline(config)
    source = app.build_source(config, pipeline)
    try:
        with pytest.raises(ClaimCheckUnavailableError, match="failed 1 times"):
            pipeline.run(source, until_idle=0.5)
        committed = source.committed([(first_claim.topic, first_claim.partition)])
    finally:
        source.close()
        pipeline.close()
    assert (committed[(first_claim.topic, first_claim.partition)] or 0) <= first_claim.offset
    assert _dead_letters(tmp_path / "out") == []


@pytest.mark.slow
def test_a_third_claim_checked_on_s3_through_kafka_into_delta_equals_the_ground_truth(
    kafka_broker: EmbeddedBroker, kafka_topic: Any, s3_server: LocalS3Server, tmp_path: Path
) -> None:
    from consumer.large_messages.claim_check import ClaimCheckWriter
    from consumer.large_messages.encoder import LargeMessageEncoder

    s3_server.create_bucket("ticdc-claims")
    topic = kafka_topic(3)
    workload = Workload(
        WorkloadConfig(rows=ROWS, tables=3, partitions=3, dispatch="primary-key", checksums=True)
    )
    writer = ClaimCheckWriter(f"s3://ticdc-claims/{topic}/cc?allow_delayed_open=true")  # one PUT an object
    limit = MAX_MESSAGE_BYTES[("json", "lz4")]
    encoder = LargeMessageEncoder(MessageEncoder("json", "lz4"), "claim-check", limit, writer)
    produce_to_kafka(workload, encoder, kafka_broker.bootstrap_servers, topic)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    (tmp_path / "run.toml").write_text(
        f'[large_messages]\nclaim_check_roots = ["s3://ticdc-claims/{topic}/cc"]\n'
    )
    root = tmp_path / "lake"
    ran = _cli(
        "run", "--source", f"kafka://{kafka_broker.bootstrap_servers}/{topic}", "--group", f"{topic}.lake",
        "--sink", f"delta:{root}", "--until-idle", "3", "--config", str(tmp_path / "run.toml"),
    )  # fmt: skip
    assert "0 dead letters" in ran.stdout, ran.stdout + ran.stderr[-2000:]
    fetched = int(ran.stdout.split("large messages: ")[1].split(" ")[0])
    assert 0.25 * ROWS < fetched < 0.45 * ROWS
    state = delta_mirror_state(root, (table.schema for table in workload.tables))
    assert differences(state, truth) == []
