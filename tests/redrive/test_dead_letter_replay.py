"""`ticdc-consumer dead-letters list|replay`: records set aside for a cause fixed later (a claim-check root
missing, a writer schema the registry did not know yet, a schema that arrived after the pending timeout)
are applied once it is fixed; the lake then equals the ground truth, a second replay commits nothing, a
record that fails again keeps a letter with its new reason, and an old change never overwrites a newer one.
File, object-store and Kafka dead-letter destinations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from captures import TS, keyed_table
from click.testing import CliRunner
from lakehouse_checks import changelog_duplicates, versions

from consumer import app
from consumer.cli import main
from consumer.config import RunConfig, load_config
from consumer.errors import DeadLetter, RecordLocation
from consumer.lakehouse.tables import read_mirror
from consumer.protocol.model import DDL, DML, Bootstrap, DMLType, Watermark
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import AvroOptions
from consumer.redrive.outcomes import SIDE_LOG
from consumer.simulate.output import AvroStream, write_capture_file, write_ground_truth
from consumer.simulate.truth import delta_mirror_state, differences, load_truth
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.dead_letter import DeadLetterFile, letter_of_record, read_letters
from consumer.sources.capture import read_capture, write_capture
from consumer.sources.record import SourceRecord
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.registry import LocalSchemaRegistry


def _cli(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def _consume(capture: Path, sink: str, config: str = "", **decode: Any) -> RunConfig:
    """`run` over a capture file into `sink`; the configuration it ran with."""
    config_path = capture.with_suffix(".toml")
    config_path.write_text(config)
    overrides = {"source": {"url": f"file:{capture}"}, "sink": {"url": sink}, "decode": decode}
    loaded = load_config(config_path, overrides=overrides, environ={})
    app.run(loaded, until_idle=0.5)
    return loaded


def _listed(*args: str) -> list[dict[str, Any]]:
    return json.loads(_cli("dead-letters", "list", "--json", *args))  # type: ignore[no-any-return]


def _replayed(*args: str, code: int = 0) -> dict[str, Any]:
    return json.loads(_cli("dead-letters", "replay", "--json", *args, code=code))  # type: ignore[no-any-return]


def _mirror_differences(root: str, workload: Workload, truth: dict[str, Any]) -> list[str]:
    return differences(delta_mirror_state(root, [t.schema for t in workload.tables]), truth)


# -- (a) claim-checks without a claim-check root -----------------------------------------------------------
def _claim_checked(tmp_path: Path) -> tuple[Path, Path, Path]:
    capture, truth, claims = tmp_path / "capture.jsonl", tmp_path / "truth.json", tmp_path / "claims"
    command = [
        sys.executable, "-m", "consumer", "simulate", "--topic", "shop", "--out", str(capture), "--truth",
        str(truth), "--rows", "600", "--tables", "3", "--max-message-bytes", "850", "--large-message",
        "claim-check", "--claim-check-uri", f"file://{claims}", "--no-ddl",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True)
    return capture, truth, claims


@pytest.mark.parametrize("store", ["local", "s3"])
def test_claim_checks_set_aside_without_a_root_apply_once_it_is_configured(
    tmp_path: Path, store: str, request: pytest.FixtureRequest
) -> None:
    root = request.getfixturevalue("s3_lake") if store == "s3" else str(tmp_path / "lake")
    capture, truth_path, claims = _claim_checked(tmp_path)
    _consume(capture, f"delta:{root}")
    letters = _listed("--sink", root)
    assert letters and {x["reason_code"] for x in letters} == {"claim-check-not-allowed"}
    assert not any(x["resolved"] for x in letters)
    truth = load_truth(truth_path)
    workload = Workload(WorkloadConfig(rows=600, tables=3, ddl=False))  # the simulated tables
    for _ in workload.records():
        pass
    assert _mirror_differences(root, workload, truth) != []  # the large rows are missing

    fixed = tmp_path / "fixed.toml"
    fixed.write_text(f'[large_messages]\nclaim_check_roots = ["file://{claims}"]\n')
    report = _replayed("--sink", root, "--config", str(fixed))
    assert report["resolved"] == len(letters) and report["failed"] == []
    assert _mirror_differences(root, workload, truth) == []
    assert changelog_duplicates(root) == 0
    assert all(x["resolved"] for x in _listed("--sink", root))

    before = versions(root)
    assert _replayed("--sink", root, "--config", str(fixed))["runs"] == []  # nothing left to replay
    assert versions(root) == before


def test_a_replay_stopped_before_its_end_is_finished_once(tmp_path: Path) -> None:
    """A run without its `done` record (a crash after its commits) is finished under its own group: the
    sinks skip what it applied, and its letters are resolved."""
    root = str(tmp_path / "lake")
    capture, _, claims = _claim_checked(tmp_path)
    _consume(capture, f"delta:{root}")
    fixed = tmp_path / "fixed.toml"
    fixed.write_text(f'[large_messages]\nclaim_check_roots = ["file://{claims}"]\n')
    first = _replayed("--sink", root, "--config", str(fixed))
    before = versions(root)
    (Path(root) / SIDE_LOG / first["runs"][0] / "done.json").unlink()
    assert not any(x["resolved"] for x in _listed("--sink", root))
    again = _replayed("--sink", root, "--config", str(fixed))
    assert again["runs"] == first["runs"] and again["resolved"] == first["resolved"]
    assert versions(root) == before and changelog_duplicates(root) == 0
    assert all(x["resolved"] for x in _listed("--sink", root))


# -- (b) a writer schema the registry does not know yet ----------------------------------------------------
@pytest.mark.parametrize("destination", ["file", "kafka"])
def test_rows_of_a_schema_id_registered_later_apply_once_the_registry_knows_it(
    tmp_path: Path, destination: str, request: pytest.FixtureRequest
) -> None:
    workload = Workload(WorkloadConfig(rows=600, tables=3, partitions=2, dispatch="primary-key", ddl=False))
    root, capture = str(tmp_path / "lake"), tmp_path / "avro.jsonl"
    config = ""
    if destination == "kafka":
        broker: EmbeddedBroker = request.getfixturevalue("kafka_broker")
        letters_topic = request.getfixturevalue("kafka_topic")(1)
        config = f'[errors]\ndead_letter = "kafka://{broker.bootstrap_servers}/{letters_topic}"\n'
    with LocalSchemaRegistry() as registry:
        encoder = ConfluentAvroEncoder(
            SchemaRegistry(registry.url), AvroOptions(tidb_extension=True, watermark=True)
        )
        write_capture_file(workload, AvroStream(encoder, "shop"), "shop", capture)
        truth = write_ground_truth(workload, tmp_path / "truth.json")
        hidden = _hide_a_table(registry)
        avro = {"protocol": "avro", "schema_registry": registry.url}
        _consume(capture, f"delta:{root}", config, **avro)
        (tmp_path / "fixed.toml").write_text(config)
        where = ("--sink", root, "--config", str(tmp_path / "fixed.toml"))
        flags = (*where, "--protocol", "avro", "--schema-registry", registry.url)
        letters = _listed(*where)
        assert letters and {x["reason_code"] for x in letters} == {"schema-id-unknown"}

        failed = _replayed(*flags, code=3)  # still unknown: each letter fails again, and keeps its letter
        assert failed["resolved"] == 0 and len(failed["failed"]) == len(letters)
        assert [x["resolved"] for x in _listed(*where)] == [False] * len(letters)

        registry.store.texts.update(hidden)  # registered now
        report = _replayed(*flags)
        assert report["resolved"] == len(letters)
        assert _mirror_differences(root, workload, truth) == []
        before = versions(root)
        assert _replayed(*flags)["runs"] == [] and versions(root) == before
        assert changelog_duplicates(root) == 0


def _hide_a_table(registry: LocalSchemaRegistry) -> dict[int, str]:
    """Take one table's value schemas out of the registry (404 until put back); returns them."""
    subject = sorted(s for s in registry.store.subjects if s.endswith("-value"))[0]
    hidden = {i: registry.store.texts.pop(i) for i in registry.store.subjects[subject]}
    assert hidden
    return hidden


