"""The lakehouse on a real S3-protocol server (moto): sinks write `s3://` roots, any Delta reader finds the
tables through the catalog, and a store that would let two writers commit one version is refused."""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from delta_changes import (
    CONTEXT,
    SCHEMA,
    TS,
    ddl_event,
    delete_row,
    evolved_schema,
    insert_row,
    table_batch,
    update_row,
)
from deltalake import DeltaTable
from deltalake.query import QueryBuilder
from pyarrow.fs import FileSelector
from pyspark.sql import SparkSession

from consumer.errors import DeadLetter, RecordLocation, SinkError
from consumer.lakehouse import storage
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import (
    PROBE_LOG_RETENTION,
    PROBE_TABLE,
    PROBE_WRITERS,
    LakeRoot,
    check_atomic_commits,
)
from consumer.protocol.model import DDLType
from consumer.sinks.base import CommitContext
from consumer.sinks.dead_letter import DeadLetterObjects
from consumer.sinks.delta import DeltaSink
from consumer.sinks.parquet import ParquetSink
from consumer.spark.readers import read_changelog, read_ddl_log, read_mirror
from consumer.testing.s3 import LocalS3Server
from consumer.testing.s3_server import serialized_writes


def plain_mirror(root: str, database: str, table: str) -> list[dict[str, Any]]:
    """What a user with nothing but deltalake does (the README's recipe): look the table's location up in
    `<root>/_catalog` with SQL, then read its mirror unless it is not ready (no rows written yet)."""
    catalog = QueryBuilder().register("catalog", DeltaTable(f"{root}/_catalog"))
    found = pa.table(
        catalog.execute(
            f"SELECT location, ready FROM catalog WHERE database = '{database}' AND \"table\" = '{table}' "
            "AND dropped_ts IS NULL"
        ).read_all()
    )
    ((location, ready),) = zip(found["location"].to_pylist(), found["ready"].to_pylist(), strict=True)
    if ready is False:
        return []
    mirror = QueryBuilder().register("mirror", DeltaTable(f"{root}/{location}/mirror"))
    return pa.table(mirror.execute("SELECT * FROM mirror ORDER BY id").read_all()).to_pylist()


def test_a_delta_sink_on_s3_keeps_pure_mirrors_a_plain_reader_finds(s3_lake: str) -> None:
    sink = DeltaSink(s3_lake)
    sink.write(table_batch([insert_row(1, TS, 0), insert_row(2, TS, 1), insert_row(3, TS, 2)]), CONTEXT)
    sink.write(table_batch([delete_row(2, TS + 1, 3), update_row(3, TS + 2, 4, qty=9)]), CONTEXT)
    renamed = evolved_schema(5, *SCHEMA.columns, table="orders_v2")
    sink.apply_ddl(ddl_event(DDLType.RENAME, "RENAME TABLE orders TO orders_v2", TS + 3, renamed), CONTEXT)
    DeltaSink(s3_lake).write(
        table_batch([insert_row(4, TS, 0, partition=1)]), CONTEXT
    )  # older: old name, same table
    rows = plain_mirror(s3_lake, "shop", "orders_v2")
    assert [(r["id"], r["qty"]) for r in rows] == [(1, 1), (3, 9), (4, 1)]
    assert set(rows[0]) == {"id", "name", "qty", "_commit_ts", "_schema_version"}

    sink.apply_ddl(ddl_event(DDLType.ERASE, "DROP TABLE orders_v2", TS + 4, renamed), CONTEXT)
    sink.apply_ddl(ddl_event(DDLType.CREATE, "CREATE TABLE orders_v2 (id bigint)", TS + 5, renamed), CONTEXT)
    sink.write(table_batch([insert_row(7, TS + 6, 5, schema=renamed)], renamed), CONTEXT)
    assert [r["id"] for r in plain_mirror(s3_lake, "shop", "orders_v2")] == [7]
    sink.record_progress(CommitContext("g", {("t", 0): 6}, TS + 6, b"", applied_ts={("t", 0): TS + 6}))
    assert DeltaSink(s3_lake).recorded_offsets("g") == {("t", 0): 6}
    assert consistent_ts(LakeRoot.of(s3_lake)) == TS + 6


def test_storage_options_reach_delta_rs_and_pyarrow(s3_server: LocalS3Server, spark: SparkSession) -> None:
    """Given as `[sink.storage_options]`, with no AWS_* variable in the environment."""
    root = f"s3://{s3_server.bucket()}/lake"
    options = s3_server.storage_options
    delta, parquet = (
        DeltaSink(root + "/delta", storage_options=options),
        ParquetSink(root + "/parquet", storage_options=options),
    )
    batch = table_batch([insert_row(1, TS, 0), insert_row(2, TS, 1)])
    for sink in (delta, parquet):
        sink.write(batch, CONTEXT)
        sink.apply_ddl(ddl_event(DDLType.TRUNCATE, "TRUNCATE TABLE orders", TS + 1), CONTEXT)
    changelog = read_changelog(spark, root + "/parquet", "shop", "orders", "parquet", storage_options=options)
    assert sorted(r["id"] for r in changelog.collect()) == [1, 2]
    assert [r.type for r in read_ddl_log(spark, root + "/parquet", storage_options=options).collect()] == [
        "TRUNCATE"
    ]
    assert read_mirror(spark, root + "/delta", "shop", "orders", storage_options=options).count() == 0
    assert read_changelog(spark, root + "/delta", "shop", "orders", storage_options=options).count() == 2


