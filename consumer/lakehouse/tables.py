"""Finding and reading an upstream table's Delta tables through the catalog, as Arrow tables.

Each table of the catalog has, under `<root>/<location>/`:

    changelog   every change image (Delta change-data-feed convention), append only
    mirror      exactly the table's live rows as of its last commit, MERGEd on its key (tables with a key)
    deletes     recently deleted keys with their commit ts, so an older change a lagging group member still
                holds cannot bring a row back; purged below the consistent point (`maintain`)

TIME columns are stored as int64 microseconds (Delta has no duration type), marked in the field metadata;
the readers here give them back as durations.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Literal

import pyarrow as pa
from deltalake import DeltaTable

from consumer.lakehouse.catalog import Catalog, CatalogEntry
from consumer.lakehouse.storage import LakeRoot

Kind = Literal["changelog", "mirror", "deletes"]
KINDS: tuple[Kind, ...] = ("changelog", "mirror", "deletes")
STORED_AS, STORED_DURATION = "ticdc.stored_as", "duration[us]"  # field metadata of a stored TIME column
FLOOR_PROPERTY = "ticdc.truncated_at"  # on a mirror: its latest TRUNCATE/DROP, older changes never apply
KEY_PROPERTY = "ticdc.key"  # on a mirror: its key columns, comma-separated (`maintain` clusters by them)
RootLike = str | os.PathLike[str] | LakeRoot


def tables(root: RootLike, storage_options: Mapping[str, str] | None = None) -> list[CatalogEntry]:
    """Every upstream table the root holds or held (dropped ones included), with its location and history."""
    return Catalog(LakeRoot.of(root, storage_options)).entries()


def table_uri(
    root: RootLike,
    database: str,
    table: str,
    kind: Kind = "mirror",
    storage_options: Mapping[str, str] | None = None,
) -> str | None:
    """The URI of the live table `database.table`'s Delta table `kind` (hand it to any Delta reader), or
    None when no live table has that name."""
    lake = LakeRoot.of(root, storage_options)
    entry = Catalog(lake).current((database, table))
    return None if entry is None else entry_uri(lake, entry, kind)


def entry_uri(root: LakeRoot, entry: CatalogEntry, kind: Kind) -> str:
    return root.join(entry.location, kind)


def read_mirror(
    root: RootLike,
    database: str,
    table: str,
    columns: Sequence[str] | None = None,
    storage_options: Mapping[str, str] | None = None,
) -> pa.Table | None:
    """The live rows of `database.table` (TIME as durations); None when there is no such mirror."""
    return _read(LakeRoot.of(root, storage_options), database, table, "mirror", columns)


def read_changelog(
    root: RootLike,
    database: str,
    table: str,
    columns: Sequence[str] | None = None,
    storage_options: Mapping[str, str] | None = None,
) -> pa.Table | None:
    """Every change image of `database.table`; None when it has no changelog."""
    return _read(LakeRoot.of(root, storage_options), database, table, "changelog", columns)


def _read(
    root: LakeRoot, database: str, table: str, kind: Kind, columns: Sequence[str] | None
) -> pa.Table | None:
    uri = table_uri(root, database, table, kind)
    delta = None if uri is None else root.open(uri)
    return None if delta is None else read_delta(root, delta, columns)


def read_delta(root: LakeRoot, table: DeltaTable, columns: Sequence[str] | None = None) -> pa.Table:
    """A Delta table's current rows, TIME columns as durations again."""
    rows = root.scan(table).to_table(columns=list(columns) if columns is not None else None)
    return as_durations(rows, stored_durations(pa.schema(table.schema().to_arrow())))


def stored_durations(schema: pa.Schema) -> list[str]:
    """The columns that hold MySQL TIME values as int64 microseconds (marked in their field metadata)."""
    marked = {STORED_AS.encode(): STORED_DURATION.encode()}
    return [f.name for f in schema if f.metadata and marked.items() <= f.metadata.items()]


def as_durations(rows: pa.Table, names: Sequence[str]) -> pa.Table:
    for name in names:
        if name in rows.column_names:
            index = rows.column_names.index(name)
            rows = rows.set_column(index, name, rows[name].cast(pa.duration("us")))
    return rows
