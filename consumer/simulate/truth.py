"""Checking a consumer's output against the simulator's ground truth.

Both sides use the plain value forms of `consumer.protocol.plain`, so a typed value that went wrong
anywhere (decode, Arrow, a sink) shows up as a difference.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from consumer.batches.changes import stored_name
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import entry_uri, read_delta, read_mirror, tables
from consumer.protocol.model import DDL, DML, DDLType, DMLType, TableSchema
from consumer.protocol.plain import value_object
from consumer.protocol.table import TableCodec
from consumer.simulate.workload import StreamRecord, Workload, WorkloadConfig, as_sent

TableRows = dict[Any, dict[str, Any]]

_DDL_BEFORE_ROWS = 0  # at equal commit_ts a DDL applies first: rows of its commit already use it
_ROWS = 1


@dataclass
class TableAt:
    """A table as of a TSO: its schema then and its rows by key, values in plain form (`value_object`)."""

    schema: TableSchema
    rows: TableRows = field(default_factory=dict)


def sent(workload: Workload) -> list[StreamRecord]:
    """The workload's stream as sent once (no copies TiCDC re-sent), each message as it was sent."""
    return [
        StreamRecord(r.partition, as_sent(r.message), r.schema) for r in workload.records() if not r.resent
    ]


def truth_at(records: Iterable[StreamRecord], tso: int) -> dict[str, TableAt]:
    """Every table that existed as of `tso`, by name: the stream's DMLs and DDLs with commit ts <= it
    replayed in order (a DDL first at its commit ts; each broadcast DDL once). A column added by ALTER is
    null in rows written before it, as the lakehouse keeps them, not the upstream's DEFAULT."""
    tables: dict[str, TableAt] = {}
    seen: set[tuple[int, str]] = set()
    for record in records:
        message = record.message
        if (
            isinstance(message, DDL)
            and message.commit_ts <= tso
            and (message.commit_ts, message.sql) not in seen
        ):
            seen.add((message.commit_ts, message.sql))
            _replay_ddl(tables, message)
        elif isinstance(message, DML) and message.commit_ts <= tso:
            _replay_dml(tables[f"{message.database}.{message.table}"], message)
    return tables


def _replay_ddl(tables: dict[str, TableAt], ddl: DDL) -> None:
    schema = ddl.table_schema
    if schema is None:  # the simulator's DDLs all carry their table's schema
        return
    name = f"{schema.database}.{schema.table}"
    if ddl.type is DDLType.CREATE:
        tables[name] = TableAt(schema)
    elif ddl.type is DDLType.ERASE:
        del tables[name]
    elif ddl.type is DDLType.RENAME:
        tables[name] = tables.pop(_renamed_from(ddl.sql, schema.database))
    if ddl.type is DDLType.TRUNCATE:
        tables[name].rows.clear()
    columns = [column.name for column in schema.columns]
    table = tables.get(name)
    if table is not None:
        table.schema = schema
        table.rows = {k: {c: row.get(c) for c in columns} for k, row in table.rows.items()}


def _replay_dml(table: TableAt, dml: DML) -> None:
    if dml.type is DMLType.DELETE:
        table.rows.pop((dml.old or {})["id"], None)
    else:
        row = dml.data or {}
        table.rows[row["id"]] = {c.name: value_object(row.get(c.name)) for c in table.schema.columns}


