"""Claim-checks (spec §7.2): locations outside the configured roots are refused and never opened (local
files and the S3 protocol), objects round-trip exactly as TiCDC writes them under every compression and
both envelope modes, and a row that cannot be made whole says why."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow.fs as pafs
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.cli import main
from consumer.errors import (
    ClaimCheckInvalidError,
    ClaimCheckMissingError,
    ClaimCheckNotAllowedError,
    ClaimCheckTooLargeError,
    ClaimCheckUnavailableError,
    EncodeError,
    HandleKeyOnlyError,
    RecordLocation,
)
from consumer.large_messages.claim_check import ClaimCheckWriter, unwrap
from consumer.large_messages.encoder import LargeMessageEncoder, key_only_dml
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.protocol.model import (
    DML,
    Bootstrap,
    Column,
    DataType,
    DMLType,
    Index,
    KeyOnlyDML,
    RawDML,
    TableSchema,
)
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.state.machine import ConsumerState
from consumer.testing.s3 import LocalS3Server
from consumer.testing.strategies import dml_messages, table_schemas

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class CountingHandler(pafs.FileSystemHandler):
    """A local filesystem that counts the files it opens, and fails the first `failures` opens."""

    def __init__(self, failures: int = 0) -> None:
        self.local = pafs.LocalFileSystem()
        self.opened: list[str] = []
        self.failures = failures

    def _opening(self, path: str) -> None:
        self.opened.append(path)
        if self.failures:
            self.failures -= 1
            raise OSError("simulated storage outage")

    def open_input_stream(self, path: str) -> Any:
        self._opening(path)
        return self.local.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        self._opening(path)
        return self.local.open_input_file(path)

    def get_type_name(self) -> str:
        return "counting"

    def get_file_info(self, paths: Any) -> Any:
        return self.local.get_file_info(paths)

    def get_file_info_selector(self, selector: Any) -> Any:
        return self.local.get_file_info(selector)

    def normalize_path(self, path: str) -> str:
        return path

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return self.local.open_output_stream(path)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        raise OSError("read-only")

    def create_dir(self, path: str, recursive: bool) -> None:
        raise OSError("read-only")

    def delete_dir(self, path: str) -> None:
        raise OSError("read-only")

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        raise OSError("read-only")

    def delete_root_dir_contents(self) -> None:
        raise OSError("read-only")

    def delete_file(self, path: str) -> None:
        raise OSError("read-only")

    def move(self, src: str, dest: str) -> None:
        raise OSError("read-only")

    def copy_file(self, src: str, dest: str) -> None:
        raise OSError("read-only")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A claim-check root with one object, and hostile neighbours: a sibling directory sharing its name as
    a prefix, symlinks leading out, a FIFO and an oversized object."""
    root = tmp_path / "cc"
    root.mkdir()
    (root / "ok.json").write_bytes(b"payload")
    (tmp_path / "cc2").mkdir()
    (tmp_path / "cc2" / "x.json").write_bytes(b"sibling")
    (root / "link.json").symlink_to("/etc/passwd")
    (root / "etc").symlink_to("/etc")
    os.mkfifo(root / "fifo.json")
    (root / "big.json").write_bytes(b"x" * 2048)
    (root / "bomb.gz").write_bytes(gzip.compress(b"x" * 1_000_000))  # read as stored, never inflated
    return root


def _store(handler: CountingHandler, *roots: str, **options: Any) -> ClaimCheckStore:
    filesystem = pafs.PyFileSystem(handler)
    return ClaimCheckStore.from_uris(roots, filesystems=dict.fromkeys(roots, filesystem), **options)


def test_an_object_under_the_root_is_read(root: Path) -> None:
    handler = CountingHandler()
    store = _store(handler, f"file://{root}", max_object_bytes=1024)
    assert store.read(f"file://{root}/ok.json") == b"payload"
    assert handler.opened == [str(root / "ok.json")]
    assert (store.stats.fetches, store.stats.bytes) == (1, 7)
    real = ClaimCheckStore.from_uris([f"file://{root}"], max_object_bytes=2048)
    assert real.read(f"file://{root}/bomb.gz") == (root / "bomb.gz").read_bytes()


