"""Handle-key-only rows read back from upstream TiDB (docs/protocols/simple.md §7.1), as of the row's commit.

The new image is the row at `commitTs`, the old image the row at `commitTs - 1` (TiDB's `tidb_snapshot`
takes an exact TSO). SQL is parameterised (PyMySQL escapes every value it sends) and names are quoted as
identifiers; the session reads TIMESTAMPs in UTC. A commit older than TiDB's GC safe point has no versions
left: such a row goes to the error policy rather than being read at some other time.

The row is typed through the table's mysqlType table and re-encoded as a full JSON DML (with the original
message's checksum, which then verifies the row TiDB returned), so the rest of the pipeline treats it like
any other row.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import pymysql

from consumer.errors import (
    ConsumerError,
    SnapshotTooOldError,
    UpstreamLookupError,
    UpstreamUnavailableError,
)
from consumer.large_messages.dsn import connection_options
from consumer.protocol.model import TSO_PHYSICAL_SHIFT, KeyOnlyDML, RawDML, TableSchema
from consumer.protocol.simple import json_messages
from consumer.protocol.table import TableCodec
from consumer.protocol.types import JSON_NULL, ColumnType

GC_TOO_EARLY = 9006  # TiDB: "GC life time is shorter than transaction duration"
SAFE_POINT_SQL = "SELECT VARIABLE_VALUE FROM mysql.tidb WHERE VARIABLE_NAME = %s"
SAFE_POINT_REFRESH_S = 10.0
_LOST = frozenset((2003, 2006, 2013, 2055))  # client errors: cannot connect, gone away, lost, lost
_ATTEMPTS = 3
_T = TypeVar("_T")


def quoted(name: str) -> str:
    """A MySQL identifier, backquoted (a backquote inside is doubled)."""
    return "`" + name.replace("`", "``") + "`"


def select_sql(schema: TableSchema, key: tuple[str, ...]) -> str:
    """The row of `schema`'s table by its handle key, every column in schema order; values are %s."""
    columns = ", ".join(quoted(column.name) for column in schema.columns)
    where = " AND ".join(f"{quoted(name)} = %s" for name in key)
    return f"SELECT {columns} FROM {quoted(schema.database)}.{quoted(schema.table)} WHERE {where}"


