"""Row checksums (docs/protocols/simple.md §8): TiDB's column-level CRC32 of a row image, to verify the rows
TiCDC sent.

One algorithm (docs/protocols/simple.md §8.3), two implementations that check each other in the property
tests:

- `wire_checksum` hashes one image from its wire values (JSON text, or Avro datums), value by value. It is
  the reference: the encoder side (the simulator, users' tests) computes checksums with it, and it settles
  every mismatch the fast path reports.
- `image_checksums` hashes typed Arrow images, column by column: each column's bytes are built by Arrow
  and numpy kernels, Arrow joins a row's bytes, and zlib hashes each row once. It reads the images the
  batch decode already built, so verifying does not parse the wire a second time.

The typed images cannot always reproduce the bytes TiCDC hashed (a zero date the value policy turned into
NULL; an ENUM whose member is the empty string), so a fast-path mismatch is re-checked on that row's wire
values before the row is rejected.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import math
import struct
import zlib
from collections.abc import Callable, Mapping, Sequence
from itertools import pairwise
from typing import Any
from zoneinfo import ZoneInfo

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from consumer.errors import ChecksumMismatchError, IntegrityError, RowCorruptedError
from consumer.protocol.base import ChangeImages, ImageKind
from consumer.protocol.model import Checksum, Column, DataType, RawDML
from consumer.protocol.simple import avro_messages
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ColumnType, _zone_name, fsp_of

_U64 = 0xFFFF_FFFF_FFFF_FFFF
_EIGHT_BYTE_TYPES = frozenset(
    ("tinyint", "smallint", "mediumint", "int", "bigint", "year", "enum", "set", "bit")
)
_BINARY_TYPES = frozenset(("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"))
_NEW_IMAGES = (ImageKind.INSERT, ImageKind.UPDATE_NEW)  # checked against `current`; the others `previous`
_NONE = Checksum(0, False, 0, 0)


# -- the reference: one image from its wire values ------------------------------------------------------
def wire_checksum(columns: Sequence[Column], image: Mapping[str, Any] | None) -> int:
    """The checksum of a wire image (a DML's `data` or `old` as JSON or Avro carries it), over the table's
    columns in schema order; a column absent from the image counts as NULL (a virtual generated column)."""
    crc = 0
    if not image:
        return crc
    for column in columns:
        value = image.get(column.name)
        if isinstance(value, tuple):  # an encoder's Avro (branch, datum) pair
            value = value[1]
        if value is not None:
            crc = zlib.crc32(wire_value_bytes(column.data_type, value), crc)
    return crc


def wire_value_bytes(data_type: DataType, value: Any) -> bytes:
    """The bytes TiDB hashes for one non-NULL value (docs/protocols/simple.md §8.3), from its JSON or Avro
    wire form."""
    kind = data_type.mysql_type
    if kind in _EIGHT_BYTE_TYPES:
        return (_wire_int(value) & _U64).to_bytes(8, "little")
    if kind in ("float", "double"):
        number = float(value)
        if kind == "float":
            number = float(np.float32(number))
        return struct.pack("<d", number if math.isfinite(number) else 0.0)
    if kind in _BINARY_TYPES:
        return _length_value(value if isinstance(value, bytes) else base64.b64decode(value, validate=True))
    if kind == "timestamp":
        return _length_value(_utc_text(value).encode())
    if kind == "vector":
        elements = [float(x) for x in value[1:-1].split(",")] if value != "[]" else []
        return struct.pack("<I", len(elements)) + np.asarray(elements, "<f4").tobytes()
    return _length_value(str(value).encode())  # decimal, text, date, datetime, time, json: as sent


def _wire_int(value: Any) -> int:
    if isinstance(value, dict):  # Avro UnsignedBigint
        return int(value["value"])
    return int(value)


def _length_value(raw: bytes) -> bytes:
    return struct.pack("<I", len(raw)) + raw


def _utc_text(value: Any) -> str:
    """A TIMESTAMP's wall-clock text in its `location`, as UTC text with as many fractional digits."""
    if isinstance(value, dict):
        location, text = value["location"], value["value"]
    else:
        location, text = value.location, value.value
    if location == "UTC" or text.startswith("0000-") or "-00" in text[:10]:
        return text  # UTC already, or a zero date (TiDB hashes it unchanged)
    local = dt.datetime.fromisoformat(text).replace(tzinfo=ZoneInfo(_zone_name(location)))
    utc = local.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
    digits = len(text) - 20 if "." in text else 0
    return utc[: 20 + digits] if digits else utc[:19]


def dml_wire_images(raw: RawDML) -> tuple[Any, Any]:
    """A DML's `data` and `old` wire images, parsed generically (one row at a time: the settling path)."""
    if raw.encoding == "avro":
        body = avro_messages.read_dml(raw.payload)
        return body["data"], body["old"]
    body = msgspec.json.decode(raw.payload)
    return body.get("data"), body.get("old")


# -- the fast path: typed Arrow images, column by column ------------------------------------------------
def image_checksums(columns: Sequence[ColumnType], rows: pa.RecordBatch) -> list[int]:
    """The checksum of every row of typed images of one table version (`TableCodec.columns`, in order)."""
    pieces = [
        piece
        for column, array in zip(columns, rows.columns, strict=True)
        if array.null_count < len(array)
        for piece in _COLUMN_BYTES[column.family](column, array)
    ]
    if not pieces:
        return [0] * rows.num_rows
    empty = _empty()
    joined = pc.fill_null(pc.binary_join_element_wise(*pieces, empty, null_handling="skip"), empty)
    bounds = np.frombuffer(joined.buffers()[1], np.int64, len(joined) + 1, joined.offset * 8).tolist()
    data = memoryview(joined.buffers()[2] or b"")
    crc = zlib.crc32
    return [crc(data[start:end]) for start, end in pairwise(bounds)]


@functools.cache
def _empty() -> pa.Scalar:
    """b"" as the joins' separator (made on first use: building a scalar imports pandas into pyarrow)."""
    return pa.scalar(b"", pa.large_binary())


def _validity(array: pa.Array) -> pa.Buffer | None:
    return pc.is_valid(array).buffers()[1] if array.null_count else None


def _binary(n: int, validity: pa.Buffer | None, offsets: np.ndarray, data: np.ndarray) -> pa.Array:
    return pa.Array.from_buffers(
        pa.large_binary(), n, [validity, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data)]
    )


