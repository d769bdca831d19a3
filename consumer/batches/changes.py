"""Resolved rows of one table -> typed Arrow change tables (Delta change-data-feed convention).

Every changelog row is one image: INSERT gives `insert`, DELETE gives `delete`, UPDATE gives
`update_preimage` then `update_postimage`. Metadata columns say where the change came from, so
duplicates are recognisable by (`_topic`, `_partition`, `_offset`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from consumer.batches.spool import SpooledPiece, SpooledRows, read_pieces
from consumer.errors import InternalDecodeError, RecordLocation, RejectedRowsError, ValueDecodeError
from consumer.protocol.model import TSO_PHYSICAL_SHIFT, RawDML, TableSchema
from consumer.protocol.simple.checksum import verify_changes
from consumer.protocol.table import TableCodec
from consumer.sources.record import TopicPartition
from consumer.state.units import RowBlock, RowOrigins

META_FIELDS: tuple[pa.Field, ...] = (
    pa.field("_change_type", pa.string(), nullable=False),
    pa.field("_commit_ts", pa.int64(), nullable=False),
    pa.field("_commit_time", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("_schema_version", pa.int64(), nullable=False),
    pa.field("_topic", pa.string(), nullable=False),
    pa.field("_partition", pa.int32(), nullable=False),
    pa.field("_offset", pa.int64(), nullable=False),
)
META_COLUMNS = tuple(f.name for f in META_FIELDS)
# Every name the SDK writes beside user columns: the changelog's metadata, the mirror's and the history's.
METADATA_NAMES = frozenset((*META_COLUMNS, "_deleted", "_valid_from_ts", "_valid_to_ts"))
# `_change_type` of each `ImageKind`, indexed by it (a tuple: an Arrow array built from Python objects
# imports pandas, which a process that never builds a changelog, e.g. Spark's planner, should not pay).
CHANGE_TYPES = ("insert", "update_preimage", "update_postimage", "delete")
# A batch's rows in emission order (a sort is stable: an UPDATE's two images keep theirs).
CHANGE_ORDER = [(name, "ascending") for name in ("_commit_ts", "_topic", "_partition", "_offset")]


@dataclass(frozen=True)
class TableChanges:
    """One resolved batch of one table, typed: the changelog rows and where each came from."""

    schema: TableSchema
    changelog: pa.Table

    @property
    def database(self) -> str:
        return self.schema.database

    @property
    def table(self) -> str:
        return self.schema.table

    @property
    def key_columns(self) -> tuple[str, ...]:
        """The primary key, else the first NOT NULL unique index, as stored; () means changelog only."""
        return tuple(stored_name(name) for name in self.schema.handle_key())

    @property
    def row_count(self) -> int:
        return self.changelog.num_rows

    @property
    def newest_commit_ts(self) -> int:
        newest: int = pc.max(self.changelog["_commit_ts"]).as_py()
        return newest

    @property
    def changelog_schema(self) -> pa.Schema:
        return self.changelog.schema


class SpooledChanges(TableChanges):
    """A resolved batch whose rows are still in the files Spark tasks spooled them to (`SpooledRows`):
    a sink that can have them written where they are (the Delta changelog, by executor tasks) takes
    `pieces`; reading `changelog` reads the files here (any other sink)."""

    def __init__(self, schema: TableSchema, blocks: Sequence[RowBlock], changelog_schema: pa.Schema) -> None:
        object.__setattr__(self, "schema", schema)
        object.__setattr__(self, "blocks", tuple(blocks))
        object.__setattr__(self, "_changelog_schema", changelog_schema)

    blocks: tuple[RowBlock, ...]
    _changelog_schema: pa.Schema

    @cached_property
    def changelog(self) -> pa.Table:
        return ordered_changelog(read_pieces(self.pieces), self._changelog_schema)

    @property
    def pieces(self) -> list[SpooledPiece]:
        """Each block's file, and its DMLs to take (None: the whole file)."""
        return [(block.rows, None if block.whole else block.offsets) for block in self.blocks]

    @cached_property
    def row_count(self) -> int:  # asked by each sink and the writer: once, not a set lookup per block each
        return sum(rows.image_count(offsets) for rows, offsets in self.pieces)

    @cached_property
    def newest_commit_ts(self) -> int:
        return max(int(block.commit_ts.max()) for block in self.blocks if len(block.commit_ts))

    @property
    def changelog_schema(self) -> pa.Schema:
        return self._changelog_schema

    def partitions(self) -> set[TopicPartition]:
        return {block.tp for block in self.blocks}

    def __repr__(self) -> str:  # not the dataclass's: it would read the files
        return f"SpooledChanges({self.database}.{self.table}, {len(self.blocks)} blocks)"


def stored_name(name: str) -> str:
    """The name a user column is written under, beside the SDK's metadata columns.

    Any legal MySQL name must work, including `_offset` or `_commit_ts`, so a user column whose name is a
    metadata name preceded by zero or more underscores gets one more leading underscore (`_offset` ->
    `__offset`, `__offset` -> `___offset`); every other name is kept. Names compare case-insensitively, as
    in MySQL, Delta and Spark (`_OFFSET` -> `__OFFSET`). The mapping is injective and never yields a
    metadata name in any case, and it depends on the name alone, so a column keeps its stored name for life.
    """
    rest = name.lower()
    while rest.startswith("_"):
        if rest in METADATA_NAMES:
            return "_" + name
        rest = rest[1:]
    return name