def _hostile(root: Path) -> list[tuple[str, type[Exception], str]]:
    return [
        ("file:///etc/passwd", ClaimCheckNotAllowedError, "is under no claim_check_roots"),
        (f"file://{root}/../../etc/passwd", ClaimCheckNotAllowedError, "`.` or `..` segments"),
        (f"file://{root}/./ok.json", ClaimCheckNotAllowedError, "`.` or `..` segments"),
        ("../../ok.json", ClaimCheckNotAllowedError, "not a storage scheme"),
        (f"file://{root}2/x.json", ClaimCheckNotAllowedError, "is under no claim_check_roots"),
        (f"file://{root}", ClaimCheckNotAllowedError, "is under no claim_check_roots"),
        (f"file://{root}/link.json", ClaimCheckNotAllowedError, "a symlink leads out"),
        (f"file://{root}/etc/passwd", ClaimCheckNotAllowedError, "a symlink leads out"),
        (f"file://evil.example/{root}/ok.json", ClaimCheckNotAllowedError, "names no host"),
        (f"http://127.0.0.1:1/{root}/ok.json", ClaimCheckNotAllowedError, "not a storage scheme"),
        ("https://example.com/ok.json", ClaimCheckNotAllowedError, "not a storage scheme"),
        (f"s3://bucket{root}/ok.json", ClaimCheckNotAllowedError, "is under no claim_check_roots"),
        (f"file://{root}/ok.json?x=1", ClaimCheckNotAllowedError, "no query"),
        (f"file://{root}/%2e%2e/ok.json", ClaimCheckNotAllowedError, "only plain names"),
        (f"file://{root}/{'a' * 1100}.json", ClaimCheckNotAllowedError, "at most 1024 characters"),
        (f"file://{root}/fifo.json", ClaimCheckMissingError, "not a regular file"),
        (f"file://{root}/big.json", ClaimCheckTooLargeError, "larger than max_object_bytes (1024)"),
        (f"file://{root}/missing.json", ClaimCheckMissingError, "does not exist"),
    ]


def test_locations_outside_the_roots_are_refused_and_never_opened(root: Path) -> None:
    handler = CountingHandler()
    store = _store(handler, f"file://{root}", max_object_bytes=1024)
    for location, error, reason in _hostile(root):
        with pytest.raises(error, match=reason.replace("(", r"\(").replace(")", r"\)")) as raised:
            store.read(location)
        assert raised.value.code.startswith("claim-check-"), location
    assert handler.opened == []
    assert store.stats.fetches == 0 and store.stats.refused == 15


def test_without_roots_every_claim_check_is_refused(root: Path) -> None:
    handler = CountingHandler()
    store = _store(handler)
    with pytest.raises(ClaimCheckNotAllowedError, match="claim-check location not allowed") as raised:
        store.read(f"file://{root}/ok.json")
    assert raised.value.code == "claim-check-not-allowed"
    assert handler.opened == []


def test_the_root_override_reads_the_base_name_from_its_root(root: Path) -> None:
    handler = CountingHandler()
    store = ClaimCheckStore.from_uris(
        [], f"file://{root}", filesystems={f"file://{root}": pafs.PyFileSystem(handler)}
    )
    assert store.read("s3://moved-away/old/prefix/ok.json") == b"payload"
    for location in ("s3://moved-away/old/..", "s3://moved-away/", "http://h/x.json", "file:///x/.hidden"):
        with pytest.raises(ClaimCheckNotAllowedError):
            store.read(location)
    with pytest.raises(ClaimCheckNotAllowedError, match="a symlink leads out"):
        store.read("s3://moved-away/link.json")
    assert handler.opened == [str(root / "ok.json")]


def test_transient_storage_errors_are_retried_then_stop_the_consumer(root: Path) -> None:
    flaky = CountingHandler(failures=2)
    store = _store(flaky, f"file://{root}", retries=2)
    assert store.read(f"file://{root}/ok.json") == b"payload"
    assert (len(flaky.opened), store.stats.retries) == (3, 2)
    down = CountingHandler(failures=10)
    with pytest.raises(ClaimCheckUnavailableError, match="failed 3 times"):
        _store(down, f"file://{root}", retries=2).read(f"file://{root}/ok.json")