# -- (c) DMLs whose schema arrived after the pending timeout -----------------------------------------------
def test_rows_whose_schema_came_after_the_timeout_apply_once_the_lake_recorded_it(tmp_path: Path) -> None:
    workload = Workload(WorkloadConfig(rows=600, tables=3, ddl=False, bootstrap_to_all_partitions=False))
    root, full = str(tmp_path / "lake"), tmp_path / "full.jsonl"
    write_capture_file(workload, MessageEncoder(), "shop", full)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    late_table = workload.tables[1].schema.table
    records, late = _without_schemas_of(full, late_table)
    early = tmp_path / "early.jsonl"
    with early.open("wb") as out:
        write_capture(records, out)
    impatient = "[budget]\npending_timeout_s = 0.0\nmax_batch_records = 50\n"
    _consume(early, f"delta:{root}", impatient)
    letters = _listed("--sink", root)
    assert letters and {x["reason_code"] for x in letters} == {"schema-not-found"}

    failed = _replayed("--sink", root, code=3)  # the lake knows no schema for them yet
    assert len(failed["failed"]) == len(letters) and failed["resolved"] == 0
    assert {x["reason_code"] for x in _listed("--sink", root)} == {"schema-not-found"}

    with (tmp_path / "later.jsonl").open("wb") as out:  # the stream goes on: the schema arrives
        write_capture([*records, late], out)
    _consume(tmp_path / "later.jsonl", f"delta:{root}", impatient)
    assert _replayed("--sink", root)["resolved"] == len(letters)
    assert _mirror_differences(root, workload, truth) == []
    before = versions(root)
    assert _replayed("--sink", root)["runs"] == [] and versions(root) == before
    assert _replayed("--sink", root, "--reason", "schema-not-found")["runs"] == []