class UpstreamLookup:
    """Reads handle-key-only rows from upstream TiDB through one connection (opened on first use)."""

    def __init__(self, dsn: str) -> None:
        self._options = connection_options(dsn)
        self._connection: pymysql.Connection[Any] | None = None
        self._safe_point_ms = 0
        self._safe_point_read = 0.0
        self.lookups = 0

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def resolve(self, key_only: KeyOnlyDML, schema: TableSchema) -> RawDML:
        """The full DML of a handle-key-only message of `schema`'s table, as a JSON record payload."""
        key = schema.handle_key()
        if not key:
            raise UpstreamLookupError(
                f"{schema.database}.{schema.table} has no handle key to look a row up by"
            )
        codec = TableCodec(schema)
        header = codec.decode(key_only.row)
        commit_ts = header.commit_ts
        data = self._image(codec, key, header.data, commit_ts)
        old = self._image(codec, key, header.old, commit_ts - 1)
        full = msgspec.structs.replace(
            header, data=None, old=None, handle_key_only=False, claim_check_location=""
        )
        payload = json_messages.encode(full, data, old)
        raw = key_only.row
        return msgspec.structs.replace(raw, payload=payload, encoding="json")

    def _image(
        self, codec: TableCodec, key: tuple[str, ...], image: dict[str, Any] | None, ts: int
    ) -> dict[str, Any] | None:
        if image is None:
            return None
        missing = [name for name in key if name not in image]
        if missing:
            raise UpstreamLookupError(f"the handle-key-only message lacks key column(s) {missing}")
        self._check_safe_point(ts)
        sql = select_sql(codec.schema, key)
        found = self._query(ts, sql, [_parameter(image[name]) for name in key])
        if found is None:
            shown = {name: image[name] for name in key}
            raise UpstreamLookupError(
                f"upstream has no row of {codec.schema.database}.{codec.schema.table} with key {shown} "
                f"as of TSO {ts}"
            )
        self.lookups += 1
        try:
            return {
                column.name: _wire(column, value) for column, value in zip(codec.columns, found, strict=True)
            }
        except (ConsumerError, ValueError, TypeError, OverflowError) as exc:
            raise UpstreamLookupError(
                f"the upstream row does not fit the table's column types: {exc}"
            ) from exc

    def _check_safe_point(self, ts: int) -> None:
        if time.monotonic() - self._safe_point_read > SAFE_POINT_REFRESH_S:
            self._safe_point_ms = self._read_safe_point()
            self._safe_point_read = time.monotonic()
        if ts >> TSO_PHYSICAL_SHIFT < self._safe_point_ms:
            raise SnapshotTooOldError(_too_old(ts, f"GC safe point {self._safe_point_ms} ms"))

    def _read_safe_point(self) -> int:
        """TiDB's GC safe point (`20240311-08:51:01.461 +0800`) in Unix milliseconds."""
        rows = self._run(lambda cursor: _fetch(cursor, SAFE_POINT_SQL, ["tikv_gc_safe_point"]))
        if not rows:
            return 0
        moment = dt.datetime.strptime(str(rows[0][0]), "%Y%m%d-%H:%M:%S.%f %z")
        return int(moment.timestamp() * 1000)

    def _query(self, ts: int, sql: str, parameters: list[Any]) -> tuple[Any, ...] | None:
        def read(cursor: Any) -> tuple[Any, ...] | None:
            cursor.execute("SET @@tidb_snapshot = %s", [ts])
            try:
                rows = _fetch(cursor, sql, parameters)
            finally:
                cursor.execute("SET @@tidb_snapshot = ''")
            if len(rows) > 1:
                raise UpstreamLookupError(f"{len(rows)} upstream rows share one handle key")
            return rows[0] if rows else None

        try:
            return self._run(read)
        except pymysql.err.MySQLError as exc:
            if exc.args and exc.args[0] == GC_TOO_EARLY:
                raise SnapshotTooOldError(_too_old(ts, str(exc.args[-1]))) from exc
            raise UpstreamLookupError(f"upstream lookup failed: {exc}") from exc

    def _run(self, work: Callable[[Any], _T]) -> _T:
        """Run `work(cursor)`, reconnecting after a lost connection; an outage stops the pipeline."""
        attempt = 0
        while True:
            try:
                if self._connection is None:
                    self._connection = pymysql.connect(**self._options)
                with self._connection.cursor() as cursor:
                    return work(cursor)
            except (pymysql.err.OperationalError, pymysql.err.InterfaceError) as exc:
                if not _connection_lost(exc):
                    raise
                self.close()
                attempt += 1
                if attempt == _ATTEMPTS:
                    raise UpstreamUnavailableError(f"upstream TiDB unreachable: {exc}") from exc
                time.sleep(0.2 * 2**attempt)


def _connection_lost(exc: pymysql.err.MySQLError) -> bool:
    return isinstance(exc, pymysql.err.InterfaceError) or (bool(exc.args) and exc.args[0] in _LOST)


def _fetch(cursor: Any, sql: str, parameters: list[Any]) -> list[tuple[Any, ...]]:
    cursor.execute(sql, parameters)
    return list(cursor.fetchall())


def _too_old(ts: int, why: str) -> str:
    return f"commit TSO {ts} is older than upstream's {why}: its row versions were garbage-collected"


def _parameter(value: Any) -> Any:
    """A typed key value as PyMySQL sends it: TIMESTAMPs as UTC wall-clock time (the session's zone)."""
    if isinstance(value, dt.datetime) and value.tzinfo is not None:
        return value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def _wire(column: ColumnType, value: Any) -> Any:
    """A value as PyMySQL returns it -> the JSON wire form TiCDC would have sent."""
    if value is None:
        return None
    family = column.family
    if isinstance(value, str) and family in ("date", "datetime", "timestamp"):  # a zero date PyMySQL
        return {"location": "UTC", "value": value} if family == "timestamp" else value  # left as text
    return column.to_json(_typed(family, column, value))


def _typed(family: str, column: ColumnType, value: Any) -> Any:
    if family == "timestamp":
        return value.replace(tzinfo=dt.UTC)
    if family == "bit":
        number = int.from_bytes(value, "big") if isinstance(value, bytes) else int(value)
        return bool(number) if column.data_type.length == 1 else number
    if family == "json":
        document = json.loads(value)
        return JSON_NULL if document is None else document
    if family == "vector":
        text = value.decode() if isinstance(value, bytes) else value
        return [float(x) for x in text.strip("[]").split(",") if x]
    if family in ("text", "enum", "set") and isinstance(value, bytes):
        return value.decode()
    if family == "binary" and isinstance(value, str):
        return value.encode()
    return value
