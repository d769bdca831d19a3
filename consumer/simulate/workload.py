"""A TiDB-like upstream and TiCDC's sending rules (docs/protocols/simple.md §9), as an ordered stream of Kafka
records.

The upstream runs transactions on several tables (every column type), DDLs at chosen points, and keeps
the true table contents. The sender mimics TiCDC: DML dispatched by table or by primary key, DDLs
broadcast to every partition after the rows before them, a BOOTSTRAP before a table's first row and
then every N rows or T seconds (to all partitions or partition 0), and WATERMARKs broadcast periodically.
With `resends`, TiCDC restarts that many times: each time every partition gets again, at later offsets,
the changes (rows and DDLs) it was sent after a checkpoint that lags the last WATERMARKs
(../shared/notes/at-least-once.md), as at-least-once delivery does.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import random
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any, Literal

import msgspec
import numpy as np

from consumer.protocol.model import (
    DDL,
    DML,
    TSO_PHYSICAL_SHIFT,
    Bootstrap,
    Checksum,
    Column,
    DataType,
    DDLType,
    DMLType,
    Index,
    Message,
    TableSchema,
    Watermark,
)
from consumer.protocol.simple.checksum import row_checksum
from consumer.protocol.table import TableCodec
from consumer.protocol.types import JSON_NULL

Dispatch = Literal["table", "primary-key"]


@dataclass(frozen=True)
class WorkloadConfig:
    tables: int = 4
    rows: int = 10_000  # DML events to produce
    partitions: int = 3
    seed: int = 0
    database: str = "shop"
    dispatch: Dispatch = "table"
    bootstrap_every_rows: int = 1_000
    bootstrap_every_seconds: float = 120.0
    bootstrap_to_all_partitions: bool = True
    watermark_every_txns: int = 50
    ddl: bool = True  # ALTER ADD/DROP COLUMN, CREATE INDEX, TRUNCATE, RENAME, DROP TABLE, CREATE it again
    # rows carry TiDB's row checksums (docs/protocols/simple.md §8), as with integrity-check-level
    checksums: bool = False
    large_value_bytes: int = 0  # table 0's rows get a TEXT value this long: its DMLs are large messages
    max_txn_rows: int = 4
    start_physical_ms: int | None = None  # the TSO clock's start; default: now
    resends: int = 0  # TiCDC restarts, spread over the stream: each sends again what followed its checkpoint
    resend_lag: int = 2  # a restart's checkpoint: the WATERMARK this many before the last one sent


@dataclass(frozen=True)
class StreamRecord:
    """One Kafka record to produce: the message, the partition, and the schema its DML needs."""

    partition: int
    message: Message
    schema: TableSchema | None = None
    resent: bool = False  # a copy of an earlier record of the partition (TiCDC sent it again)


@dataclass
class _Table:
    schema: TableSchema
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    next_id: int = 1
    rows_since_bootstrap: int = 0
    last_bootstrap_ms: int = 0
    dropped: bool = False


class Workload:
    """Generates the stream and the ground truth together, deterministically from the seed."""

    def __init__(self, config: WorkloadConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self._physical_ms = config.start_physical_ms or int(time.time() * 1000)
        self._logical = 0
        self.tables: list[_Table] = []
        self.last_watermark = 0
        self._codecs: dict[tuple[str, str, int], TableCodec] = {}

    # -- the stream ----------------------------------------------------------------------------------
    def records(self) -> Iterator[StreamRecord]:
        """The stream as TiCDC sends it, re-sent changes included."""
        if not self.config.resends:
            return self._sent_once()
        return self._with_resends(self._sent_once())

    def _with_resends(self, stream: Iterator[StreamRecord]) -> Iterator[StreamRecord]:
        """`stream` with the copies TiCDC's restarts send: at evenly spread points (by DMLs sent), every
        change sent after the checkpoint again, on its partition, as it was sent (its images then)."""
        config = self.config
        points = [config.rows * (n + 1) // (config.resends + 1) for n in range(config.resends)]
        marks: list[int] = []  # the WATERMARKs sent
        since: list[StreamRecord] = []  # the changes sent after the oldest checkpoint a restart may take
        produced = 0
        for record in stream:
            yield record
            message = record.message
            if isinstance(message, Watermark):
                if record.partition == 0:
                    marks.append(message.commit_ts)
                    floor = marks[-config.resend_lag - 1] if len(marks) > config.resend_lag else 0
                    since = [r for r in since if _commit_ts(r) > floor]
            elif isinstance(message, DML | DDL):
                since.append(dataclasses.replace(record, message=as_sent(message), resent=True))
                produced += isinstance(message, DML)
                if points and produced >= points[0]:
                    points.pop(0)
                    checkpoint = marks[-config.resend_lag] if len(marks) >= config.resend_lag else 0
                    yield from (r for r in since if _commit_ts(r) > checkpoint)

    def _sent_once(self) -> Iterator[StreamRecord]:
        for index in range(self.config.tables):
            yield from self._create_table(index)
        produced = txns = 0
        ddl_points = self._ddl_points()
        while produced < self.config.rows:
            if ddl_points and produced >= ddl_points[0][0]:
                yield from self._ddl(ddl_points.pop(0)[1])
            batch = list(self._transaction(self.config.rows - produced))
            produced += sum(isinstance(r.message, DML) for r in batch)
            yield from batch
            txns += 1
            if txns % self.config.watermark_every_txns == 0:
                yield from self._watermark()
        yield from self._closing_bootstraps()
        yield from self._watermark()

    def ground_truth(self) -> dict[str, Any]:
        """Every live table's rows at the last watermark (call after the stream is exhausted)."""
        return {
            "watermark": self.last_watermark,
            "tables": {
                f"{t.schema.database}.{t.schema.table}": {
                    "dropped": t.dropped,
                    "rows": [] if t.dropped else [t.rows[k] for k in sorted(t.rows)],
                }
                for t in self.tables
            },
        }

    # -- clock ---------------------------------------------------------------------------------------
    def _tso(self) -> int:
        """A strictly increasing TSO: physical milliseconds << 18 | logical counter."""
        advance = self.rng.randint(0, 3)
        self._physical_ms += advance
        self._logical = 0 if advance else self._logical + 1
        return (self._physical_ms << TSO_PHYSICAL_SHIFT) | self._logical

    @property
    def _now_ms(self) -> int:
        return self._physical_ms

    # -- tables, rows and transactions --------------------------------------------------------------
    def _create_table(self, index: int, name: str | None = None) -> Iterator[StreamRecord]:
        commit_ts = self._tso()
        table_id = 100 + len(self.tables)
        schema = _initial_schema(self.config.database, name or f"t{index}", table_id, commit_ts - 1, index)
        self.tables.append(_Table(schema))
        ddl = DDL(
            type=DDLType.CREATE,
            sql=_create_sql(schema),
            commit_ts=commit_ts,
            build_ts=self._now_ms,
            table_schema=schema,
        )
        yield from self._broadcast(ddl)

    def _transaction(self, budget: int) -> Iterator[StreamRecord]:
        live = [t for t in self.tables if not t.dropped]
        if not live:
            return
        commit_ts = self._tso()
        size = min(budget, self.rng.randint(1, self.config.max_txn_rows))
        changes: list[tuple[_Table, DML]] = []
        touched: set[tuple[int, int]] = set()  # TiDB emits one final change per row per transaction
        while len(changes) < size:
            table = self.rng.choice(live)
            for dml in self._change(table, commit_ts, touched, room=size - len(changes)):
                touched.add((id(table), (dml.data or dml.old or {})["id"]))
                changes.append((table, dml))
        # TiCDC emits a transaction's split DELETEs before its INSERTs (docs/protocols/simple.md §3.3)
        changes.sort(key=lambda pair: pair[1].type != DMLType.DELETE)
        for table, dml in changes:
            yield from self._bootstrap_due(table)
            table.rows_since_bootstrap += 1
            yield StreamRecord(self._partition(table, dml), dml, table.schema)

    def _change(self, table: _Table, commit_ts: int, touched: set[tuple[int, int]], room: int) -> list[DML]:
        """One row change: at most `room` DMLs (a key change takes two), so `rows` is produced exactly."""
        roll = self.rng.random()
        key = self._untouched_key(table, touched) if roll >= 0.5 else None
        if key is None:
            return [self._insert(table, commit_ts)]
        if roll < 0.8 or (roll >= 0.92 and room < 2):
            return [self._update(table, key, commit_ts)]
        if roll < 0.92:
            return [self._delete(table, key, commit_ts)]
        return self._change_key(table, key, commit_ts)

    def _untouched_key(self, table: _Table, touched: set[tuple[int, int]]) -> int | None:
        """A live key the transaction has not changed yet, uniformly: sampled by id (ids run 1..next_id-1,
        mostly live), so a stream's generation stays linear in its length; a sparse table (after a TRUNCATE)
        falls back to listing its keys."""
        for _ in range(64):
            if table.next_id <= 1:
                return None
            key = self.rng.randrange(1, table.next_id)
            if key in table.rows and (id(table), key) not in touched:
                return key
        untouched = [k for k in table.rows if (id(table), k) not in touched]
        return self.rng.choice(untouched) if untouched else None

    def _dml(self, table: _Table, kind: DMLType, commit_ts: int, data: Any = None, old: Any = None) -> DML:
        schema = table.schema
        checksum = None
        if self.config.checksums:
            codec = self._codecs.get(schema.key)
            if codec is None or codec.schema != schema:
                codec = self._codecs[schema.key] = TableCodec(schema)
            checksum = Checksum(1, False, row_checksum(codec, data), row_checksum(codec, old))
        return DML(
            type=kind,
            database=schema.database,
            table=schema.table,
            table_id=schema.table_id,
            commit_ts=commit_ts,
            build_ts=self._now_ms,
            schema_version=schema.version,
            data=data,
            old=old,
            checksum=checksum,
        )

    def _insert(self, table: _Table, commit_ts: int) -> DML:
        key, table.next_id = table.next_id, table.next_id + 1
        row = {c.name: self._value(table, c) for c in table.schema.columns} | {"id": key}
        table.rows[key] = row
        return self._dml(table, DMLType.INSERT, commit_ts, data=row)

    def _value(self, table: _Table, column: Column) -> Any:
        if self.config.large_value_bytes and column.name == "c_text" and table is self.tables[0]:
            return self.rng.randbytes(self.config.large_value_bytes // 2).hex()
        return _random_value(column, self.rng)

    def _update(self, table: _Table, key: int, commit_ts: int) -> DML:
        old = table.rows[key]
        new = dict(old)
        for column in self.rng.sample(table.schema.columns[1:], k=min(2, len(table.schema.columns) - 1)):
            new[column.name] = self._value(table, column)
        table.rows[key] = new
        return self._dml(table, DMLType.UPDATE, commit_ts, data=new, old=old)

    def _delete(self, table: _Table, key: int, commit_ts: int) -> DML:
        return self._dml(table, DMLType.DELETE, commit_ts, old=table.rows.pop(key))

    def _change_key(self, table: _Table, key: int, commit_ts: int) -> list[DML]:
        """A primary-key-changing UPDATE: TiCDC splits it into DELETE + INSERT with one commitTs."""
        old = table.rows.pop(key)
        new_key, table.next_id = table.next_id, table.next_id + 1
        new = old | {"id": new_key}
        table.rows[new_key] = new
        return [
            self._dml(table, DMLType.DELETE, commit_ts, old=old),
            self._dml(table, DMLType.INSERT, commit_ts, data=new),
        ]

    def _partition(self, table: _Table, dml: DML) -> int:
        if self.config.dispatch == "primary-key":
            key = (dml.data or dml.old or {})["id"]
            return zlib.crc32(f"{table.schema.table}:{key}".encode()) % self.config.partitions
        return zlib.crc32(f"{table.schema.database}.{table.schema.table}".encode()) % self.config.partitions

    # -- control messages ----------------------------------------------------------------------------
    def _broadcast(self, message: Message) -> Iterator[StreamRecord]:
        for partition in range(self.config.partitions):
            yield StreamRecord(partition, message)

    def _watermark(self) -> Iterator[StreamRecord]:
        self.last_watermark = self._tso()
        yield from self._broadcast(Watermark(commit_ts=self.last_watermark, build_ts=self._now_ms))

    def _closing_bootstraps(self) -> Iterator[StreamRecord]:
        """TiCDC keeps re-sending BOOTSTRAPs on its timer after the last row: a consumer that joined late
        (or took over a partition in a rebalance) learns every live table's schema from these."""
        for table in self.tables:
            if not table.dropped:
                table.last_bootstrap_ms = 0
                yield from self._bootstrap_due(table)

    def _bootstrap_due(self, table: _Table) -> Iterator[StreamRecord]:
        first = table.last_bootstrap_ms == 0
        elapsed = (self._now_ms - table.last_bootstrap_ms) / 1000
        if not (
            first
            or table.rows_since_bootstrap >= self.config.bootstrap_every_rows
            or elapsed >= self.config.bootstrap_every_seconds
        ):
            return
        table.rows_since_bootstrap, table.last_bootstrap_ms = 0, self._now_ms
        message = Bootstrap(table_schema=table.schema, build_ts=self._now_ms)
        if self.config.bootstrap_to_all_partitions:
            yield from self._broadcast(message)
        else:
            yield StreamRecord(0, message)

    # -- DDL -----------------------------------------------------------------------------------------
    def _ddl_points(self) -> list[tuple[int, str]]:
        if not self.config.ddl or self.config.tables < 2:
            return []
        kinds = ["add-column", "create-index", "drop-column", "truncate", "rename", "drop-table", "recreate"]
        step = self.config.rows // (len(kinds) + 1)
        return [(step * (i + 1), kind) for i, kind in enumerate(kinds)]

    def _ddl(self, kind: str) -> Iterator[StreamRecord]:
        if kind == "recreate":  # CREATE TABLE with the name of the table dropped before: a new table
            dropped = next(t for t in reversed(self.tables) if t.dropped)
            yield from self._create_table(len(self.tables), dropped.schema.table)
            return
        live = [t for t in self.tables if not t.dropped]
        table = live[-1] if kind == "drop-table" else live[0]
        commit_ts = self._tso()
        builders = {
            "add-column": self._ddl_add_column,
            "create-index": self._ddl_create_index,
            "drop-column": self._ddl_drop_column,
            "truncate": self._ddl_truncate,
            "rename": self._ddl_rename,
            "drop-table": self._ddl_drop_table,
        }
        ddl_type, sql, schema = builders[kind](table, commit_ts - 1)
        table.schema = schema
        table.last_bootstrap_ms = self._now_ms  # the DDL itself tells consumers the new schema
        yield from self._broadcast(
            DDL(type=ddl_type, sql=sql, commit_ts=commit_ts, build_ts=self._now_ms, table_schema=schema)
        )

    def _ddl_add_column(self, table: _Table, version: int) -> tuple[DDLType, str, TableSchema]:
        column = Column("added_note", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=64), default="n/a")
        for row in table.rows.values():
            row[column.name] = "n/a"
        schema = _evolve(table.schema, version, columns=(*table.schema.columns, column))
        return (
            DDLType.ALTER,
            f"ALTER TABLE `{schema.table}` ADD COLUMN `added_note` varchar(64) DEFAULT 'n/a'",
            schema,
        )

    def _ddl_drop_column(self, table: _Table, version: int) -> tuple[DDLType, str, TableSchema]:
        dropped = table.schema.columns[-1]
        for row in table.rows.values():
            row.pop(dropped.name, None)
        schema = _evolve(table.schema, version, columns=table.schema.columns[:-1])
        return DDLType.ALTER, f"ALTER TABLE `{schema.table}` DROP COLUMN `{dropped.name}`", schema

    def _ddl_create_index(self, table: _Table, version: int) -> tuple[DDLType, str, TableSchema]:
        name = table.schema.columns[1].name
        index = Index(f"idx_{name}", False, False, True, (name,))
        schema = _evolve(table.schema, version, indexes=(*table.schema.indexes, index))
        return DDLType.CINDEX, f"CREATE INDEX `idx_{name}` ON `{schema.table}` (`{name}`)", schema

    def _ddl_truncate(self, table: _Table, version: int) -> tuple[DDLType, str, TableSchema]:
        table.rows.clear()
        schema = _evolve(table.schema, version, table_id=table.schema.table_id + 1000)
        return DDLType.TRUNCATE, f"TRUNCATE TABLE `{schema.table}`", schema

    def _ddl_rename(self, table: _Table, version: int) -> tuple[DDLType, str, TableSchema]:
        old_name = table.schema.table
        schema = msgspec.structs.replace(
            table.schema, table=f"{old_name}_renamed"
        )  # RENAME keeps the version
        return DDLType.RENAME, f"RENAME TABLE `{old_name}` TO `{schema.table}`", schema

    def _ddl_drop_table(self, table: _Table, version: int) -> tuple[DDLType, str, TableSchema]:
        table.dropped = True
        table.rows.clear()
        return DDLType.ERASE, f"DROP TABLE `{table.schema.table}`", table.schema