def load_truth(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def replay_changelog(
    rows_by_table: Mapping[str, Iterable[Mapping[str, Any]]],
    ddls: Iterable[Mapping[str, Any]],
    key: str = "id",
) -> dict[str, TableRows]:
    """Fold changelog rows (with `_change_type`, `_commit_ts`, `_partition`, `_offset`) and the DDL log
    (type, commit_ts, database, table, sql) into each table's final rows, keyed by `key`."""
    events: list[tuple[int, int, int, int, str, Mapping[str, Any]]] = []
    for name, rows in rows_by_table.items():
        for row in rows:
            events.append((row["_commit_ts"], _ROWS, row["_partition"], row["_offset"], name, row))
    for ddl in ddls:
        events.append((ddl["commit_ts"], _DDL_BEFORE_ROWS, 0, 0, f"{ddl['database']}.{ddl['table']}", ddl))
    tables: dict[str, TableRows] = {}
    for _, kind, _, _, name, event in sorted(events, key=lambda e: e[:4]):
        if kind == _ROWS:
            _apply_row(tables.setdefault(name, {}), event, key)
        else:
            _apply_ddl(tables, name, event)
    return tables


def _apply_row(table: TableRows, row: Mapping[str, Any], key: str) -> None:
    change = row["_change_type"]
    values = {k: v for k, v in row.items() if not k.startswith("_")}
    if change == "delete":
        table.pop(values[key], None)
    elif change in ("insert", "update_postimage"):
        table[values[key]] = values


def _apply_ddl(tables: dict[str, TableRows], name: str, ddl: Mapping[str, Any]) -> None:
    if ddl["type"] in ("TRUNCATE", "ERASE"):
        tables[name] = {}
    elif ddl["type"] == "RENAME":
        old = _renamed_from(ddl["sql"], ddl["database"])
        if old in tables:
            tables[name] = tables.pop(old)


def _renamed_from(sql: str, database: str) -> str:
    """`RENAME TABLE `a` TO `b``: the old name (single-pair statements, as TiCDC splits them)."""
    old = sql.split("`")[1]
    return f"{database}.{old}"


def differences(state: Mapping[str, TableRows], truth: Mapping[str, Any], key: str = "id") -> list[str]:
    """Human-readable differences; empty when every live table's rows equal the truth's (on the truth's
    columns: a dropped column may linger in a consumer's output, as documented)."""
    found: list[str] = []
    for name, expected in truth["tables"].items():
        want = {row[key]: row for row in expected["rows"]}
        have = state.get(name, {})
        if set(want) != set(have):
            missing, extra = sorted(set(want) - set(have))[:5], sorted(set(have) - set(want))[:5]
            found.append(
                f"{name}: {len(want)} rows expected, {len(have)} found; missing {missing}, extra {extra}"
            )
            continue
        for row_key, row in want.items():
            got = {column: have[row_key].get(column) for column in row}
            if got != row:
                diff = {c: (row[c], got[c]) for c in row if row[c] != got[c]}
                found.append(f"{name} row {row_key}: (expected, found) {diff}")
                break
    return found


def arrow_table_rows(table: pa.Table, schema: TableSchema, key: str = "id") -> TableRows:
    """Rows of a stored table (e.g. a Delta mirror) in rendered form, typed through the table's columns.

    Storage may widen a type (TIME as int64 microseconds, a MODIFY kept at the old type), so each column is
    cast back to the codec's Arrow type first; columns the schema no longer has (dropped) are ignored.
    """
    codec = TableCodec(schema)
    columns = {}
    for column in codec.columns:
        if stored_name(column.name) not in table.column_names:
            continue
        stored = table.column(stored_name(column.name)).combine_chunks()
        columns[column.name] = [value_object(v) for v in column.to_python(stored.cast(column.arrow_type))]
    names = list(columns)
    rows = [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]
    return {row[key]: row for row in rows}


def delta_mirror_state(
    root: str | Path, schemas: Iterable[TableSchema], storage_options: Mapping[str, str] | None = None
) -> dict[str, TableRows]:
    """The rows of the live tables' Delta mirrors under `root` (a directory or an object-store URI), found
    through the lakehouse catalog, for `differences`; a table without a live mirror has no rows."""
    state = {}
    for schema in schemas:
        mirror = read_mirror(root, schema.database, schema.table, storage_options=storage_options)
        rows = {} if mirror is None else arrow_table_rows(mirror, schema)
        state[f"{schema.database}.{schema.table}"] = rows
    return state


def delta_changelogs(
    root: str | Path, columns: Sequence[str], storage_options: Mapping[str, str] | None = None
) -> list[pa.Table]:
    """`columns` of every table's Delta changelog under `root` (dropped tables too), found through the
    lakehouse catalog."""
    lake = LakeRoot.of(root, storage_options)
    opened = (lake.open(entry_uri(lake, entry, "changelog")) for entry in tables(lake))
    return [read_delta(lake, table, columns) for table in opened if table]


def changelog_images(config: WorkloadConfig) -> int:
    """How many changelog rows a simulated stream's DMLs make (an UPDATE two); the simulator is
    deterministic for a configuration."""
    return sum(
        2 if record.message.type is DMLType.UPDATE else 1
        for record in Workload(config).records()
        if isinstance(record.message, DML) and not record.resent
    )
