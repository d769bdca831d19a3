"""Columnar decoding of Simple-protocol Avro DML rows (`encoding = avro`), straight into Arrow.

A chunk's DML datums are read columnar through `avro_container` (the 3 prefix bytes of each value read as a
`fixed` field): `data` and `old` become map arrays of the value union. Each column's values are gathered
from the union's branch they all come from, and converted by the column's own vectorized conversion.

This path only settles what it can prove equal to the per-datum path (`rows.SimpleRows._wire_body`,
fastavro): `read` returns None for anything else (the native reader's failure or panic, a misaligned datum,
a map naming a column twice), and the chunk is decoded datum by datum. A column whose values do not convert
on the fast path is converted from the Python values fastavro would have given, by `ColumnType.from_avro`
itself, which applies the policy or names the row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from consumer.protocol.avro_container import DatumContainer, private_field
from consumer.protocol.model import Checksum
from consumer.protocol.simple import avro_messages
from consumer.protocol.types import (
    CONVERSION_ERRORS,
    ColumnType,
)

_PREFIX_FIELD = private_field("prefix")  # Message branch, MessageType.DML, DML branch


def _reader_schema() -> dict[str, Any]:
    """The DML record with its named types inlined, after a field for the prefix."""
    schema = avro_messages.writer_schema_json()
    named = {t["name"]: t for t in schema}

    def inline(node: Any, seen: set[str]) -> Any:
        if isinstance(node, str):
            if node in named and node not in seen:
                seen.add(node)
                return inline(named[node], seen)
            return node
        if isinstance(node, list):
            return [inline(branch, seen) for branch in node]
        out = dict(node)
        if "fields" in node:
            out["fields"] = [{**f, "type": inline(f["type"], seen)} for f in node["fields"]]
        for key in ("values", "items"):
            if key in node:
                out[key] = inline(node[key], seen)
        return out

    dml = inline(named["DML"], set())
    prefix = {"name": _PREFIX_FIELD, "type": {"type": "fixed", "name": "Prefix", "size": 3}}
    return {**dml, "fields": [prefix, *dml["fields"]]}


_CONTAINER = DatumContainer(_reader_schema())


class AvroChunk:
    """A chunk's `data` and `old` maps, read columnar. An image is named by an int: `row` for the `data`
    map of DML `row`, `rows + row` for its `old` map (None: no map)."""

    def __init__(self, columns: Sequence[ColumnType], batch: pa.RecordBatch) -> None:
        self.columns = columns
        rows = batch.num_rows
        data, old = batch.column("data"), batch.column("old")
        if not (_whole(data) and _whole(old)):  # the entries below are mapped to rows from offset 0
            raise ValueError("map array is a slice of its entries")
        self.datas = _images(data, 0)
        self.olds = _images(old, rows)
        self.checksums = _checksums(batch.column("checksum"))
        self.union = pa.concat_arrays([data.items, old.items]) if len(old.items) else data.items
        union_type = self.union.type
        self.branch_of_code = np.full(128, -1, np.int64)
        for index, code in enumerate(union_type.type_codes):
            self.branch_of_code[code] = index
        self.branch_names = [union_type.field(i).name for i in range(union_type.num_fields)]
        self.null_branch = self.branch_names.index("null") if "null" in self.branch_names else -1
        self.codes = np.asarray(self.union.type_codes)
        self.offsets = np.asarray(self.union.offsets)
        # table[image, column]: the entry (index into the union) holding that column's value, -1 if none;
        # its last row (image None) holds none
        keys = pa.concat_arrays([data.keys, old.keys]) if len(old.keys) else data.keys
        names = pa.array([column.name for column in columns], pa.string())
        column_of_entry = np.asarray(pc.index_in(keys, value_set=names).fill_null(-1), np.int64)
        map_of_entry = np.concatenate(
            (
                np.repeat(np.arange(rows), np.diff(np.asarray(data.offsets))),
                np.repeat(np.arange(rows, 2 * rows), np.diff(np.asarray(old.offsets))),
            )
        )
        known = np.nonzero(column_of_entry >= 0)[0]
        self.table = np.full((2 * rows + 1, len(columns)), -1, np.int64)
        self.table[map_of_entry[known], column_of_entry[known]] = known
        self.unique = int(np.count_nonzero(self.table >= 0)) == len(known)  # no map names a column twice

    def typed(self, images: Sequence[int | None]) -> list[pa.Array]:
        """Each column of these images as its typed Arrow array (errors name the index in `images`)."""
        last = len(self.table) - 1
        if None in images:
            picked = np.fromiter((last if i is None else i for i in images), np.int64, len(images))
        else:
            picked = np.array(images, np.int64)
        entries = self.table[picked]
        return [self._typed(column, entries[:, index]) for index, column in enumerate(self.columns)]

    def _typed(self, column: ColumnType, entries: np.ndarray) -> pa.Array:
        present = entries >= 0
        branches = np.full(len(entries), -1, np.int64)  # -1: no value (the union may hold none at all)
        branches[present] = self.branch_of_code[self.codes[entries[present]]]
        valued = branches[(branches >= 0) & (branches != self.null_branch)]
        if valued.size and valued.min() == valued.max():  # one branch: always, but for hostile input
            found = [int(valued[0])]
        else:
            found = [int(b) for b in np.unique(valued)]
        if len(found) == 1:
            (branch,) = found
            mask = branches != branch
            values = self.union.field(branch).take(pa.array(self.offsets[entries], pa.int32(), mask=mask))
            try:
                fast = column.from_avro_branch(self.branch_names[branch], values)
            except CONVERSION_ERRORS:
                fast = None
            if fast is not None:
                return fast
            return column.from_avro(values.to_pylist())
        python: list[Any] = [None] * len(entries)
        for branch in found:  # only hostile input mixes branches in a column: fastavro's values, exactly
            where = np.nonzero(branches == branch)[0]
            values = self.union.field(branch).take(pa.array(self.offsets[entries[where]], pa.int32()))
            for position, value in zip(where.tolist(), values.to_pylist(), strict=True):
                python[position] = value
        return column.from_avro(python)


def read(columns: Sequence[ColumnType], payloads: Sequence[bytes]) -> AvroChunk | None:
    """The chunk of these DML payloads read columnar, or None where only the per-datum path can settle it."""
    if not payloads or not columns:
        return None
    batch = _CONTAINER.read(payloads)
    if batch is None:
        return None
    prefixes = batch.column(_PREFIX_FIELD).cast(pa.binary())
    if not pc.all(pc.equal(prefixes, pa.scalar(avro_messages.DML_PREFIX, pa.binary()))).as_py():
        return None
    try:
        chunk = AvroChunk(columns, batch)
    except (pa.ArrowException, ValueError, TypeError, KeyError, IndexError):
        return None
    return chunk if chunk.unique else None


def _whole(maps: pa.MapArray) -> bool:
    offsets = maps.offsets
    return offsets[0].as_py() == 0 and offsets[-1].as_py() == len(maps.keys)


def _images(maps: pa.MapArray, first: int) -> list[int | None]:
    """The image number of each row's map (`first` + row), None where the row has none."""
    if maps.null_count == len(maps):  # e.g. the `old` maps of INSERTs
        return [None] * len(maps)
    numbers: list[int | None] = list(range(first, first + len(maps)))
    if maps.null_count:
        for row in np.nonzero(np.asarray(maps.is_null()))[0].tolist():
            numbers[row] = None
    return numbers


def _checksums(array: pa.Array) -> list[Checksum | None]:
    if array.null_count == len(array):
        return [None] * len(array)
    return [None if record is None else Checksum(**record) for record in array.to_pylist()]