# -- round trips -------------------------------------------------------------------------------------------
def _decoded(value: bytes, schema: TableSchema) -> DML:
    raw = MessageDecoder().decode(value)
    assert isinstance(raw, RawDML)
    return TableCodec(schema).decode(raw)


def _round_trip(
    store_root: str, writer: ClaimCheckWriter, encoder: MessageEncoder, dml: DML, schema: TableSchema
) -> DML:
    """claim-check(encode(dml)), then resolved by a consumer reading `store_root`."""
    location = writer.write(encoder.encode(dml, schema))
    key_only = MessageDecoder().decode(encoder.encode(key_only_dml(dml, schema, location), schema))
    assert isinstance(key_only, KeyOnlyDML) and key_only.claim_check_location == location
    resolver = LargeMessageResolver(MessageDecoder(), ClaimCheckStore.from_uris([store_root]))
    try:
        (resolved,) = resolver.resolve([key_only])
    finally:
        resolver.close()
    assert isinstance(resolved, RawDML), resolved
    assert resolved.commit_ts == dml.commit_ts and resolved.type == dml.type
    return TableCodec(schema).decode(resolved)


@st.composite
def _dmls(draw: st.DrawFn) -> tuple[TableSchema, DML]:
    schema = draw(table_schemas(max_columns=6))
    dml = draw(dml_messages(schema))
    return schema, msgspec.structs.replace(dml, claim_check_location="", handle_key_only=False)


@PROPERTY
@given(
    _dmls(),
    st.sampled_from(["json", "avro"]),
    st.sampled_from(["none", "snappy", "lz4"]),
    st.booleans(),
)
def test_a_claim_checked_row_resolves_to_itself(
    tmp_path_factory: pytest.TempPathFactory,
    pair: tuple[TableSchema, DML],
    encoding: str,
    compression: str,
    raw: bool,
) -> None:
    schema, dml = pair
    directory = tmp_path_factory.mktemp("claims")
    writer = ClaimCheckWriter(f"file://{directory}/", raw_value=raw)
    encoder = MessageEncoder(encoding, compression)  # type: ignore[arg-type]
    assert _round_trip(f"file://{directory}", writer, encoder, dml, schema) == dml


def test_objects_are_written_as_ticdc_writes_them(tmp_path: Path) -> None:
    wrapped = ClaimCheckWriter(f"file://{tmp_path}/w/").write(b"\x04\x22\x4d\x18value")
    assert wrapped.startswith(f"file://{tmp_path}/w/") and wrapped.endswith(".json")
    stored = Path(wrapped.removeprefix("file://")).read_bytes()
    assert stored == b'{"key":null,"value":"BCJNGHZhbHVl"}'  # Go's json.Marshal of two []byte fields
    assert unwrap(stored) == unwrap(stored, False) == b"\x04\x22\x4d\x18value"
    raw = ClaimCheckWriter(f"file://{tmp_path}/r", raw_value=True).write(b"{}")
    assert Path(raw.removeprefix("file://")).read_bytes() == b"{}"
    with pytest.raises(ClaimCheckInvalidError, match="envelope"):
        unwrap(b'{"version":1}', raw_value=False)


