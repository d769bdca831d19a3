"""Handle-key-only rows looked up in upstream TiDB, over the real MySQL protocol.

The upstream is a mysql-mimic server that answers as TiDB would (`tidb_snapshot` reads, the GC safe point
in `mysql.tidb`, TiDB's error 9006) and CHECKS every statement it receives: it parses the SQL (sqlglot,
MySQL dialect), insists on the exact column list, quoted names and a WHERE of `key = literal` terms only,
and logs it. Not TiDB itself: TiDB cannot be installed here.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any
from urllib.parse import quote

import pytest
import sqlglot
from mysql_mimic import MysqlServer, ResultColumn, ResultSet
from mysql_mimic.auth import IdentityProvider, NativePasswordAuthPlugin, User
from mysql_mimic.charset import CharacterSet
from mysql_mimic.errors import MysqlError
from mysql_mimic.session import BaseSession
from mysql_mimic.types import ColumnType
from mysql_mimic.variables import GlobalVariables, SessionVariables
from sqlglot import expressions as exp

from consumer.errors import HandleKeyOnlyError, SnapshotTooOldError, UpstreamLookupError
from consumer.large_messages.dsn import connection_options
from consumer.large_messages.encoder import key_only_dml
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.large_messages.storage import ClaimCheckStore
from consumer.large_messages.upstream import UpstreamLookup, select_sql
from consumer.protocol.model import (
    DML,
    Checksum,
    Column,
    DataType,
    DMLType,
    Index,
    KeyOnlyDML,
    RawDML,
    TableSchema,
)
from consumer.protocol.simple.checksum import row_checksum, verify_changes
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import JSON_NULL

TSO = 449_811_300_000_000_000  # physical ms = TSO >> 18
TEXT = ("utf8mb4", "utf8mb4_bin")
PASSWORD = "p@ss/w:rd"
BINARY = CharacterSet.binary

# (name, DataType, how TiDB types the result column, its charset)
COLUMNS: list[tuple[str, DataType, ColumnType, CharacterSet]] = [
    ("id", DataType("bigint", length=20), ColumnType.LONGLONG, BINARY),
    ("name", DataType("varchar", *TEXT, length=64), ColumnType.VAR_STRING, CharacterSet.utf8mb4),
    ("amount", DataType("decimal", length=12, decimal=2), ColumnType.NEWDECIMAL, BINARY),
    ("created", DataType("datetime", length=23, decimal=3), ColumnType.DATETIME, BINARY),
    ("updated", DataType("timestamp", length=26, decimal=6), ColumnType.TIMESTAMP, BINARY),
    ("day", DataType("date", length=10), ColumnType.DATE, BINARY),
    ("clock", DataType("time", length=10), ColumnType.TIME, BINARY),
    ("yr", DataType("year", length=4, unsigned=True, zerofill=True), ColumnType.YEAR, BINARY),
    ("color", DataType("enum", *TEXT, elements=("red", "green")), ColumnType.STRING, CharacterSet.utf8mb4),
    ("tags", DataType("set", *TEXT, elements=("a", "b", "c")), ColumnType.STRING, CharacterSet.utf8mb4),
    ("flags", DataType("bit", length=10, unsigned=True), ColumnType.BIT, BINARY),
    ("doc", DataType("json", length=4294967295), ColumnType.JSON, BINARY),
    ("data", DataType("blob", length=65535), ColumnType.BLOB, BINARY),
    ("vec", DataType("vector", length=3), ColumnType.VAR_STRING, CharacterSet.utf8mb4),
    ("ratio", DataType("float", length=12), ColumnType.FLOAT, BINARY),
    ("score", DataType("double", length=22), ColumnType.DOUBLE, BINARY),
    ("note", DataType("text", *TEXT, length=65535), ColumnType.BLOB, CharacterSet.utf8mb4),
]
SCHEMA = TableSchema(
    database="shop",
    table="or`ders",  # a backquote in the name: quoted as an identifier, never spliced
    table_id=7,
    version=11,
    columns=tuple(Column(name, data_type, nullable=name != "id") for name, data_type, _, _ in COLUMNS),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
OLD_TEXT = (
    "5", "before", "1.50", "2020-02-20 02:20:20.100", "2020-02-20 10:20:20.000001", "2020-02-20",
    "-02:20:20", "2020", "red", "a,c", b"\x00\x41", '{"k": [1, 2.5, null]}', b"\x00\xffraw", "[1,2,3]",
    "3.14", "2.71", None,
)  # fmt: skip
NEW_TEXT = (
    "5", "after ' OR 1=1 --", "-7.25", "2021-03-01 00:00:00.000", "2021-03-01 00:00:00.000000", "1999-12-31",
    "838:59:59", "2155", "green", "", b"\x03\xff", "null", b"", "[-1.5,0,2]", "-0.5", "1e+20", "a note",
)  # fmt: skip


@dataclass
class Upstream:
    """What the fake TiDB holds and saw: row versions by commit TSO, the GC safe point, the statements."""

    versions: dict[tuple[str, str], list[tuple[int, dict[str, Any], tuple[Any, ...] | None]]] = field(
        default_factory=dict
    )
    safe_point: str = "20000101-00:00:00.000 +0000"
    refuse_snapshots_before: int = 0  # TiDB's own check, which a stale cached safe point does not see
    statements: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def put(
        self, ts: int, key: dict[str, Any], row: tuple[Any, ...] | None, table: str = SCHEMA.table
    ) -> None:
        self.versions.setdefault(("shop", table), []).append((ts, key, row))

    def row(self, table: tuple[str, str], key: dict[str, Any], snapshot: int) -> tuple[Any, ...] | None:
        found = None
        for ts, version_key, row in sorted(self.versions.get(table, []), key=lambda v: v[0]):
            if ts <= snapshot and version_key == key:
                found = row
        return found


class TiDBSession(BaseSession):
    """Answers one connection like TiDB, checking each statement's shape before answering it."""

    def __init__(self, upstream: Upstream, schemas: dict[str, TableSchema]) -> None:
        self.variables = SessionVariables(GlobalVariables())
        self.username = None
        self.database = None
        self.upstream = upstream
        self.schemas = schemas
        self.snapshot: int | None = None

    async def handle_query(self, sql: str, attrs: dict[str, str]) -> Any:
        self.upstream.statements.append(sql)
        if sql in ("SET NAMES utf8mb4", "SET time_zone = '+00:00'", "SET AUTOCOMMIT = 1"):
            return None
        if sql.startswith("SET @@tidb_snapshot = "):
            return self._snapshot(sql.removeprefix("SET @@tidb_snapshot = "))
        if sql == "SELECT VARIABLE_VALUE FROM mysql.tidb WHERE VARIABLE_NAME = 'tikv_gc_safe_point'":
            return [(self.upstream.safe_point,)], ["VARIABLE_VALUE"]
        return self._select(sql)

    def _snapshot(self, value: str) -> None:
        if value == "''":
            self.snapshot = None
            return
        if not value.isdigit():
            self._reject(f"tidb_snapshot takes a TSO, got {value!r}")
        if int(value) < self.upstream.refuse_snapshots_before:
            raise MysqlError(
                f"GC life time is shorter than transaction duration, transaction starts at {value}", 9006
            )  # type: ignore[arg-type]
        self.snapshot = int(value)

    def _select(self, sql: str) -> ResultSet:
        tree = sqlglot.parse_one(sql, read="mysql")
        if not isinstance(tree, exp.Select) or self.snapshot is None:
            self._reject(f"unexpected statement (snapshot {self.snapshot}): {sql}")
        table = tree.find(exp.Table)
        schema = self.schemas.get(table.name)
        if table is None or schema is None or table.db != schema.database or not table.this.quoted:
            self._reject(f"unknown or unquoted table: {sql}")
        names = [column.name for column in tree.expressions]
        if names != [c.name for c in schema.columns] or not all(c.this.quoted for c in tree.expressions):
            self._reject(f"the select list is not every column, quoted, in order: {sql}")
        where = tree.find(exp.Where)
        key = None if where is None else _where_equalities(where.this)
        if key is None or set(key) != set(schema.handle_key()):
            self._reject(f"the WHERE is not `key` = literal terms: {sql}")
        row = self.upstream.row((schema.database, schema.table), key, self.snapshot)
        columns = [_result_column(name, kind, charset) for name, _, kind, charset in COLUMNS]
        if schema.table != SCHEMA.table:
            columns = [ResultColumn(c.name, ColumnType.VAR_STRING) for c in schema.columns]
        return ResultSet([] if row is None else [row], columns)

    def _reject(self, why: str) -> Any:
        self.upstream.rejected.append(why)
        raise MysqlError(why)