def _commit_ts(record: StreamRecord) -> int:
    return record.message.commit_ts  # type: ignore[union-attr]  # a DML's or a DDL's


def as_sent(message: Message) -> Message:
    """A message as it is sent: the simulator goes on changing a DML's row dicts afterwards (an ALTER fills
    a column in)."""
    if not isinstance(message, DML):
        return message
    return msgspec.structs.replace(
        message,
        data=None if message.data is None else dict(message.data),
        old=None if message.old is None else dict(message.old),
    )


def _evolve(schema: TableSchema, version: int, **changes: Any) -> TableSchema:
    return msgspec.structs.replace(schema, version=version, **changes)


# -- schemas and values ------------------------------------------------------------------------------
def _text(length: int = 255) -> DataType:
    return DataType("varchar", "utf8mb4", "utf8mb4_bin", length=length)


_ALL_TYPES_COLUMNS: tuple[Column, ...] = (
    Column("c_tinyint", DataType("tinyint", length=4)),
    Column("c_tinyint_u", DataType("tinyint", length=3, unsigned=True)),
    Column("c_smallint", DataType("smallint", length=6)),
    Column("c_mediumint_u", DataType("mediumint", length=8, unsigned=True)),
    Column("c_int", DataType("int", length=11)),
    Column("c_int_u", DataType("int", length=10, unsigned=True)),
    Column("c_bigint_u", DataType("bigint", length=20, unsigned=True)),
    Column("c_float", DataType("float", length=12)),
    Column("c_double", DataType("double", length=22)),
    Column("c_decimal", DataType("decimal", length=12, decimal=2)),
    Column("c_wide_decimal", DataType("decimal", length=50, decimal=10)),
    Column("c_char", DataType("char", "utf8mb4", "utf8mb4_bin", length=8)),
    Column("c_text", DataType("text", "utf8mb4", "utf8mb4_bin", length=65535)),
    Column("c_binary", DataType("binary", length=4)),
    Column("c_blob", DataType("blob", length=65535)),
    Column("c_date", DataType("date", length=10)),
    Column("c_datetime", DataType("datetime", length=23, decimal=3)),
    Column("c_timestamp", DataType("timestamp", length=26, decimal=6)),
    Column("c_time", DataType("time", length=10)),
    Column("c_year", DataType("year", length=4, unsigned=True, zerofill=True)),
    Column("c_enum", DataType("enum", "utf8mb4", "utf8mb4_bin", length=1, elements=("red", "green", "blue"))),
    Column("c_set", DataType("set", "utf8mb4", "utf8mb4_bin", length=5, elements=("a", "b", "c"))),
    Column("c_bit1", DataType("bit", length=1, unsigned=True)),
    Column("c_bit10", DataType("bit", length=10, unsigned=True)),
    Column("c_bit64", DataType("bit", length=64, unsigned=True)),
    Column("c_json", DataType("json", length=4294967295)),
    Column("c_vector", DataType("vector", length=3)),
)