def _eight_bytes(values: np.ndarray, array: pa.Array) -> list[pa.Array]:
    """Each value as 8 little-endian bytes (uint64 bits, or the IEEE bits of a double)."""
    n = len(values)
    data = values.astype(values.dtype.newbyteorder("<")).view(np.uint8)
    return [_binary(n, _validity(array), np.arange(0, 8 * (n + 1), 8), data)]


def _prefix(counts: np.ndarray, validity: pa.Buffer | None) -> pa.Array:
    """Each row's uint32 little-endian count (a byte length, or a vector's dimension) as 4 bytes."""
    n = len(counts)
    return _binary(n, validity, np.arange(0, 4 * (n + 1), 4), counts.astype("<u4").view(np.uint8))


def _length_prefixed(text: pa.Array, validity: pa.Buffer | None) -> list[pa.Array]:
    """Strings or bytes as TiDB hashes them: uint32 byte length, then the bytes (two pieces, which the
    row join concatenates: nothing is copied twice)."""
    raw = pc.cast(text, pa.large_binary())
    offsets = np.frombuffer(raw.buffers()[1], np.int64, len(raw) + 1, raw.offset * 8)
    return [_prefix(np.diff(offsets), validity), raw]


def _unsigned(array: pa.Array) -> np.ndarray:
    """Integers (bool, intN, or decimal(20,0) for BIGINT UNSIGNED) as uint64 bits."""
    if pa.types.is_boolean(array.type):
        return np.asarray(pc.cast(pc.fill_null(array, False), pa.uint8())).astype(np.uint64)
    if pa.types.is_decimal(array.type):
        return np.asarray(pc.cast(pc.fill_null(array, 0), pa.uint64()))
    return np.asarray(pc.fill_null(array, 0)).astype(np.int64).view(np.uint64)


def _integer_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    return _eight_bytes(_unsigned(array), array)


def _float_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    doubles = np.asarray(pc.fill_null(array, 0.0)).astype(np.float64)
    return _eight_bytes(np.where(np.isfinite(doubles), doubles, 0.0), array)


def _enum_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    labels = pa.array(["", *column.data_type.elements], pa.string())
    index = pc.fill_null(pc.index_in(array, value_set=labels), 0)
    return _eight_bytes(np.asarray(index).astype(np.uint64), array)


def _set_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    members = pc.split_pattern(pc.fill_null(array, ""), ",")
    elements = pa.array(column.data_type.elements, pa.string())
    bits = np.asarray(pc.fill_null(pc.index_in(pc.list_flatten(members), value_set=elements), -1))
    rows = np.asarray(pc.list_parent_indices(members))
    masks = np.zeros(len(array), np.uint64)
    named = bits >= 0
    np.bitwise_or.at(masks, rows[named], np.left_shift(np.uint64(1), bits[named].astype(np.uint64)))
    return _eight_bytes(masks, array)


