"""Debezium row payloads of one table version -> typed Arrow images (docs/protocols/debezium.md), through a
msgspec Struct generated for the table."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from msgspec.structs import astuple

from consumer.errors import ValueDecodeError
from consumer.protocol.base import ImageKind, Images
from consumer.protocol.debezium.wire import BINARY, INTS, INVALID, MAX_TIME_US, NULL, U64, UNTYPED_JSON
from consumer.protocol.model import (
    DMLType,
    RawDML,
    TableSchema,
)
from consumer.protocol.parse_errors import json_problem, utf8_problem
from consumer.protocol.self_described import (
    enum_labels,
    set_labels,
)
from consumer.protocol.types import (
    ColumnType,
    ValuePolicy,
    in_python_range,
)


# -- rows ---------------------------------------------------------------------------------------------
def _wire_kind(column: ColumnType) -> Any:
    """What msgspec decodes a column's JSON value into (base64 text straight to bytes, in C)."""
    kind = column.data_type.mysql_type
    if kind in INTS or kind in ("date", "datetime", "time", "year"):
        return int
    if kind in ("float", "double"):
        return float
    if kind in BINARY:
        return bytes
    if kind == "bit":
        return bool if max(column.data_type.length, 1) == 1 else bytes
    if kind == "timestamp":
        return dt.datetime
    return str