_NARROW_COLUMNS: tuple[Column, ...] = (
    Column("customer", _text(64), nullable=False),
    Column("amount", DataType("decimal", length=12, decimal=2)),
    Column(
        "status", DataType("enum", "utf8mb4", "utf8mb4_bin", length=1, elements=("new", "paid", "shipped"))
    ),
    Column("quantity", DataType("int", length=11)),
    Column("updated_at", DataType("timestamp", length=19)),
    Column("note", _text(255)),
)


def _initial_schema(database: str, name: str, table_id: int, version: int, index: int) -> TableSchema:
    """Table 0 carries every column type; the others are narrow, order-like tables."""
    key = Column("id", DataType("bigint", length=20), nullable=False)
    columns = _ALL_TYPES_COLUMNS if index == 0 else _NARROW_COLUMNS
    return TableSchema(
        database=database,
        table=name,
        table_id=table_id,
        version=version,
        columns=(key, *columns),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )


def _create_sql(schema: TableSchema) -> str:
    return f"CREATE TABLE `{schema.table}` ({', '.join(f'`{c.name}`' for c in schema.columns)})"


def _random_value(column: Column, rng: random.Random) -> Any:
    data_type = column.data_type
    kind = data_type.mysql_type
    if column.nullable and rng.random() < 0.1:
        return None
    if kind in ("tinyint", "smallint", "mediumint", "int", "bigint"):
        bits = {"tinyint": 8, "smallint": 16, "mediumint": 24, "int": 32, "bigint": 64}[kind]
        low = 0 if data_type.unsigned else -(2 ** (bits - 1))
        high = 2**bits - 1 if data_type.unsigned else 2 ** (bits - 1) - 1
        return rng.choice((low, high, 0, rng.randint(low, high)))
    if kind == "float":
        return float(np.float32(rng.uniform(-1e6, 1e6)))
    if kind == "double":
        return rng.uniform(-1e12, 1e12)
    if kind == "decimal":
        limit = 10**data_type.length - 1
        return Decimal(f"{rng.randint(-limit, limit)}e-{data_type.decimal}")  # exact: no context rounding
    if kind in ("char", "varchar", "text"):
        limit = min(data_type.length, 24)
        return "".join(rng.choice("abcdefghijklmnop Zoë😀<&>") for _ in range(rng.randint(0, limit)))[:limit]
    if kind == "binary":
        return rng.randbytes(data_type.length)
    if kind == "blob":
        return rng.randbytes(rng.randint(0, 16))
    if kind == "date":
        return dt.date(2000, 1, 1) + dt.timedelta(days=rng.randint(0, 15000))
    if kind == "datetime":
        return dt.datetime(2000, 1, 1) + dt.timedelta(
            seconds=rng.randint(0, 10**9), milliseconds=rng.randint(0, 999)
        )
    if kind == "timestamp":
        micros = rng.randint(0, 999_999) if data_type.decimal else 0
        return dt.datetime(2001, 1, 1, tzinfo=dt.UTC) + dt.timedelta(
            seconds=rng.randint(0, 10**9), microseconds=micros
        )
    if kind == "time":
        return dt.timedelta(seconds=rng.randint(-838 * 3600, 838 * 3600))
    if kind == "year":
        return rng.randint(1901, 2155)
    if kind == "enum":
        return rng.choice(data_type.elements)
    if kind == "set":
        chosen = {e for e in data_type.elements if rng.random() < 0.5}
        return ",".join(e for e in data_type.elements if e in chosen)
    if kind == "bit":
        return rng.random() < 0.5 if data_type.length == 1 else rng.randint(0, 2**data_type.length - 1)
    if kind == "json":
        return rng.choice(({"k": rng.randint(0, 9), "tags": ["x", "y"]}, [1, 2.5, None], "text", JSON_NULL))
    if kind == "vector":
        return [float(np.float32(rng.uniform(-1, 1))) for _ in range(data_type.length)]
    raise ValueError(f"the simulator has no values for {kind}")