def _text_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    return _length_prefixed(array, _validity(array))


def _decimal_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    """Decimals as TiDB prints them: every digit of the scale, never an exponent (Arrow prints small
    values of a scale above 6 with one, so those few are printed by Python)."""
    if pa.types.is_string(array.type):  # beyond 38 digits the column keeps the wire text
        return _length_prefixed(array, _validity(array))
    text = pc.cast(array, pa.string())
    if pc.any(pc.match_substring(text, "E")).as_py():
        text = pa.array([None if v is None else format(v, "f") for v in array.to_pylist()], pa.string())
    return _length_prefixed(text, _validity(array))


def _date_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    days = np.asarray(pc.fill_null(array.cast(pa.int32()), 0)).astype(np.int64)
    return _fixed_text(_date_fields(days), array)


def _datetime_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    """DATETIME, and TIMESTAMP (its typed value is UTC, which is what TiDB hashes): the fsp's digits."""
    micros = np.asarray(pc.fill_null(array.cast(pa.int64()), 0))
    days, micros = np.divmod(micros, 86_400_000_000)
    seconds, fraction = np.divmod(micros, 1_000_000)
    fields = [*_date_fields(days), " ", *_clock_fields(seconds, 2)]
    return _fixed_text(fields + _fraction_fields(fraction, fsp_of(column.data_type)), array)


def _time_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    """TIME as TiDB's Duration prints it: [-]HH:MM:SS[.f...], hours of two or three digits."""
    micros = np.asarray(pc.fill_null(array.cast(pa.int64()), 0))
    seconds, fraction = np.divmod(np.abs(micros), 1_000_000)
    fields = ["-", *_clock_fields(seconds, 3), *_fraction_fields(fraction, fsp_of(column.data_type))]
    keep = np.ones((len(micros), _width(fields)), bool)
    keep[:, 0] = micros < 0  # the sign only when negative
    keep[:, 1] = seconds >= 100 * 3600  # a third hour digit only when needed
    return _fixed_text(fields, array, keep)


_DIGIT_PAIRS = np.frombuffer("".join(f"{i:02d}" for i in range(100)).encode(), np.uint8).reshape(100, 2)
_Field = str | tuple[np.ndarray, int]  # a literal, or numbers printed with that many digits


def _date_fields(days: np.ndarray) -> list[_Field]:
    """Proleptic Gregorian year, month and day of days since 1970-01-01 (H. Hinnant's civil_from_days)."""
    shifted = days + 719_468
    era = np.floor_divide(shifted, 146_097)
    day_of_era = shifted - era * 146_097
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36_524 - day_of_era // 146_096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    month_from_march = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * month_from_march + 2) // 5 + 1
    month = np.where(month_from_march < 10, month_from_march + 3, month_from_march - 9)
    year = year_of_era + era * 400 + (month <= 2)
    return [(year, 4), "-", (month, 2), "-", (day, 2)]