def _without_schemas_of(capture: Path, table: str) -> tuple[list[SourceRecord], SourceRecord]:
    """The capture without `table`'s BOOTSTRAPs and DDLs, and its last BOOTSTRAP as a record after it."""
    decoder = MessageDecoder()
    kept, last = [], None
    for record in read_capture(capture):
        message = decoder.decode(record.value)
        if (
            isinstance(message, Bootstrap | DDL)
            and message.table_schema
            and message.table_schema.table == table
        ):
            last = message if isinstance(message, Bootstrap) else last
            continue
        kept.append(record)
    assert last is not None
    end = max(r.offset for r in kept if r.partition == 0) + 1
    return kept, SourceRecord("shop", 0, end, value=MessageEncoder().encode(last))


# -- never older over newer --------------------------------------------------------------------------------
def test_an_older_replayed_change_never_overwrites_a_newer_one(tmp_path: Path) -> None:
    """Keys 1 and 2 were changed after the changes set aside: a replay leaves the newer row of key 1 and
    does not bring key 2 back; key 3, changed by nothing else, gets its replayed row."""
    root, capture = tmp_path / "lake", tmp_path / "stream.jsonl"
    schema = keyed_table("items", 1)
    encoder = MessageEncoder()

    def dml(kind: DMLType, key: int, ts: int) -> bytes:
        image = {"id": key}
        data, old = (None, image) if kind is DMLType.DELETE else (image, None)
        row = DML(type=kind, database="shop", table="items", table_id=1, commit_ts=ts, build_ts=0,
                  schema_version=1, data=data, old=old)  # fmt: skip
        return encoder.encode(row, schema)

    values = [
        encoder.encode(Bootstrap(table_schema=schema, build_ts=0)),
        dml(DMLType.INSERT, 1, TS + 10),
        dml(DMLType.INSERT, 2, TS + 11),
        dml(DMLType.DELETE, 2, TS + 20),
        encoder.encode(Watermark(commit_ts=TS + 100, build_ts=0)),
    ]
    with capture.open("wb") as out:
        write_capture((SourceRecord("t", 0, offset, value=v) for offset, v in enumerate(values)), out)
    _consume(capture, f"delta:{root}")
    letters = DeadLetterFile(root / "_dead_letters.jsonl")
    for offset, (kind, key, ts) in enumerate([(DMLType.DELETE, 1, TS + 5), (DMLType.INSERT, 2, TS + 6)]):
        letters.write(DeadLetter(RecordLocation("t", 1, offset), "set aside", dml(kind, key, ts), "test"))
    letters.write(DeadLetter(RecordLocation("t", 1, 2), "set aside", dml(DMLType.INSERT, 3, TS + 7), "test"))
    letters.close()

    assert _replayed("--sink", str(root))["resolved"] == 3
    mirror = read_mirror(root, "shop", "items")
    assert mirror is not None
    assert sorted(zip(mirror["id"].to_pylist(), mirror["_commit_ts"].to_pylist(), strict=True)) == [
        (1, TS + 10),
        (3, TS + 7),
    ]


# -- the letter format ------------------------------------------------------------------------------------
def test_letters_read_back_with_their_key_and_old_letters_still_read(tmp_path: Path) -> None:
    path = tmp_path / "letters.jsonl"
    path.write_text(  # a letter from before keys, a torn line
        '{"topic":"t","partition":0,"offset":3,"reason":"r","value":"AAE=","reason_code":"c"}\n{"topic":"t"\n'
    )
    letters = DeadLetterFile(path)
    letters.write(DeadLetter(RecordLocation("t", 0, 5), "why", b"value", "code", key=b"key"))
    letters.close()
    read = [(x.offset, x.key, x.value, x.reason_code) for x in read_letters(str(path))]
    assert read == [(3, None, b"\x00\x01", "c"), (5, b"key", b"value", "code")]


def test_a_kafka_letter_names_its_origin_in_headers_old_ones_in_the_source_header() -> None:
    headers = {"ticdc.topic": b"a[b]@c", "ticdc.partition": b"2", "ticdc.offset": b"7", "ticdc.reason": b"r"}
    letter = letter_of_record(b"k", b"v", headers)
    assert (letter.topic, letter.partition, letter.offset, letter.key) == ("a[b]@c", 2, 7, b"k")
    old = letter_of_record(None, b"v", {"ticdc.source": b"shop[1]@42", "ticdc.reason_code": b"x"})
    assert (old.topic, old.partition, old.offset, old.reason_code) == ("shop", 1, 42, "x")
    with pytest.raises(ValueError):
        letter_of_record(None, b"v", {})