def test_the_large_message_encoder_claim_checks_only_what_does_not_fit(tmp_path: Path) -> None:
    schema, dml = _sample()
    writer = ClaimCheckWriter(f"file://{tmp_path}")
    full = MessageEncoder().encode(dml, schema)
    assert (
        LargeMessageEncoder(MessageEncoder(), "claim-check", len(full) + 36, writer).encode(dml, schema)
        == full
    )
    assert not list(tmp_path.iterdir())
    claimed = MessageDecoder().decode(
        LargeMessageEncoder(MessageEncoder(), "claim-check", len(full) + 35, writer).encode(dml, schema)
    )
    assert isinstance(claimed, KeyOnlyDML)
    (stored,) = tmp_path.iterdir()
    assert claimed.claim_check_location == f"file://{tmp_path}/{stored.name}"
    assert TableCodec(schema).decode(claimed.row).data == {"id": 1}  # the handle key only
    key_only = LargeMessageEncoder(MessageEncoder(), "handle-key-only", len(full)).encode(dml, schema)
    decoded = MessageDecoder().decode(key_only)
    assert isinstance(decoded, KeyOnlyDML) and decoded.claim_check_location == ""
    with pytest.raises(EncodeError, match="exceeds max_message_bytes"):
        LargeMessageEncoder(MessageEncoder(), "none", len(full)).encode(dml, schema)


# -- rows that cannot be made whole ------------------------------------------------------------------------
SCHEMA = TableSchema(
    "shop",
    "orders",
    7,
    11,
    (
        Column("id", DataType("bigint"), nullable=False),
        Column("note", DataType("text", "utf8mb4", "utf8mb4_bin")),
    ),
    (Index("primary", True, True, False, ("id",)),),
)


def _sample(commit_ts: int = 5) -> tuple[TableSchema, DML]:
    dml = DML(
        type=DMLType.UPDATE,
        database="shop",
        table="orders",
        table_id=7,
        commit_ts=commit_ts,
        build_ts=1,
        schema_version=11,
        data={"id": 1, "note": "new " * 50},
        old={"id": 1, "note": "old"},
    )
    return SCHEMA, dml


def _key_only(schema: TableSchema, dml: DML, location: str = "") -> KeyOnlyDML:
    decoded = MessageDecoder().decode(MessageEncoder().encode(key_only_dml(dml, schema, location), schema))
    assert isinstance(decoded, KeyOnlyDML)
    return decoded


@pytest.fixture
def resolver(root: Path) -> Iterator[LargeMessageResolver]:
    resolver = LargeMessageResolver(MessageDecoder(), ClaimCheckStore.from_uris([f"file://{root}"]))
    yield resolver
    resolver.close()


def test_a_claim_check_of_another_row_is_refused(root: Path, resolver: LargeMessageResolver) -> None:
    schema, dml = _sample()
    other = msgspec.structs.replace(dml, commit_ts=dml.commit_ts + 1)
    location = ClaimCheckWriter(f"file://{root}").write(MessageEncoder().encode(other, schema))
    (result,) = resolver.resolve([_key_only(schema, dml, location)])
    assert isinstance(result, ClaimCheckInvalidError)
    assert "commit_ts differ" in result.reason and result.code == "claim-check-invalid"


def test_a_claim_check_pointing_at_a_key_only_message_is_refused(
    root: Path, resolver: LargeMessageResolver
) -> None:
    schema, dml = _sample()
    inner = MessageEncoder().encode(key_only_dml(dml, schema, "file:///elsewhere/x.json"), schema)
    location = ClaimCheckWriter(f"file://{root}").write(inner)
    (result,) = resolver.resolve([_key_only(schema, dml, location)])
    assert isinstance(result, ClaimCheckInvalidError) and "key-only DML" in result.reason


def test_handle_key_only_rows_need_an_upstream_lookup(resolver: LargeMessageResolver) -> None:
    schema, dml = _sample()
    (result,) = resolver.resolve([_key_only(schema, dml)])
    assert isinstance(result, HandleKeyOnlyError)
    assert result.code == "handle-key-only"
    assert result.reason.startswith("handle-key-only row needs an upstream lookup")


def test_results_keep_the_order_of_the_messages(root: Path, resolver: LargeMessageResolver) -> None:
    schema, dml = _sample()
    writer = ClaimCheckWriter(f"file://{root}")
    messages = []
    for offset in range(40):
        row = msgspec.structs.replace(dml, commit_ts=offset + 1)
        location = writer.write(MessageEncoder().encode(row, schema)) if offset % 3 else "file:///etc/passwd"
        messages.append(_key_only(schema, row, location))
    results = resolver.resolve(messages)
    assert [r.commit_ts for r in results if isinstance(r, RawDML)] == [o + 1 for o in range(40) if o % 3]
    assert all(isinstance(r, ClaimCheckNotAllowedError) for i, r in enumerate(results) if not i % 3)
    assert resolver.store.stats.fetches == 26