def _clock_fields(seconds: np.ndarray, hour_digits: int) -> list[_Field]:
    hours, rest = np.divmod(seconds, 3600)
    return [(hours, hour_digits), ":", (rest // 60, 2), ":", (rest % 60, 2)]


def _fraction_fields(micros: np.ndarray, fsp: int) -> list[_Field]:
    return [".", (micros // 10 ** (6 - fsp), fsp)] if fsp else []


def _width(fields: list[_Field]) -> int:
    return sum(1 if isinstance(field, str) else field[1] for field in fields)


def _fixed_text(fields: list[_Field], array: pa.Array, keep: np.ndarray | None = None) -> list[pa.Array]:
    """Text of fixed-width fields as TiDB hashes it (uint32 length, then the bytes), printed digit by digit
    for the whole column at once; `keep` drops a row's unused leading characters."""
    width = _width(fields)
    text = np.empty((len(array), 4 + width), np.uint8)
    position = 4
    for field in fields:
        if isinstance(field, str):
            text[:, position] = ord(field)
            position += 1
            continue
        numbers, digits = field
        if digits % 2:  # an odd leading digit alone, then two digits at a time from a table
            text[:, position] = numbers // 10 ** (digits - 1) % 10 + 48
            position += 1
        for power in range(digits - digits % 2 - 2, -1, -2):
            text[:, position : position + 2] = _DIGIT_PAIRS[numbers // 10**power % 100]
            position += 2
    lengths = np.full(len(array), width, np.uint32) if keep is None else keep.sum(axis=1, dtype=np.uint32)
    text[:, :4] = lengths.astype("<u4").view(np.uint8).reshape(-1, 4)
    data = text.ravel() if keep is None else text[np.hstack([np.ones((len(array), 4), bool), keep])]
    offsets = np.concatenate([[0], np.cumsum(lengths.astype(np.int64) + 4)])
    return [_binary(len(array), _validity(array), offsets, data)]


def _vector_bytes(column: ColumnType, array: pa.Array) -> list[pa.Array]:
    """VECTOR as binary: uint32 dimension, then each element's float32 bytes (the elements' buffer as is)."""
    offsets = np.asarray(array.offsets).astype(np.int64)
    elements = pa.py_buffer(np.asarray(array.values).astype("<f4"))
    validity = _validity(array)
    data = pa.Array.from_buffers(
        pa.large_binary(), len(array), [validity, pa.py_buffer(offsets * 4), elements]
    )
    return [_prefix(np.diff(offsets), validity), data]


_COLUMN_BYTES: dict[str, Callable[[ColumnType, pa.Array], list[pa.Array]]] = {
    "integer": _integer_bytes,
    "year": _integer_bytes,
    "bit": _integer_bytes,
    "float": _float_bytes,
    "enum": _enum_bytes,
    "set": _set_bytes,
    "text": _text_bytes,
    "binary": _text_bytes,
    "json": _text_bytes,
    "decimal": _decimal_bytes,
    "date": _date_bytes,
    "datetime": _datetime_bytes,
    "timestamp": _datetime_bytes,
    "time": _time_bytes,
    "vector": _vector_bytes,
}


# -- verifying a batch ------------------------------------------------------------------------------------
def verify_changes(
    codec: TableCodec, images: ChangeImages, raws: Sequence[RawDML]
) -> tuple[int, dict[int, IntegrityError]]:
    """Check every image of a decoded batch that carries a checksum: the number verified, and the DMLs
    (index in `raws`) that failed, each with why. A zero expected value means "no checksum"
    (docs/protocols/simple.md §8.1)."""
    checksums = images.checksums
    rejected: dict[int, IntegrityError] = {
        row: _corrupted(checksum, row)
        for row, checksum in enumerate(checksums)
        if checksum is not None and checksum.corrupted
    }
    expected = [
        _expected(checksums[source], kind) for source, kind in zip(images.source, images.kinds, strict=True)
    ]
    targets = [i for i, value in enumerate(expected) if value and images.source[i] not in rejected]
    if not targets:
        return 0, rejected
    rows = images.rows if len(targets) == len(expected) else images.rows.take(targets)
    computed = image_checksums(codec.columns, rows)
    suspects = {images.source[i] for i, crc in zip(targets, computed, strict=True) if crc != expected[i]}
    verified = len(targets)
    for row in sorted(suspects):
        failure = _settled(codec, raws[row], checksums[row] or _NONE, row)
        if failure is not None:
            rejected[row] = failure
            verified -= sum(1 for i in targets if images.source[i] == row)
    return verified, rejected


def _expected(checksum: Checksum | None, kind: int) -> int:
    if checksum is None:
        return 0
    return checksum.current if kind in _NEW_IMAGES else checksum.previous


def _corrupted(checksum: Checksum, row: int) -> RowCorruptedError:
    return RowCorruptedError(
        f"TiCDC marked the row corrupted (checksum version {checksum.version}, "
        f"current {checksum.current}, previous {checksum.previous})",
        row=row,
    )


def _settled(codec: TableCodec, raw: RawDML, checksum: Checksum, row: int) -> IntegrityError | None:
    """Re-check a fast-path mismatch on the row's wire values: None when they match after all."""
    data, old = dml_wire_images(raw)
    columns = codec.schema.columns
    for name, wire, expected in (("new", data, checksum.current), ("old", old, checksum.previous)):
        if not expected:
            continue
        computed = wire_checksum(columns, wire)
        if computed != expected:
            field = "current" if name == "new" else "previous"
            return ChecksumMismatchError(
                f"checksum mismatch on the {name} image: TiCDC sent {field}={expected}, "
                f"the row's values hash to {computed}",
                row=row,
            )
    return None


def row_checksum(codec: TableCodec, row: Mapping[str, Any] | None) -> int:
    """The checksum of a typed row (what an encoder puts in `checksum`), computed on its JSON wire form."""
    return wire_checksum(codec.schema.columns, codec.encode_image(dict(row) if row else None, "json"))