def test_dead_letters_on_an_object_store_are_one_object_each(s3_lake: str) -> None:
    letters = DeadLetterObjects(s3_lake + "/_dead_letters")
    letter = DeadLetter(
        RecordLocation("cdc", 2, 41), "MalformedMessageError: bad", b"\xff", "consumer-error", key=b"k"
    )
    letters.write(letter)
    letters.write(letter)  # a replay rewrites its own object
    filesystem, base = LakeRoot.of(s3_lake).filesystem()
    found = filesystem.get_file_info(FileSelector(f"{base}/_dead_letters", recursive=True))
    (written,) = [info for info in found if info.is_file]
    assert written.path.endswith("/cdc/2/00000000000000000041.json")
    with filesystem.open_input_stream(written.path) as stream:
        line = (
            b'{"topic":"cdc","partition":2,"offset":41,"reason":"MalformedMessageError: bad",'
            b'"value":"/w==","reason_code":"consumer-error","key":"aw=="}'  # the key too: a replay needs it
        )
        assert stream.read() == line + b"\n"


class _IgnoringConditions(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint that ignores `If-None-Match` (forwards to moto without it): such a store would let
    two writers commit the same Delta version."""

    upstream: tuple[str, int] = ("127.0.0.1", 0)

    def _forward(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("if-none-match", "host")}
        connection = http.client.HTTPConnection(*self.upstream)
        connection.request(self.command, self.path, body, headers)
        response = connection.getresponse()
        payload = response.read()
        self.send_response(response.status)
        for name, value in response.getheaders():
            if name.lower() not in ("transfer-encoding", "content-length", "connection"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, format: str, *args: Any) -> None:
        return None


@pytest.fixture
def unsafe_store(s3_server: LocalS3Server) -> Iterator[dict[str, str]]:
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    handler = type("Handler", (_IgnoringConditions,), {"upstream": (host, int(port))})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield {**s3_server.storage_options, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}"}
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_a_store_ignoring_conditional_writes_is_refused(
    s3_server: LocalS3Server, unsafe_store: dict[str, str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    bucket = s3_server.bucket()
    check_atomic_commits(LakeRoot.of(f"s3://{bucket}/safe", s3_server.storage_options))  # moto: fine
    with pytest.raises(SinkError, match="concurrent commits overwrote each other"):
        DeltaSink(f"s3://{bucket}/lake", storage_options=unsafe_store)
    # changelog only: a mirror writer records the lake's MERGE cadence, a listing this proxy cannot serve
    DeltaSink(
        f"s3://{bucket}/single", mode="changelog", storage_options=unsafe_store, allow_unsafe_commits=True
    )
    assert "ONE writer process only" in caplog.text


def test_the_commit_probe_reads_a_checkpoint_not_every_earlier_probe(
    s3_server: LocalS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every process start probes its root; the probe table is checkpointed after each probe, so a start
    months in reads a checkpoint and a few log entries, not every probe before it."""
    root = LakeRoot.of(f"s3://{s3_server.bucket()}/lake", s3_server.storage_options)
    for _ in range(3):
        monkeypatch.setattr(storage, "_checked", set())  # another process
        check_atomic_commits(root)
    probe = DeltaTable(root.join(PROBE_TABLE), storage_options=root.options())
    assert probe.version() == 3 * PROBE_WRITERS  # version 0: its creation
    filesystem, path = root.filesystem()
    last = json.loads(filesystem.open_input_file(f"{path}/{PROBE_TABLE}/_delta_log/_last_checkpoint").read())
    assert last["version"] == probe.version()
    assert probe.metadata().configuration["delta.logRetentionDuration"] == PROBE_LOG_RETENTION


def _check_then_write_app(store: dict[str, int]) -> Any:
    """A WSGI app that checks `If-None-Match: *` and writes in two steps, with a thread switch in between,
    as moto does."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        key = environ["PATH_INFO"]
        exists = key in store
        time.sleep(0.05)  # long enough that a loaded machine still starts two writers within it
        if exists:
            start_response("412 Precondition Failed", [])
        else:
            store[key] = threading.get_ident()
            start_response("200 OK", [])
        return [b""]

    return app


def _winners(app: Any, condition: dict[str, str]) -> int:
    """How many of 8 concurrent puts of one key, with `condition`'s headers, `app` answers with 200."""
    statuses: list[str] = []
    start = threading.Barrier(8)

    def put() -> None:
        start.wait()
        environ = {"REQUEST_METHOD": "PUT", "PATH_INFO": "/b/k", **condition}
        app(environ, lambda status, _: statuses.append(status))

    threads = [threading.Thread(target=put) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return statuses.count("200 OK")


def test_the_local_s3_server_makes_a_create_only_put_atomic() -> None:
    """moto checks a create-only put and then writes: two writers could both win one Delta version. The
    test server runs writes one at a time, so exactly one wins, as on S3."""
    create_only = {"HTTP_IF_NONE_MATCH": "*"}
    assert _winners(_check_then_write_app({}), create_only) > 1  # the race, unguarded
    assert _winners(serialized_writes(_check_then_write_app({})), create_only) == 1
    assert _winners(serialized_writes(_check_then_write_app({})), {}) > 1  # plain writes stay concurrent