def stored_schema(codec: TableCodec) -> pa.Schema:
    """The table's user columns as written (see `stored_name`)."""
    return pa.schema([field.with_name(stored_name(field.name)) for field in codec.arrow_schema])


def typed_rows(changes: TableChanges, codec: TableCodec) -> list[dict[str, Any]]:
    """The changelog as Python rows with each column's typed values (e.g. JSON parsed, not text), keyed by
    the stored names."""
    table = changes.changelog
    columns = {}
    for column in codec.columns:
        name = stored_name(column.name)
        columns[name] = column.to_python(table.column(name).combine_chunks())
    columns |= {name: table.column(name).to_pylist() for name in META_COLUMNS}
    names = list(columns)
    return [dict(zip(names, values, strict=True)) for values in zip(*columns.values(), strict=True)]


def changelog_schema(codec: TableCodec) -> pa.Schema:
    return pa.schema([*stored_schema(codec), *META_FIELDS])


def table_changes(
    codec: TableCodec, rows: Sequence[tuple[RawDML, RecordLocation]], origins: RowOrigins | None = None
) -> TableChanges:
    """Decode a resolved batch of one table version (`origins`: the rows' `RowOrigins`, when known). A bad
    value raises with the record's location; only `ConsumerError`s come out. With `verify_checksums` in the
    codec's policy, rows whose checksum fails raise together (`RejectedRowsError`), each with its location."""
    raws = [raw for raw, _ in rows]
    try:
        images = codec.decode_changes(raws)
    except ValueDecodeError as exc:
        if exc.row is not None:
            exc.with_location(rows[exc.row][1])
        raise
    if codec.policy.verify_checksums and any(images.checksums):
        verified, rejected = verify_changes(codec, images, raws)
        if rejected:
            for row, error in rejected.items():
                error.with_location(rows[row][1])
            raise RejectedRowsError(rejected)
        codec.stats.verified += verified
    source = pa.array(images.source, pa.int64())
    kinds = _change_types().take(pa.array(images.kinds, pa.int8()))
    try:
        meta = _metadata(origins or RowOrigins.of(rows), source, kinds)
    except (pa.ArrowException, OverflowError, ValueError) as exc:  # a header out of int64's range
        raise InternalDecodeError(f"metadata of the batch does not fit its columns: {exc}") from exc
    schema = changelog_schema(codec)
    return TableChanges(codec.schema, pa.Table.from_arrays([*images.rows.columns, *meta], schema=schema))


def block_changes(codec: TableCodec, blocks: Sequence[RowBlock]) -> TableChanges:
    """A resolved batch of rows typed elsewhere (`RowBlock.rows`: changelog tables as `table_changes`
    makes them, or the files they were spooled to), in emission order."""
    schema = changelog_schema(codec)
    if all(isinstance(block.rows, SpooledRows) for block in blocks):
        return SpooledChanges(codec.schema, blocks, schema)
    pieces = []
    for block in blocks:
        rows = block.rows
        if isinstance(rows, SpooledRows):
            pieces.append(rows.read(None if block.whole else block.offsets))
        elif block.whole:
            pieces.append(rows)
        else:
            pieces.append(
                rows.filter(pc.is_in(rows["_offset"], value_set=pa.array(block.offsets, pa.int64())))
            )
    return TableChanges(codec.schema, ordered_changelog(pieces, schema))


def ordered_changelog(pieces: Sequence[pa.Table], schema: pa.Schema) -> pa.Table:
    """Typed rows of one table version in emission order (see `CHANGE_ORDER`), as `schema` types them."""
    changelog = pieces[0] if len(pieces) == 1 else pa.concat_tables(pieces)
    return changelog.sort_by(CHANGE_ORDER).cast(schema)


def _metadata(origins: RowOrigins, source: pa.Array, kinds: pa.Array) -> list[pa.Array]:
    """Per-DML columns built once, then taken per image (an UPDATE has two)."""
    ts = pa.array(origins.commit_ts, pa.int64()).take(source)
    physical_ms = pc.shift_right(ts, TSO_PHYSICAL_SHIFT)
    commit_time = pc.cast(pc.cast(physical_ms, pa.timestamp("ms", tz="UTC")), pa.timestamp("us", tz="UTC"))
    per_dml = [
        pa.array(origins.schema_versions, pa.int64()),
        pa.array(origins.topics, pa.string()),
        pa.array(origins.partitions, pa.int32()),
        pa.array(origins.offsets, pa.int64()),
    ]
    return [kinds, ts, commit_time, *(column.take(source) for column in per_dml)]


@cache
def _change_types() -> pa.Array:
    """`CHANGE_TYPES` as an Arrow array, built on a process's first changelog, not at import."""
    return pa.array(CHANGE_TYPES, pa.string())