class DebeziumRows:
    """The rows of one table version -> typed images, through a msgspec Struct generated for the table."""

    def __init__(self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy) -> None:
        self.schema = schema
        self.columns = tuple(columns)
        self.policy = policy
        self.image_schema = pa.schema([pa.field(c.name, c.arrow_type) for c in self.columns])
        self._untyped = bool(self.columns) and all(c.data_type == UNTYPED_JSON for c in self.columns)
        self._keys = set(schema.handle_key())
        fields = [
            (f"c{i}", msgspec.Raw, msgspec.Raw(NULL))
            if self._untyped
            else (f"c{i}", _wire_kind(c) | None, None)
            for i, c in enumerate(self.columns)
        ]
        try:
            row: Any = msgspec.defstruct(
                f"Debezium_{schema.table}",
                fields,
                rename={f"c{i}": c.name for i, c in enumerate(self.columns)},
            )
        except ValueError:  # names msgspec cannot rename to (`\\`, `"`, control characters)
            row = None
        self._row = row
        # Without a Struct, rows decode as dicts of raw JSON, each column's values then as its wire kind.
        self._values = [msgspec.json.Decoder(_wire_kind(c) | None) for c in self.columns]
        image = row if row is not None else dict[str, msgspec.Raw]
        self._decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_payload_struct(image))
        # TIMESTAMP columns read as text, parsed by Arrow (`_stamps_of_text`): pyarrow is slow to take
        # zone-aware datetimes. Only for the Struct: the dict path is the fallback's fallback.
        self._text_decoder: msgspec.json.Decoder[Any] | None = None
        if row is not None and not self._untyped and any(_is_stamp(c) for c in self.columns):
            text_row = msgspec.defstruct(
                f"DebeziumText_{schema.table}",
                [
                    (f"c{i}", (str if _is_stamp(c) else _wire_kind(c)) | None, None)
                    for i, c in enumerate(self.columns)
                ],
                rename={f"c{i}": c.name for i, c in enumerate(self.columns)},
            )
            self._text_decoder = msgspec.json.Decoder(_payload_struct(text_row))

    def images(self, raws: Sequence[RawDML]) -> Images:
        """The batch's `Images`, as the TiCDC Avro rows give them: `_CHUNK_ROWS` at a time, joined. Whatever
        a chunk raises, the whole batch is decoded again at once, which names the error it always named (the
        first bad column's first bad row of the batch) and counts the values the policy nulled once."""
        if len(raws) > _CHUNK_ROWS and self.columns:
            counted = [
                (stats, stats.unrepresentable)
                for stats in {id(c.stats): c.stats for c in self.columns}.values()
            ]
            try:
                return _joined(
                    [
                        self._chunk(raws[start : start + _CHUNK_ROWS])
                        for start in range(0, len(raws), _CHUNK_ROWS)
                    ],
                    _CHUNK_ROWS,
                    self.image_schema,
                )
            except Exception:  # the batch at once raises what is wrong
                for stats, count in counted:
                    stats.unrepresentable = count
        return self._chunk(raws)

    def _chunk(self, raws: Sequence[RawDML]) -> Images:
        if self._text_decoder is not None:
            # whatever the text path does not settle, the general path does, giving the same rows or naming
            # the bad record, row and column (a property test)
            with contextlib.suppress(Exception):
                return self._images(raws, self._text_decoder, text=True)
        return self._images(raws, self._decoder, text=False)

    def _images(self, raws: Sequence[RawDML], decoder: msgspec.json.Decoder[Any], *, text: bool) -> Images:
        decode = decoder.decode
        try:  # (map and attrgetter: no Python code runs per row)
            bodies = list(map(decode, map(_PAYLOAD_OF, raws)))
        except INVALID:
            bodies = None  # the loop below names the record
        if bodies is not None and all(map(is_, map(_TYPE_OF, raws), repeat(DMLType.INSERT))):
            inserted = list(map(_AFTER_OF, bodies))
            if None not in inserted:  # else the loop below names the record
                count = len(raws)
                return Images(
                    self._batch(inserted, text),
                    list(range(count)),
                    [ImageKind.INSERT] * count,
                    [False] * count,
                )
        images: list[Any] = []
        source: list[int] = []
        kinds: list[int] = []
        for index, raw in enumerate(raws):
            try:
                body = bodies[index] if bodies is not None else decode(raw.payload)
            except INVALID as exc:
                problem = json_problem(exc, raw.payload)
                column = problem.column(_IMAGES, tuple(c.name for c in self.columns)) or "<row>"
                raise ValueDecodeError(str(problem), column=column, row=index) from exc
            if raw.type is DMLType.UPDATE:
                if body.before is not None:
                    images.append(body.before)
                    source.append(index)
                    kinds.append(ImageKind.UPDATE_OLD)
                images.append(body.after)
                kinds.append(ImageKind.UPDATE_NEW)
            elif raw.type is DMLType.INSERT:
                images.append(body.after)
                kinds.append(ImageKind.INSERT)
            else:
                images.append(body.before)
                kinds.append(ImageKind.DELETE)
            source.append(index)
            if images[-1] is None:
                raise ValueDecodeError(
                    f"a Debezium {raw.type.value} without its row image", column="<row>", row=index
                )
        try:
            batch = self._batch(images, text)
        except ValueDecodeError as exc:
            if exc.row is not None:
                exc.row = source[exc.row]
            raise
        return Images(batch, source, kinds, [False] * len(images))

    def _batch(self, images: list[Any], text: bool = False) -> pa.RecordBatch:
        if self._row is not None and self.columns:
            values: list[Sequence[Any]] = (
                list(zip(*map(astuple, images), strict=True)) if images else [()] * len(self.columns)
            )
        else:
            values = [[image.get(c.name) for image in images] for c in self.columns]
            if not self._untyped:
                values = [
                    _wire_values(c, d, v) for c, d, v in zip(self.columns, self._values, values, strict=True)
                ]
        arrays = [
            _stamps_of_text(list(column_values))
            if text and _is_stamp(column)
            else self._typed(column, list(column_values))
            for column, column_values in zip(self.columns, values, strict=True)
        ]
        if not self.columns:
            return pa.RecordBatch.from_pylist([{}] * len(images), schema=self.image_schema)
        return pa.RecordBatch.from_arrays(arrays, schema=self.image_schema)

    def _typed(self, column: ColumnType, values: list[Any]) -> pa.Array:
        if self._untyped:
            return column.from_json(_json_texts(values, column.name))
        try:
            return _typed_values(column, values)
        except ValueDecodeError:
            raise
        except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
            for row, value in enumerate(values):
                try:
                    _typed_values(column, [value])
                except (pa.ArrowException, ValueError, TypeError, OverflowError) as bad:
                    raise ValueDecodeError(
                        f"value {value!r:.80} is not a valid {column.data_type.mysql_type}: {bad}",
                        column=column.name,
                        row=row,
                    ) from bad
            raise ValueDecodeError(str(exc), column=column.name) from exc


_PAYLOAD_OF, _TYPE_OF, _AFTER_OF = attrgetter("payload"), attrgetter("type"), attrgetter("after")
_CHUNK_ROWS = 2048
"""Rows decoded at a time: a chunk's Python values (the JSON decode's, transposed into columns, then read
into Arrow) stay in the core's cache, where a 10,000-row batch at once spills to memory."""


def _joined(parts: list[Images], size: int, schema: pa.Schema) -> Images:
    """The `Images` of consecutive chunks of `size` DMLs (the last may be shorter) as those of one batch."""
    columns = [pa.concat_arrays([part.rows.column(i) for part in parts]) for i in range(len(schema))]
    source: list[int] = []
    kinds: list[int] = []
    key_only: list[bool] = []
    for number, part in enumerate(parts):
        source += map((number * size).__add__, part.source)
        kinds += part.kinds
        key_only += part.key_only
    return Images(pa.RecordBatch.from_arrays(columns, schema=schema), source, kinds, key_only)


