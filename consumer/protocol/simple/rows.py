"""The Simple protocol's rows of one table version: wire maps -> typed values, columnar (Arrow) on the fast
path (`SimpleRows`, what `TableCodec` dispatches to for this protocol).

JSON rows decode through a msgspec Struct generated from the table schema, so `data`/`old` are parsed
straight into per-column fields without building dicts; each column then becomes one Arrow array.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from operator import attrgetter
from typing import Any, Literal, TypeVar

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from msgspec.structs import astuple

from consumer.errors import (
    DocumentTooDeepError,
    MalformedMessageError,
    ValueDecodeError,
    ValueTooLargeError,
)
from consumer.protocol.base import ChangeImages, ImageKind, RowImages, collector_paused
from consumer.protocol.containment import contained
from consumer.protocol.model import DML, Checksum, DMLType, RawDML, TableSchema
from consumer.protocol.parse_errors import JSON_ERRORS, json_problem
from consumer.protocol.simple import avro_messages, avro_rows
from consumer.protocol.types import ColumnType, ValuePolicy

Encoding = Literal["json", "avro"]
_CHUNK_BYTES = 1 << 20  # payload decoded at a time by `decode_batch`, so its parsed rows stay in cache
# Avro rows are read columnar by one native call a chunk, which has a fixed cost: measured fastest at 2 MiB
_AVRO_CHUNK_BYTES = 2 << 20


_UPDATE_KINDS = (ImageKind.UPDATE_OLD, ImageKind.UPDATE_NEW)
_Decoded = TypeVar("_Decoded", RowImages, ChangeImages)


class SimpleRows:
    """Decoding of the Simple protocol's rows of one TableSchema version (validated by `TableCodec`, whose
    `columns` these are). Decoding raises only `ConsumerError`s: a `ValueDecodeError` names the column and
    the row, and anything unanticipated comes out as an `InternalDecodeError` without a row.
    """

    def __init__(self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy) -> None:
        self.policy = policy
        self.schema = schema
        self.columns: tuple[ColumnType, ...] = tuple(columns)
        self._image_schema = pa.schema([pa.field(c.name, c.arrow_type) for c in self.columns])
        self._batch_body, batch_row = _json_body(schema, self.columns, missing=None)
        self._row_body, _ = _json_body(schema, self.columns, missing=msgspec.UNSET)
        self._null_row = batch_row() if batch_row else None
        # The Struct declares the columns in wire order: where each column sits in `astuple` of a row.
        wire_order = sorted(range(len(self.columns)), key=lambda i: self.columns[i].name.encode())
        self._positions = [wire_order.index(i) for i in range(len(self.columns))]
        self._fields = bool(batch_row and self.columns)  # rows decode into a per-table Struct

    # -- fast path: many DMLs -> Arrow ---------------------------------------------------------------
    def decode_batch(self, raws: Sequence[RawDML]) -> RowImages:
        """Typed Arrow images of many DMLs of this table version. Errors carry `.row` = index in raws."""
        with collector_paused(), contained("decoding rows"):
            chunks = self._chunked(raws, self._decode_chunk)
        if len(chunks) == 1:
            return chunks[0]
        return RowImages(
            data=pa.concat_batches([c.data for c in chunks]),
            old=pa.concat_batches([c.old for c in chunks]),
            has_data=list(chain.from_iterable(c.has_data for c in chunks)),
            has_old=list(chain.from_iterable(c.has_old for c in chunks)),
        )

    def decode_changes(self, raws: Sequence[RawDML]) -> ChangeImages:
        """The batch's row images in change order (see `ChangeImages`), typed. Errors carry `.row` = the
        index in raws of the DML whose value did not decode."""
        with collector_paused(), contained("decoding rows"):
            chunks = self._chunked(raws, self._changes_chunk)
        if len(chunks) == 1:
            return chunks[0]
        source: list[int] = []
        for chunk in chunks:  # every DML has at least one image: a chunk's last image is its last DML's
            start = source[-1] + 1 if source else 0
            source += [start + row for row in chunk.source]
        return ChangeImages(
            rows=pa.concat_batches([c.rows for c in chunks]),
            source=source,
            kinds=list(chain.from_iterable(c.kinds for c in chunks)),
            checksums=list(chain.from_iterable(c.checksums for c in chunks)),
        )

    def _chunk_sizes(self, raws: Sequence[RawDML]) -> list[int]:
        """Big batches decode in chunks of about `_CHUNK_BYTES` of payload: a chunk's parsed rows are still in
        the CPU cache when its columns are built, which more than pays for concatenating the chunks."""
        sample = raws[:64]
        budget = _AVRO_CHUNK_BYTES if sample and sample[0].encoding == "avro" else _CHUNK_BYTES
        size = max(1, budget * len(sample) // max(1, sum(len(raw.payload) for raw in sample)))
        return [min(size, len(raws) - start) for start in range(0, len(raws), size)] or [0]

    def _chunked(
        self, raws: Sequence[RawDML], decode: Callable[[Sequence[RawDML]], _Decoded]
    ) -> list[_Decoded]:
        chunks = []
        start = 0
        for size in self._chunk_sizes(raws):
            try:
                chunks.append(_decoded_at(raws, start, start + size, decode))
            except _MixedEncodings:  # a topic that switched from JSON to Avro: each run on its own
                runs = _encoding_runs(raws[start : start + size])
                chunks += [_decoded_at(raws, start + a, start + b, decode) for a, b in runs]
            start += size
        return chunks

    def _decode_chunk(self, raws: Sequence[RawDML]) -> RowImages:
        datas, olds, _, longest, columnar = self._wire_images(raws)
        avro = bool(raws) and raws[0].encoding == "avro"
        return RowImages(
            data=self._image(datas, avro, longest, columnar),
            old=self._image(olds, avro, longest, columnar),
            has_data=[d is not None or r.type in _HAS_DATA for d, r in zip(datas, raws, strict=True)],
            has_old=[o is not None or r.type in _HAS_OLD for o, r in zip(olds, raws, strict=True)],
        )

    def _changes_chunk(self, raws: Sequence[RawDML]) -> ChangeImages:
        datas, olds, checksums, longest, columnar = self._wire_images(raws)
        images: list[Any] = []
        source: list[int] = []
        kinds: list[int] = []
        for row, (raw, data, old) in enumerate(zip(raws, datas, olds, strict=True)):
            if raw.type is DMLType.UPDATE:
                images += (old, data)
                source += (row, row)
                kinds += _UPDATE_KINDS
            elif raw.type is DMLType.INSERT:
                images.append(data)
                source.append(row)
                kinds.append(ImageKind.INSERT)
            else:
                images.append(old)
                source.append(row)
                kinds.append(ImageKind.DELETE)
        try:
            rows = self._image(images, bool(raws) and raws[0].encoding == "avro", longest, columnar)
        except ValueDecodeError as exc:
            if exc.row is not None:
                exc.row = source[exc.row]
            raise
        return ChangeImages(rows, source, kinds, checksums)

    def _wire_images(
        self, raws: Sequence[RawDML]
    ) -> tuple[list[Any], list[Any], list[Checksum | None], int, avro_rows.AvroChunk | None]:
        """The chunk's `data` and `old` wire images, its checksums, its longest payload (no value is
        longer), and, where Avro rows were read columnar, their columns (the images are then indexes into
        them)."""
        payloads = list(map(_PAYLOAD, raws))
        longest = max(map(len, payloads), default=0)
        if raws and raws[0].encoding == "json":
            try:  # the fast path decodes the whole chunk at once; the per-row loop only names a bad row
                bodies = list(map(self._batch_body.decode, payloads))
                checksums = [b.checksum for b in bodies]
                return [b.data for b in bodies], [b.old for b in bodies], checksums, longest, None
            except (*JSON_ERRORS, AttributeError, RecursionError):
                pass
        if len(set(map(_ENCODING, raws))) > 1:  # an Avro payload fails the JSON path: settled here
            raise _MixedEncodings
        if raws and raws[0].encoding == "avro":
            columnar = avro_rows.read(self.columns, payloads)
            if columnar is not None:
                return columnar.datas, columnar.olds, columnar.checksums, longest, columnar
        bodies = [self._wire_body(raw, row, self._batch_body) for row, raw in enumerate(raws)]
        if raws and raws[0].encoding == "avro":
            checksums = [_avro_checksum(b["checksum"]) for b in bodies]
            return [b["data"] for b in bodies], [b["old"] for b in bodies], checksums, longest, None
        checksums = [b.checksum for b in bodies]
        return [b.data for b in bodies], [b.old for b in bodies], checksums, longest, None

    def _wire_body(self, raw: RawDML, row: int, decoder: msgspec.json.Decoder) -> Any:
        if raw.encoding == "avro":
            try:
                return avro_messages.read_dml(raw.payload)
            except MalformedMessageError as exc:
                raise ValueDecodeError(exc.reason, column="<row>", row=row) from exc
        try:
            return decoder.decode(raw.payload)
        except JSON_ERRORS as exc:
            problem = json_problem(exc, raw.payload)
            column = problem.column(_IMAGES, tuple(c.name for c in self.columns)) or "<row>"
            raise ValueDecodeError(str(problem), column=column, row=row) from exc
        except RecursionError as exc:  # skipping an unknown field nested that deep
            message = "message nests deeper than Python's recursion limit"
            raise DocumentTooDeepError(message, column="<row>", row=row) from exc

    def _image(
        self,
        images: list[Any],
        avro: bool,
        longest: int,
        columnar: avro_rows.AvroChunk | None = None,
    ) -> pa.RecordBatch:
        """One image of each row as a typed record batch; `longest`: the longest payload they came from;
        `columnar`: the Avro chunk the images index into, where it was read columnar."""
        if not self.columns:
            return pa.RecordBatch.from_pylist([{}] * len(images), schema=self._image_schema)
        if images.count(None) == len(images):  # e.g. the `old` image of a batch of INSERTs
            return pa.RecordBatch.from_arrays(
                [pa.nulls(len(images), c.arrow_type) for c in self.columns], schema=self._image_schema
            )
        if columnar is not None:
            arrays = columnar.typed(images)
        else:
            wire_columns = (
                self._json_columns(images) if self._fields and not avro else self._mapped_columns(images)
            )
            arrays = []
            for column, values in zip(self.columns, wire_columns, strict=True):
                arrays.append(column.from_avro(values) if avro else column.from_json(values))
        if longest > self.policy.limits.max_value_bytes:
            _check_value_sizes(self.columns, arrays, self.policy.limits.max_value_bytes)
        return pa.RecordBatch.from_arrays(arrays, schema=self._image_schema)

    def _json_columns(self, images: list[Any]) -> list[Sequence[Any]]:
        null_row: Any = self._null_row
        by_position = list(
            zip(*(astuple(image if image is not None else null_row) for image in images), strict=True)
        )
        return [by_position[position] for position in self._positions]

    def _mapped_columns(self, images: list[Any]) -> list[Sequence[Any]]:
        return [[None if image is None else image.get(c.name) for image in images] for c in self.columns]

    # -- typed per-row path --------------------------------------------------------------------------
    def decode(self, raw: RawDML) -> DML:
        """One DML with typed values; columns absent from the wire stay absent from the dicts."""
        with contained("decoding rows"):
            return self._decode_one(raw)

    def _decode_one(self, raw: RawDML) -> DML:
        body = self._wire_body(raw, 0, self._row_body)
        if raw.encoding == "avro":
            data, old = body["data"], body["old"]
            extras = _avro_extras(body)
        elif not self._fields:
            data, old = body.data, body.old
            extras = {
                "checksum": body.checksum,
                "handle_key_only": body.handleKeyOnly,
                "claim_check_location": body.claimCheckLocation,
            }
        else:
            data, old = self._struct_to_dict(body.data), self._struct_to_dict(body.old)
            extras = {
                "checksum": body.checksum,
                "handle_key_only": body.handleKeyOnly,
                "claim_check_location": body.claimCheckLocation,
            }
        return DML(
            type=raw.type,
            database=raw.database,
            table=raw.table,
            table_id=raw.table_id,
            commit_ts=raw.commit_ts,
            build_ts=raw.build_ts,
            schema_version=raw.schema_version,
            data=self._typed(data, raw, raw.type in _HAS_DATA),
            old=self._typed(old, raw, raw.type in _HAS_OLD),
            **extras,
        )

    def _struct_to_dict(self, image: Any) -> dict[str, Any] | None:
        if image is None:
            return None
        return {
            c.name: v
            for i, c in enumerate(self.columns)
            if (v := getattr(image, f"c{i}")) is not msgspec.UNSET
        }

    def _typed(self, image: dict[str, Any] | None, raw: RawDML, expected: bool) -> dict[str, Any] | None:
        if image is None:
            return {} if expected else None
        typed: dict[str, Any] = {}
        convert = "from_avro" if raw.encoding == "avro" else "from_json"
        known = {c.name: c for c in self.columns}
        for name, value in image.items():
            column = known.get(name)
            if column is None:
                raise ValueDecodeError("not in the table schema", column=name, row=0)
            typed[name] = column.to_python(getattr(column, convert)([value]))[0]
        return typed


class _MixedEncodings(Exception):
    """A chunk holds JSON and Avro rows: it is decoded again, one run of each at a time."""


def _decoded_at(
    raws: Sequence[RawDML], start: int, end: int, decode: Callable[[Sequence[RawDML]], _Decoded]
) -> _Decoded:
    """`decode` of raws[start:end]; an error names its row in `raws`."""
    try:
        return decode(raws[start:end])
    except ValueDecodeError as exc:
        if exc.row is not None:
            exc.row += start
        raise


def _encoding_runs(raws: Sequence[RawDML]) -> list[tuple[int, int]]:
    """(start, end) of each run of rows with one encoding."""
    runs = []
    start = 0
    for index in range(1, len(raws)):
        if raws[index].encoding != raws[start].encoding:
            runs.append((start, index))
            start = index
    return [*runs, (start, len(raws))]


def _check_value_sizes(columns: Sequence[ColumnType], arrays: list[pa.Array], limit: int) -> None:
    for column, array in zip(columns, arrays, strict=True):
        if pa.types.is_string(array.type) or pa.types.is_binary(array.type):
            sizes = pc.binary_length(array)
            if (pc.max(sizes).as_py() or 0) > limit:
                row = pc.index(pc.greater(sizes, limit), True).as_py()
                raise ValueTooLargeError(
                    f"value of {sizes[row].as_py()} bytes, beyond max_value_bytes = {limit}",
                    column=column.name,
                    row=row,
                )


_IMAGES = ("data", "old")  # a row's images: a column's JSON path starts with one
_ENCODING = attrgetter("encoding")
_PAYLOAD = attrgetter("payload")


# Go drops empty maps: an INSERT without `data` had every column filtered out; it still has a row.
_HAS_DATA = frozenset((DMLType.INSERT, DMLType.UPDATE))
_HAS_OLD = frozenset((DMLType.UPDATE, DMLType.DELETE))


def _avro_checksum(record: dict[str, Any] | None) -> Checksum | None:
    return None if record is None else Checksum(**record)


def _avro_extras(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "checksum": _avro_checksum(body["checksum"]),
        "handle_key_only": bool(body["handleKeyOnly"]),
        "claim_check_location": body["claimCheckLocation"] or "",
    }


def _json_body(
    schema: TableSchema, columns: Sequence[ColumnType], missing: Any
) -> tuple[msgspec.json.Decoder, type | None]:
    """A decoder for DML bodies of this table; rows become a per-table Struct where msgspec allows.

    msgspec cannot name fields with `\\`, `"` or control characters; such tables decode rows as dicts.
    """
    fields = []
    # Declared in the wire's key order (Go sorts map keys bytewise): msgspec matches in-order keys fastest.
    for i in sorted(range(len(columns)), key=lambda i: columns[i].name.encode()):
        kind = columns[i].json_wire | None
        fields.append((f"c{i}", kind | msgspec.UnsetType if missing is msgspec.UNSET else kind, missing))
    try:
        row: Any = msgspec.defstruct(
            f"Row_{schema.table}_{schema.version}",
            fields,
            rename={f"c{i}": c.name for i, c in enumerate(columns)},
            forbid_unknown_fields=True,  # a column the schema lacks means the wrong schema: never drop it
            gc=False,  # decoded wire values cannot form cycles; tracking them costs more than decoding
        )
    except ValueError:
        row = None
    image = row if row is not None else dict[str, dict[str, str] | str | None]
    body = msgspec.defstruct(
        "DMLBody",
        [
            ("data", image | None, None),
            ("old", image | None, None),
            ("checksum", Checksum | None, None),
            ("handleKeyOnly", bool, False),
            ("claimCheckLocation", str, ""),
        ],
        gc=False,
    )
    return msgspec.json.Decoder(body, strict=False), row  # lax: numeric text decodes to int/float