# -- the S3 protocol -----------------------------------------------------------------------------------------
def test_s3_locations_outside_the_root_are_refused_without_a_request(s3_server: LocalS3Server) -> None:
    s3_server.create_bucket("claims-allowed")
    s3_server.create_bucket("claims-other")
    writer = ClaimCheckWriter("s3://claims-allowed/ticdc/cc")
    inside = writer.write(b"inside")
    elsewhere = [
        ClaimCheckWriter("s3://claims-other/ticdc/cc").write(b"other bucket"),
        ClaimCheckWriter("s3://claims-allowed/ticdc/cc2").write(b"sibling prefix"),
        ClaimCheckWriter("s3://claims-allowed/ticdc").write(b"above the root"),
    ]
    store = ClaimCheckStore.from_uris(["s3://claims-allowed/ticdc/cc"])
    s3_server.start_recording()
    hostile = [
        *elsewhere,
        "s3://claims-allowed/ticdc/cc/../../ticdc/x.json",
        f"{s3_server.endpoint}/claims-allowed/ticdc/cc/{inside.rsplit('/', 1)[1]}",
        "gs://claims-allowed/ticdc/cc/x.json",
        "file:///etc/passwd",
    ]
    for location in hostile:
        with pytest.raises(ClaimCheckNotAllowedError):
            store.read(location)
    assert s3_server.recorded() == []
    assert store.read(inside) == b'{"key":null,"value":"aW5zaWRl"}'
    requests = {(r["method"], r["url"].split("/", 3)[3]) for r in s3_server.recorded()}
    key = f"claims-allowed/ticdc/cc/{inside.rsplit('/', 1)[1]}"
    assert ("GET", key) in requests and requests <= {("HEAD", key), ("GET", key)}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_dmls(), st.sampled_from(["none", "snappy", "lz4"]), st.booleans())
def test_a_claim_check_on_s3_resolves_to_the_row(
    s3_server: LocalS3Server, pair: tuple[TableSchema, DML], compression: str, raw: bool
) -> None:
    s3_server.create_bucket("claims-round-trip")
    schema, dml = pair
    writer = ClaimCheckWriter("s3://claims-round-trip/cc/", raw_value=raw)
    encoder = MessageEncoder("json", compression)  # type: ignore[arg-type]
    assert _round_trip("s3://claims-round-trip/cc", writer, encoder, dml, schema) == dml


def test_the_decode_command_shows_a_key_only_message_as_sent(tmp_path: Path) -> None:
    schema, dml = _sample()
    encoder = MessageEncoder()
    (tmp_path / "1").write_bytes(encoder.encode(Bootstrap(table_schema=schema, build_ts=0)))
    (tmp_path / "2").write_bytes(encoder.encode(key_only_dml(dml, schema, "s3://b/cc/x.json"), schema))
    result = CliRunner().invoke(main, ["decode", str(tmp_path / "1"), str(tmp_path / "2")])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output.splitlines()[-1])
    assert (shown["kind"], shown["data"], shown["old"]) == ("DML", {"id": 1}, {"id": 1})


def test_a_state_machine_given_key_only_rows_sets_them_aside() -> None:
    schema, dml = _sample()
    state = ConsumerState()
    state.assign([("t", 0)])
    state.process(RecordLocation("t", 0, 0), _key_only(schema, dml))
    state.process(RecordLocation("t", 0, 1), _key_only(schema, dml, "s3://b/cc/x.json"))
    letters = state.resolve()
    assert [(u.location.offset, u.reason_code) for u in letters] == [  # type: ignore[union-attr]
        (0, "handle-key-only"),
        (1, "claim-check-not-allowed"),
    ]
    with pytest.raises(HandleKeyOnlyError):
        failing = ConsumerState(policy="fail")
        failing.assign([("t", 0)])
        failing.process(RecordLocation("t", 0, 0), _key_only(schema, dml))
