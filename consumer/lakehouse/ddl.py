"""DDLs in the lakehouse: the `_ddl` log every sink keeps at its root, and what a RENAME renamed.

The log is a Delta table, one row per DDL. A DDL's row is written after its effects, with an app
transaction named after the DDL, so two members cannot both log it and a DDL found in the log needs nothing
more: re-running a stream skips it entirely. Its `schema` (the table's stored columns after the DDL, as an
Arrow IPC schema) tells as-of readers the column set at any TSO, which Delta's own schema cannot: a dropped
column stays in the Delta tables.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from consumer.errors import SinkError
from consumer.lakehouse.catalog import Name
from consumer.lakehouse.layout import DDL_LOG
from consumer.lakehouse.storage import LakeRoot, by_version, retry_commits
from consumer.protocol.model import DDL

DDL_LOG_SCHEMA = pa.schema(
    [
        pa.field("commit_ts", pa.int64(), nullable=False),
        pa.field("type", pa.string(), nullable=False),
        pa.field("sql", pa.string(), nullable=False),
        pa.field("database", pa.string()),
        pa.field("table", pa.string()),
        pa.field("schema_version", pa.int64()),
        pa.field("applied_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("schema", pa.binary()),
    ]
)


def table_schema(logged: bytes | None) -> pa.Schema | None:
    """The stored columns a logged DDL left its table with (None: the DDL named no columns)."""
    return None if logged is None else pa.ipc.read_schema(pa.py_buffer(logged))


class DDLLog:
    def __init__(self, root: LakeRoot) -> None:
        self.root = root
        self.uri = root.join(DDL_LOG)

    def applied(self, ddl: DDL, database: str | None, table: str | None) -> bool:
        log = self.root.open(self.uri)
        return log is not None and log.transaction_version(_app_id(ddl, database, table)) is not None

    def record(
        self,
        ddl: DDL,
        database: str | None,
        table: str | None,
        metadata: Mapping[str, str] | None = None,
        columns: pa.Schema | None = None,
    ) -> None:
        """Append the DDL's row, once across every writer of the root; `columns`: the table's stored
        columns after it, when the DDL carries them."""
        app_id = _app_id(ddl, database, table)
        row = {
            "commit_ts": ddl.commit_ts,
            "type": ddl.type.value,
            "sql": ddl.sql,
            "database": database,
            "table": table,
            "schema_version": ddl.table_schema.version if ddl.table_schema else None,
            "applied_at": datetime.now(UTC),
            "schema": None if columns is None else columns.serialize().to_pybytes(),
        }

        def attempt() -> None:
            log = self.root.open(self.uri)
            if log is not None and log.transaction_version(app_id) is not None:
                return
            write_deltalake(
                log if log is not None else self.uri,
                pa.Table.from_pylist([row], schema=DDL_LOG_SCHEMA),
                mode="append",
                schema_mode="merge",  # a log written before the `schema` column gains it
                storage_options=self.root.options(),
                commit_properties=CommitProperties(
                    custom_metadata=dict(metadata or {}), app_transactions=[Transaction(app_id, 1)]
                ),
            )

        retry_commits(f"DDL log {self.uri}", attempt)

    def rows(self) -> list[dict[str, Any]]:
        """Every logged DDL, oldest first."""
        log = self.root.open(self.uri)
        if log is None:
            return []
        rows = by_version(log, "ddl log", self._sorted)
        return [dict(row) for row in rows]

    def _sorted(self, log: DeltaTable) -> tuple[dict[str, Any], ...]:
        return tuple(sorted(self.root.scan(log).to_table().to_pylist(), key=lambda row: row["commit_ts"]))


def _app_id(ddl: DDL, database: str | None, table: str | None) -> str:
    identity = json.dumps([ddl.commit_ts, ddl.type.value, ddl.sql, database, table])
    return "ticdc-ddl:" + hashlib.sha256(identity.encode()).hexdigest()


_IDENT = r"`(?:[^`]|``)+`|[^\s`.]+"
_RENAME = re.compile(rf"\s*RENAME\s+TABLE\s+({_IDENT})(?:\s*\.\s*({_IDENT}))?\s+TO\s", re.IGNORECASE)


def renamed_from(ddl: DDL, database: str | None, table: str | None) -> Name:
    """A RENAME's old name: from `pre_table_schema` where TiCDC sends it (tiflow), else from the SQL, which
    TiCDC always sends as one single-pair `RENAME TABLE old TO new` per table; names may be backticked
    (with doubled backticks inside) or bare, and qualified by their database or not."""
    pre = ddl.pre_table_schema
    if pre is not None and (pre.database, pre.table) != (database, table):
        return pre.database, pre.table
    found = _RENAME.match(ddl.sql)
    if found is None or database is None:
        raise SinkError(f"cannot tell the renamed table from {ddl.sql!r}")
    first, second = found.groups()
    return (_unquote(first), _unquote(second)) if second else (database, _unquote(first))


def _unquote(identifier: str) -> str:
    if identifier.startswith("`"):
        return identifier[1:-1].replace("``", "`")
    return identifier