def _result_column(name: str, kind: ColumnType, charset: CharacterSet) -> ResultColumn:
    """A result column as TiDB describes it: numbers and times have the binary charset (63), like BLOBs."""
    if charset is not BINARY:
        return ResultColumn(name, kind, character_set=charset)
    return ResultColumn(name, kind, character_set=charset, text_encoder=_binary_text)


def _binary_text(column: ResultColumn, value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode("ascii")


def _where_equalities(condition: exp.Expression) -> dict[str, Any] | None:
    """`a` = 1 AND `b` = 'x' -> {"a": "1", "b": "x"}; anything else (OR, functions, unquoted) -> None."""
    if isinstance(condition, exp.And):
        left, right = _where_equalities(condition.left), _where_equalities(condition.right)
        return None if left is None or right is None else left | right
    if (
        isinstance(condition, exp.EQ)
        and isinstance(condition.this, exp.Column)
        and condition.this.this.quoted
        and isinstance(condition.expression, exp.Literal)
    ):
        return {condition.this.name: condition.expression.this}
    return None


class OnlyCdcUser(IdentityProvider):
    async def get_user(self, username: str) -> User | None:
        if username != "cdc":
            return None
        return User(
            username, NativePasswordAuthPlugin.create_auth_string(PASSWORD), NativePasswordAuthPlugin.name
        )


async def _closed(server: MysqlServer) -> None:
    server.close()
    await server.wait_closed()


@pytest.fixture(scope="module")
def tidb() -> Iterator[tuple[Upstream, str]]:
    """A fake TiDB on a loopback port (its event loop in a thread) and the DSN that reaches it."""
    upstream = Upstream()
    hostile = TableSchema(
        "shop",
        "keyed",
        8,
        3,
        (Column("k", DataType("varchar", *TEXT)),),
        (Index("primary", True, True, False, ("k",)),),
    )
    schemas = {SCHEMA.table: SCHEMA, hostile.table: hostile}
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = MysqlServer(
        session_factory=lambda: TiDBSession(upstream, schemas), identity_provider=OnlyCdcUser()
    )
    asyncio.run_coroutine_threadsafe(server.start_server(host="127.0.0.1", port=0), loop).result(10)
    port = server.sockets()[0].getsockname()[1]
    try:
        yield upstream, f"mysql://cdc:{quote(PASSWORD, safe='')}@127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(_closed(server), loop).result(10)  # asyncio objects: on their loop
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture
def upstream(tidb: tuple[Upstream, str]) -> Iterator[tuple[Upstream, UpstreamLookup]]:
    state, dsn = tidb
    state.statements.clear()
    state.rejected.clear()
    lookup = UpstreamLookup(dsn)
    yield state, lookup
    lookup.close()
    assert state.rejected == []  # every statement the consumer sent had the expected shape


def _key_only(dml: DML) -> KeyOnlyDML:
    message = MessageDecoder().decode(MessageEncoder().encode(key_only_dml(dml, SCHEMA), SCHEMA))
    assert isinstance(message, KeyOnlyDML)
    return message


EXPECTED_OLD = {
    "id": 5, "name": "before", "amount": Decimal("1.50"),
    "created": dt.datetime(2020, 2, 20, 2, 20, 20, 100000),
    "updated": dt.datetime(2020, 2, 20, 10, 20, 20, 1, tzinfo=dt.UTC), "day": dt.date(2020, 2, 20),
    "clock": -dt.timedelta(hours=2, minutes=20, seconds=20), "yr": 2020, "color": "red", "tags": "a,c",
    "flags": 65, "doc": {"k": [1, 2.5, None]}, "data": b"\x00\xffraw", "vec": [1.0, 2.0, 3.0],
    "ratio": 3.140000104904175, "score": 2.71, "note": None,
}  # fmt: skip
EXPECTED_NEW = {
    "id": 5, "name": "after ' OR 1=1 --", "amount": Decimal("-7.25"), "created": dt.datetime(2021, 3, 1),
    "updated": dt.datetime(2021, 3, 1, tzinfo=dt.UTC), "day": dt.date(1999, 12, 31),
    "clock": dt.timedelta(hours=838, minutes=59, seconds=59), "yr": 2155, "color": "green", "tags": "",
    "flags": 1023, "doc": JSON_NULL, "data": b"", "vec": [-1.5, 0.0, 2.0], "ratio": -0.5, "score": 1e20,
    "note": "a note",
}  # fmt: skip


def _update(commit_ts: int) -> DML:
    codec = TableCodec(SCHEMA)
    return DML(
        type=DMLType.UPDATE,
        database="shop",
        table=SCHEMA.table,
        table_id=7,
        commit_ts=commit_ts,
        build_ts=1,
        schema_version=11,
        data={"id": 5},
        old={"id": 5},
        checksum=Checksum(1, False, row_checksum(codec, EXPECTED_NEW), row_checksum(codec, EXPECTED_OLD)),
    )


def test_an_update_reads_its_new_image_at_its_commit_and_its_old_image_just_before(
    upstream: tuple[Upstream, UpstreamLookup],
) -> None:
    state, lookup = upstream
    commit_ts = TSO + 100
    state.put(TSO, {"id": "5"}, OLD_TEXT)
    state.put(commit_ts, {"id": "5"}, NEW_TEXT)
    state.put(commit_ts + 1, {"id": "5"}, None)  # deleted after: never read
    raw = lookup.resolve(_key_only(_update(commit_ts)), SCHEMA)
    codec = TableCodec(SCHEMA)
    full = codec.decode(raw)
    assert (full.data, full.old) == (EXPECTED_NEW, EXPECTED_OLD)
    assert not full.handle_key_only and full.claim_check_location == ""
    images = codec.decode_changes([raw])
    assert verify_changes(codec, images, [raw]) == (2, {})  # TiCDC's checksums vouch for the rows read
    select = select_sql(SCHEMA, ("id",))
    assert select == (
        "SELECT `id`, `name`, `amount`, `created`, `updated`, `day`, `clock`, `yr`, `color`, `tags`, "
        "`flags`, `doc`, `data`, `vec`, `ratio`, `score`, `note` FROM `shop`.`or``ders` WHERE `id` = %s"
    )
    assert state.statements == [
        "SET NAMES utf8mb4",
        "SET time_zone = '+00:00'",
        "SET AUTOCOMMIT = 1",
        "SELECT VARIABLE_VALUE FROM mysql.tidb WHERE VARIABLE_NAME = 'tikv_gc_safe_point'",
        f"SET @@tidb_snapshot = {commit_ts}",
        select % "5",
        "SET @@tidb_snapshot = ''",
        f"SET @@tidb_snapshot = {commit_ts - 1}",
        select % "5",
        "SET @@tidb_snapshot = ''",
    ]


def test_a_hostile_string_key_is_sent_as_one_escaped_literal(tidb: tuple[Upstream, str]) -> None:
    state, dsn = tidb
    schema = TableSchema(
        "shop",
        "keyed",
        8,
        3,
        (Column("k", DataType("varchar", *TEXT)),),
        (Index("primary", True, True, False, ("k",)),),
    )
    hostile = "x' OR '1'='1"
    state.put(TSO, {"k": hostile}, (hostile,), table="keyed")
    dml = DML(type=DMLType.INSERT, database="shop", table="keyed", table_id=8, commit_ts=TSO, build_ts=0,
              schema_version=3, data={"k": hostile})  # fmt: skip
    message = MessageDecoder().decode(MessageEncoder().encode(key_only_dml(dml, schema), schema))
    assert isinstance(message, KeyOnlyDML)
    lookup = UpstreamLookup(dsn)
    try:
        raw = lookup.resolve(message, schema)
    finally:
        lookup.close()
    assert TableCodec(schema).decode(raw).data == {"k": hostile}
    assert "SELECT `k` FROM `shop`.`keyed` WHERE `k` = 'x\\' OR \\'1\\'=\\'1'" in state.statements
    assert state.rejected == []


def test_a_commit_older_than_the_gc_safe_point_is_refused_without_reading(
    upstream: tuple[Upstream, UpstreamLookup],
) -> None:
    state, lookup = upstream
    state.safe_point = "20260301-00:00:00.000 +0000"
    try:
        safe_ms = int(dt.datetime(2026, 3, 1, tzinfo=dt.UTC).timestamp() * 1000)
        old_ts = (safe_ms - 1) << 18
        with pytest.raises(SnapshotTooOldError, match="GC safe point") as raised:
            lookup.resolve(_key_only(_update(old_ts)), SCHEMA)
        assert raised.value.code == "upstream-snapshot-too-old"
        assert not any("tidb_snapshot" in s or s.startswith("SELECT `") for s in state.statements)
    finally:
        state.safe_point = Upstream.safe_point


def test_tidbs_own_gc_error_is_the_same_reason(upstream: tuple[Upstream, UpstreamLookup]) -> None:
    state, lookup = upstream
    state.refuse_snapshots_before = TSO + 10**9
    try:
        with pytest.raises(SnapshotTooOldError, match="GC life time is shorter") as raised:
            lookup.resolve(_key_only(_update(TSO + 500)), SCHEMA)
        assert raised.value.code == "upstream-snapshot-too-old"
    finally:
        state.refuse_snapshots_before = 0


def test_a_row_upstream_does_not_have_is_an_error_not_a_guess(
    upstream: tuple[Upstream, UpstreamLookup],
) -> None:
    _, lookup = upstream
    dml = _update(TSO + 900)
    missing = DML(
        **{**{f: getattr(dml, f) for f in dml.__struct_fields__}, "data": {"id": 404}, "old": {"id": 404}}
    )
    with pytest.raises(UpstreamLookupError, match=r"upstream has no row .* with key \{'id': 404\}"):
        lookup.resolve(_key_only(missing), SCHEMA)


def test_the_resolver_types_rows_by_the_known_schema_only(tidb: tuple[Upstream, str]) -> None:
    state, dsn = tidb
    state.put(TSO + 2000, {"id": "5"}, NEW_TEXT)
    state.put(TSO + 1999, {"id": "5"}, OLD_TEXT)
    known: dict[int, TableSchema] = {}
    resolver = LargeMessageResolver(
        MessageDecoder(),
        ClaimCheckStore.from_uris([]),
        upstream=UpstreamLookup(dsn),
        schemas=lambda message: known.get(message.row.schema_version),
    )
    try:
        (unknown,) = resolver.resolve([_key_only(_update(TSO + 2000))])
        assert isinstance(unknown, HandleKeyOnlyError) and "arrived before its schema" in unknown.reason
        known[11] = SCHEMA
        (resolved,) = resolver.resolve([_key_only(_update(TSO + 2000))])
        assert isinstance(resolved, RawDML) and TableCodec(SCHEMA).decode(resolved).data == EXPECTED_NEW
    finally:
        resolver.close()


def test_the_dsn_carries_credentials_and_options() -> None:
    options = connection_options("mysql://cdc:p%40ss@tidb.internal:4000/?ssl_ca=/ca.pem&read_timeout=5")
    assert (options["host"], options["port"], options["user"], options["password"]) == (
        "tidb.internal", 4000, "cdc", "p@ss",
    )  # fmt: skip
    assert options["ssl"] == {"ca": "/ca.pem"} and options["read_timeout"] == 5.0
    with pytest.raises(ValueError, match="unknown options"):
        connection_options("mysql://h:4000/?sslmode=x")


def test_an_upstream_row_that_does_not_fit_the_schema_is_an_error(
    upstream: tuple[Upstream, UpstreamLookup],
) -> None:
    state, lookup = upstream
    state.put(TSO + 3000, {"id": "5"}, (*NEW_TEXT[:8], "purple", *NEW_TEXT[9:]))  # no such ENUM member
    state.put(TSO + 2999, {"id": "5"}, OLD_TEXT)
    with pytest.raises(UpstreamLookupError, match="does not fit the table's column types"):
        lookup.resolve(_key_only(_update(TSO + 3000)), SCHEMA)