def _payload_struct(image: Any) -> Any:
    return msgspec.defstruct("Payload", [("before", image | None, None), ("after", image | None, None)])


def _is_stamp(column: ColumnType) -> bool:
    return column.data_type.mysql_type == "timestamp"


class _Unsettled(Exception):
    """A fast path's input it does not decide on: the general path decodes it."""


# ZonedTimestamp text as TiCDC writes it (`wire_value`), years 0001-9999 (year 0000 is refused apart, with
# `starts_with`: an alternation for it made RE2 take twice as long): within it, Arrow's parse accepts what
# msgspec's RFC 3339 parse accepts (both reject Feb 30, 24:00, leap seconds) with the same instant.
_STAMP_TEXT = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,6})?Z$"
_YEAR_ZERO = "0000"
_UTC_US = pa.timestamp("us", tz="UTC")


def _stamps_of_text(values: list[str | None]) -> pa.Array:
    """A TIMESTAMP column's wire text -> timestamp[us, UTC], as `_typed_values` makes of msgspec's datetimes;
    `_Unsettled` (or Arrow's error) for text outside `_STAMP_TEXT`, of year 0000, or that Arrow does not
    parse."""
    texts = pa.array(values, pa.string())
    if (
        pc.all(pc.match_substring_regex(texts, _STAMP_TEXT)).as_py() is False
        or pc.any(pc.starts_with(texts, _YEAR_ZERO)).as_py() is True
    ):
        raise _Unsettled("a TIMESTAMP not in TiCDC's layout")
    return in_python_range(texts.cast(_UTC_US))


def _wire_values(column: ColumnType, decoder: msgspec.json.Decoder[Any], raws: Sequence[Any]) -> list[Any]:
    """Raw JSON values of a column decoded as its Struct field would decode them."""
    out = []
    for row, raw in enumerate(raws):
        try:
            out.append(None if raw is None else decoder.decode(raw))
        except INVALID as exc:
            raise ValueDecodeError(str(json_problem(exc, raw)), column=column.name, row=row) from exc
    return out


def _json_texts(values: list[Any], name: str) -> list[str | None]:
    """Raw JSON values of an untyped column as text (msgspec does not check a Raw span's UTF-8)."""
    out: list[str | None] = []
    for row, value in enumerate(values):
        raw = None if value is None else bytes(value)
        try:
            out.append(None if raw is None or raw == NULL else raw.decode())
        except UnicodeDecodeError as exc:
            raise ValueDecodeError(str(utf8_problem(raw or b"")), column=name, row=row) from exc
    return out


def _typed_values(column: ColumnType, values: list[Any]) -> pa.Array:
    """One column's wire values (docs/protocols/debezium.md §6.1) -> its SDK Arrow array."""
    data_type = column.data_type
    kind = data_type.mysql_type
    if kind == "bigint" and data_type.unsigned:
        return column.from_json([v + U64 if v is not None and v < 0 else v for v in values])
    if kind in INTS or kind == "year":
        return column.from_json(values)
    if kind in ("float", "double"):
        return pa.array(values, pa.float64()).cast(column.arrow_type, safe=False)
    if kind == "date":
        return in_python_range(pa.array(values, pa.int32()).cast(pa.date32()))
    if kind == "datetime":
        unit = "ms" if data_type.decimal <= 3 else "us"
        return in_python_range(pa.array(values, pa.int64()).cast(pa.timestamp(unit)).cast(pa.timestamp("us")))
    if kind == "timestamp":
        return in_python_range(pa.array(values, pa.timestamp("us", tz="UTC")))
    if kind == "time":
        micros = pa.array(values, pa.int64())
        if len(micros) and pc.any(pc.greater(pc.abs(micros), MAX_TIME_US)).as_py():
            raise ValueError("duration beyond 838:59:59.999999")
        return micros.cast(pa.duration("us"))
    if kind == "bit":
        if max(data_type.length, 1) == 1:
            return pa.array(values, pa.bool_())
        return column.from_json([None if v is None else int.from_bytes(v, "little") for v in values])
    if kind == "enum":
        return enum_labels(pa.array(values, pa.string()), data_type.elements)
    if kind == "set":
        return set_labels(pa.array(values, pa.string()), data_type.elements)
    if kind in ("json", "vector"):
        return column.from_json(values)
    if kind in BINARY:
        return pa.array(values, pa.binary())
    return pa.array(values, pa.string())


_IMAGES = ("before", "after")  # a row's images: a column's JSON path starts with one
