"""The mysqlType table: every column's Python value, Arrow type and Spark type, and its wire forms.

Decoding is columnar: a column's wire values of a whole batch become one Arrow array through vectorized
casts, and per-row Python values are read back from that array, so there is exactly one conversion per
type. When a vectorized conversion fails, the batch is re-run value by value only to name the bad row.
"""

from __future__ import annotations

import binascii
import datetime as dt
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Context, Decimal
from operator import attrgetter, itemgetter
from typing import Any, ClassVar, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from consumer.errors import (
    DocumentTooDeepError,
    EncodeError,
    UnrepresentableValueError,
    UnsupportedTypeError,
    ValueDecodeError,
)
from consumer.protocol.limits import DecodeLimits, nesting_depth
from consumer.protocol.model import Column, DataType
from consumer.protocol.parse_errors import json_problem

UNSIGNED_BIGINT = "com.pingcap.simple.avro.UnsignedBigint"
AVRO_TIMESTAMP = "com.pingcap.simple.avro.Timestamp"
_U64 = 0xFFFF_FFFF_FFFF_FFFF


class JsonNull:
    """The JSON literal `null` stored in a JSON column, distinct from SQL NULL (None)."""

    _instance: ClassVar[JsonNull | None] = None

    def __new__(cls) -> JsonNull:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "JSON_NULL"

    def __bool__(self) -> bool:
        return False


JSON_NULL = JsonNull()


@dataclass
class DecodeStats:
    """Values the policy turned into NULL instead of failing (MySQL zero dates and the like), and row images
    whose checksum was verified."""

    unrepresentable: int = 0
    verified: int = 0


@dataclass(frozen=True)
class ValuePolicy:
    """How values are decoded and encoded.

    `unrepresentable`: what to do with valid MySQL values Python cannot hold, such as `0000-00-00`:
    "null" (default) stores NULL and counts it in the decoding's `DecodeStats`; "raise" fails the record.
    `timestamp_location`: the zone the encoder writes TIMESTAMP values in (TiCDC's `--tz`), and the zone
    TiCDC Avro's TIMESTAMP text is read in (that protocol does not say).
    `verify_checksums`: check the row checksums TiCDC sends (docs/protocols/simple.md §8) when a row carries
    them.
    `unknown_types`: a mysqlType this SDK does not know (a newer TiDB) is kept as its wire text ("lossless",
    default) or makes its table's schema rejected, so its rows go to the error policy ("error").
    `limits`: the `DecodeLimits` a record must stay within.
    """

    unrepresentable: Literal["null", "raise"] = "null"
    timestamp_location: str = "UTC"
    verify_checksums: bool = True
    unknown_types: Literal["lossless", "error"] = "lossless"
    limits: DecodeLimits = field(default_factory=DecodeLimits)


def fsp_of(data_type: DataType) -> int:
    """Fractional-second digits; Avro drops `decimal` for datetime/time, so recover it from `length`."""
    if data_type.decimal > 0:
        return data_type.decimal
    base = 11 if data_type.mysql_type == "time" else 20
    return max(0, data_type.length - base) if data_type.length > base - 1 else 0


def float32_text(value: float) -> str:
    """Go's FormatFloat(f, 'f', -1, 32): shortest float32 round-trip digits, no exponent."""
    return np.format_float_positional(np.float32(value), unique=True, trim="-")


def float64_text(value: float) -> str:
    return np.format_float_positional(np.float64(value), unique=True, trim="-")


class ColumnType:
    """Conversions for one column. Subclasses set the Arrow type and the wire rules of their family."""

    family: ClassVar[str] = ""
    # What the per-table JSON Struct decodes this column's string into: msgspec converts numeric text to
    # int/float in C (lax mode), which is cheaper than building a string array and casting it.
    json_wire: ClassVar[Any] = str
    # Whether the Simple Avro wire value is the text MySQL prints (read by `_from_text`)
    avro_text_wire: ClassVar[bool] = False

    def __init__(self, column: Column, policy: ValuePolicy, stats: DecodeStats | None = None) -> None:
        self.column = column
        self.name = column.name
        self.data_type = column.data_type
        self.policy = policy
        self.stats = DecodeStats() if stats is None else stats
        self.arrow_type = self._arrow_type()

    # -- decoding ---------------------------------------------------------------------------------
    def from_json(self, values: Sequence[Any]) -> pa.Array:
        """JSON wire values (strings, or dicts for timestamps) of a batch -> one Arrow array."""
        return self._guarded(values, self._json_array)

    def from_avro(self, values: Sequence[Any]) -> pa.Array:
        """fastavro-decoded map values of a batch -> one Arrow array."""
        return self._guarded(values, self._avro_array)

    def from_text(self, text: pa.Array) -> pa.Array:
        """A batch already in Arrow as the text MySQL prints (TiCDC Avro's wire form of temporal types,
        string-mode DECIMAL and BIGINT UNSIGNED): the vectorized conversion, else `from_json`'s per-value
        path (the policy, or an error naming the row). For the families whose JSON wire value is that text:
        numbers, decimal, date, datetime, time."""
        try:
            return self._from_text(text)
        except (pa.ArrowException, ValueError, TypeError, OverflowError, KeyError, binascii.Error):
            return self.from_json(text.to_pylist())

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        """`from_avro(values.to_pylist())` for a batch read columnar from a Simple Avro value union, all of
        the union's `branch`, where a vectorized conversion gives the same; None where it cannot (then
        `from_avro` decides). Raises on a value that does not convert."""
        if branch == "string" and self.avro_text_wire:
            return self._from_text(values.cast(pa.string()))
        return None

    def to_python(self, array: pa.Array) -> list[Any]:
        return array.to_pylist()

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        if self.json_wire is not str and not _holds_text(values):
            return self._from_numbers(values)
        return self._from_text(pa.array(values, pa.string()))

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        return self._json_array(values)

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        raise TypeError(f"{self.family} values are text on the wire")

    def _from_text(self, text: pa.Array) -> pa.Array:
        return pc.cast(text, self.arrow_type)

    def _guarded(self, values: Sequence[Any], convert: Callable[[Sequence[Any]], pa.Array]) -> pa.Array:
        try:
            return convert(values)
        except CONVERSION_ERRORS as exc:
            first_error = exc
        return self._convert_each(values, convert, first_error)

    def _convert_each(
        self, values: Sequence[Any], convert: Callable[[Sequence[Any]], pa.Array], first_error: Exception
    ) -> pa.Array:
        """Slow path for a batch with a bad value: apply the policy or name the row."""
        pieces = []
        for row, value in enumerate(values):
            try:
                pieces.append(convert([value]))
            except CONVERSION_ERRORS as exc:
                pieces.append(self._unconvertible(row, value, exc))
        if not pieces:
            raise ValueDecodeError(str(first_error), column=self.name)
        return pa.concat_arrays(pieces)

    def _unconvertible(self, row: int, value: Any, exc: Exception) -> pa.Array:
        if self._is_unrepresentable(value):
            if self.policy.unrepresentable == "raise":
                raise UnrepresentableValueError(
                    f"{self.data_type.mysql_type} value {value!r} has no Python equivalent",
                    column=self.name,
                    row=row,
                )
            self.stats.unrepresentable += 1
            return pa.nulls(1, self.arrow_type)
        if isinstance(exc, _DocumentTooDeep):
            raise DocumentTooDeepError(str(exc), column=self.name, row=row) from exc
        raise ValueDecodeError(
            f"value {_short(value)} is not a valid {self.data_type.mysql_type}: {_first_line(exc)}",
            column=self.name,
            row=row,
        ) from exc

    def _is_unrepresentable(self, value: Any) -> bool:
        return False

    # -- encoding ---------------------------------------------------------------------------------
    def to_json(self, value: Any) -> Any:
        """Typed value -> the JSON wire value TiCDC emits (None for SQL NULL)."""
        if value is None:
            return None
        try:
            return self._json_value(value)
        except (TypeError, ValueError, OverflowError, ArithmeticError) as exc:
            raise EncodeError(f"column {self.name!r}: cannot encode {value!r}: {exc}") from exc

    def to_avro(self, value: Any) -> Any:
        """Typed value -> (branch name, datum) for the Avro map-value union, or None."""
        if value is None:
            return None
        try:
            return self._avro_value(value)
        except (TypeError, ValueError, OverflowError, ArithmeticError) as exc:
            raise EncodeError(f"column {self.name!r}: cannot encode {value!r}: {exc}") from exc

    def _json_value(self, value: Any) -> Any:
        return str(value)

    def _avro_value(self, value: Any) -> Any:
        return ("string", self._json_value(value))

    def _arrow_type(self) -> pa.DataType:
        raise NotImplementedError  # every registered subclass defines it


# What a wire value of the wrong shape makes a conversion raise (a str where a Timestamp record belongs has no
# `.value`; Decimal("abc") is an ArithmeticError).
CONVERSION_ERRORS = (pa.ArrowException, ValueError, TypeError, LookupError, AttributeError, ArithmeticError)


class _DocumentTooDeep(ValueError):
    """Raised inside a conversion; reported as `DocumentTooDeepError` for the row."""


def _holds_text(values: Sequence[Any]) -> bool:
    """Whether a batch came as text (the dict fallback, or `decode` on a single value) or as numbers."""
    return isinstance(next((v for v in values if v is not None), ""), str)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


# -- integers -------------------------------------------------------------------------------------
_INT_WIDTH = {"tinyint": 8, "smallint": 16, "mediumint": 24, "int": 32, "bigint": 64}
# Spark has no unsigned types: unsigned columns widen to the next signed type (bigint to decimal(20,0)).
_SPARK_SAFE_INT = {
    ("tinyint", False): pa.int8(),
    ("tinyint", True): pa.int16(),
    ("smallint", False): pa.int16(),
    ("smallint", True): pa.int32(),
    ("mediumint", False): pa.int32(),
    ("mediumint", True): pa.int32(),
    ("int", False): pa.int32(),
    ("int", True): pa.int64(),
    ("bigint", False): pa.int64(),
    ("bigint", True): pa.decimal128(20, 0),
}


class IntegerColumn(ColumnType):
    family = "integer"

    @property
    def _bits(self) -> int:
        return _INT_WIDTH[self.data_type.mysql_type]

    @property
    def _range(self) -> tuple[int, int]:
        bits = self._bits
        if self.data_type.unsigned:
            return 0, (1 << bits) - 1
        return -(1 << (bits - 1)), (1 << (bits - 1)) - 1

    def _arrow_type(self) -> pa.DataType:
        return _SPARK_SAFE_INT[(self.data_type.mysql_type, self.data_type.unsigned)]

    def _exact_type(self) -> pa.DataType:
        """The narrowest Arrow type whose range is the column's: parsing into it range-checks for free."""
        bits = 32 if self._bits == 24 else self._bits
        return getattr(pa, f"{'u' if self.data_type.unsigned else ''}int{bits}")()

    def _from_text(self, text: pa.Array) -> pa.Array:
        return self._checked(pc.cast(text, self._exact_type()))

    json_wire = int

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        if self.data_type.unsigned and self._bits == 64:
            values = [_avro_unsigned_bigint(v) for v in values]
        return self._from_numbers(values)

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        return self._checked(pa.array(values, self._exact_type()))

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        unsigned_bigint = self.data_type.unsigned and self._bits == 64
        if branch == "long" and not unsigned_bigint:
            return self._checked(pc.cast(values, self._exact_type()))
        if branch.endswith(".UnsignedBigint") and unsigned_bigint:
            (signed,) = values.flatten()
            return self._checked(signed.view(pa.uint64()))
        return None

    def _checked(self, exact: pa.Array) -> pa.Array:
        if self._bits == 24 and len(exact):
            low, high = self._range
            bad = pc.or_(pc.less(exact, low), pc.greater(exact, high))
            if pc.any(bad).as_py():
                raise ValueError(
                    f"out of range for mediumint{' unsigned' if self.data_type.unsigned else ''}"
                )
        return pc.cast(exact, self.arrow_type)

    def to_python(self, array: pa.Array) -> list[Any]:
        values = array.to_pylist()
        if pa.types.is_decimal(array.type):
            return [None if v is None else int(v) for v in values]
        return values

    def _json_value(self, value: Any) -> Any:
        integer = _exact_int(value)
        low, high = self._range
        if not low <= integer <= high:
            raise ValueError(f"{integer} outside [{low}, {high}]")
        return str(integer)

    def _avro_value(self, value: Any) -> Any:
        integer = int(self._json_value(value))
        if self.data_type.unsigned and self._bits == 64:
            return (UNSIGNED_BIGINT, {"value": integer - (1 << 64) if integer >= 1 << 63 else integer})
        return ("long", integer)


def _avro_unsigned_bigint(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dict) and "value" in value:
        return value["value"] & _U64
    raise TypeError(f"expected Avro UnsignedBigint record, got {type(value).__name__}")


def _exact_int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"expected int, got {type(value).__name__}")
    return int(value)


class YearColumn(ColumnType):
    family = "year"

    def _arrow_type(self) -> pa.DataType:
        return pa.int32()

    json_wire = int

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        return self._from_numbers(values)

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        return pa.array(values, pa.int32())

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        return pc.cast(values, pa.int32()) if branch == "long" else None

    def _json_value(self, value: Any) -> Any:
        year = _exact_int(value)
        if not (year == 0 or 1901 <= year <= 2155):
            raise ValueError(f"year {year} outside 0, 1901..2155")
        return str(year)

    def _avro_value(self, value: Any) -> Any:
        return ("long", int(self._json_value(value)))


# -- floating point and decimal -------------------------------------------------------------------
class FloatColumn(ColumnType):
    family = "float"

    def _arrow_type(self) -> pa.DataType:
        return pa.float32() if self.data_type.mysql_type == "float" else pa.float64()

    def _from_text(self, text: pa.Array) -> pa.Array:
        return pc.cast(pc.cast(text, pa.float64()), self.arrow_type)

    # Text, unlike the integer families: msgspec's lax conversion reads "-0" as the integer 0 and loses the
    # sign of a negative zero, which Arrow's cast keeps.

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        if any(isinstance(v, bool | str | bytes) for v in values):
            raise TypeError("expected an Avro float/double")
        return self._from_numbers(values)

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        return pa.array(values, self.arrow_type)

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        if branch == "float" or (branch == "double" and pa.types.is_float64(self.arrow_type)):
            return values.cast(self.arrow_type)
        return None

    def _json_value(self, value: Any) -> Any:
        number = float(value)
        return float32_text(number) if self.data_type.mysql_type == "float" else float64_text(number)

    def _avro_value(self, value: Any) -> Any:
        return ("float" if self.data_type.mysql_type == "float" else "double", float(value))


_WIDE = Context(prec=100)  # MySQL decimals reach 65 digits; the default context rounds at 28


class DecimalColumn(ColumnType):
    family = "decimal"
    avro_text_wire = True

    @property
    def _precision(self) -> int:
        return self.data_type.length if self.data_type.length > 0 else 10

    def _arrow_type(self) -> pa.DataType:
        if self._precision > 38:
            return pa.string()
        return pa.decimal128(self._precision, self.data_type.decimal)

    def _from_text(self, text: pa.Array) -> pa.Array:
        if pa.types.is_string(self.arrow_type):
            try:  # Arrow's 256-bit decimals check the digits at C speed; what they refuse, Python judges
                pc.cast(text, pa.decimal256(self._precision, self.data_type.decimal))
            except pa.ArrowInvalid:
                for value in text.to_pylist():
                    if value is not None:
                        self._parse_wide(value)
            return text
        return pc.cast(text, self.arrow_type)

    def _parse_wide(self, text: str) -> Decimal:
        number = Decimal(text)
        if not number.is_finite() or len(number.as_tuple().digits) > self._precision:
            raise ValueError(f"{text!r} does not fit decimal({self._precision},{self.data_type.decimal})")
        return number

    def to_python(self, array: pa.Array) -> list[Any]:
        if pa.types.is_string(array.type):
            return [None if v is None else Decimal(v) for v in array.to_pylist()]
        return array.to_pylist()

    def _json_value(self, value: Any) -> Any:
        scale = self.data_type.decimal
        number = Decimal(value).quantize(Decimal(1).scaleb(-scale), context=_WIDE)
        text = format(abs(number) if number.is_zero() else number, "f")  # TiDB never prints -0
        if len(number.as_tuple().digits) > self._precision:
            raise ValueError(f"{value} does not fit decimal({self._precision},{scale})")
        return text


# -- strings, binary, json, vector ----------------------------------------------------------------
class TextColumn(ColumnType):
    family = "text"

    def _arrow_type(self) -> pa.DataType:
        return pa.string()

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        return pa.array(values, pa.string())

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        return values.cast(pa.string()) if branch == "string" else None

    def _json_value(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise TypeError(f"expected str, got {type(value).__name__}")
        return value


class BinaryColumn(ColumnType):
    family = "binary"

    def _arrow_type(self) -> pa.DataType:
        return pa.binary()

    json_wire = bytes  # msgspec decodes the base64 text in C, strictly (padding, alphabet)

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        if not _holds_text(values):
            return pa.array(values, pa.binary())
        decode = binascii.a2b_base64
        return pa.array([None if v is None else decode(v, strict_mode=True) for v in values], pa.binary())

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        return pa.array(values, pa.binary())

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        return values.cast(pa.binary()) if branch == "bytes" else None

    def _json_value(self, value: Any) -> Any:
        return binascii.b2a_base64(bytes(value), newline=False).decode("ascii")

    def _avro_value(self, value: Any) -> Any:
        return ("bytes", bytes(value))


class JsonColumn(ColumnType):
    """Arrow/Spark keep the JSON text; the Python value is the parsed document.

    A document is accepted only if it is valid JSON nested no deeper than `max_nesting_depth` (TiDB itself
    stops at 100), so reading it back later cannot fail. Numbers beyond msgspec's range, which TiDB never
    writes (a 5,000-digit integer, `1e400`), are read back by Python's `json` instead (as a Decimal, inf).
    """

    family = "json"

    def _arrow_type(self) -> pa.DataType:
        return pa.string()

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        text = pa.array(values, pa.string())
        documents = [v for v in values if v is not None]
        limit = self.policy.limits.max_nesting_depth
        if len(text) and (pc.max(pc.binary_length(text)).as_py() or 0) > limit:
            _check_depth(documents, limit)  # first: deeper than the recursion limit, parsing would fail
        try:  # one parse validates the whole column; only a failure pays for finding the bad value
            parsed = len(_JSON_ARRAY.decode(("[" + ",".join(documents) + "]").encode()))
        except msgspec.DecodeError:
            parsed = -1
        if parsed != len(documents):  # invalid, or a value that was several documents ("1,2")
            for value in documents:
                try:
                    msgspec.json.decode(value)
                except msgspec.ValidationError:
                    continue  # a number beyond msgspec's range: valid JSON (`_parse_json_document`)
                except msgspec.DecodeError as exc:
                    raise ValueError(str(json_problem(exc, value))) from exc
            raise ValueError("a value holds more than one JSON document")
        return text

    def to_python(self, array: pa.Array) -> list[Any]:
        return [None if v is None else _parse_json_document(v) for v in array.to_pylist()]

    def _json_value(self, value: Any) -> Any:
        return json_document_text(value)


_JSON_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])


def _check_depth(documents: list[str], limit: int) -> None:
    """Only a document with more brackets than `limit` can nest deeper: most are settled by counting."""
    for document in documents:
        if len(document) > limit and document.count("[") + document.count("{") > limit:
            depth = nesting_depth(document.encode())
            if depth > limit:
                raise _DocumentTooDeep(f"JSON document nests {depth} deep, beyond {limit}")


def _parse_json_document(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except msgspec.ValidationError:  # a number beyond msgspec's range: valid JSON all the same
        value = json.loads(text, parse_int=_integer)
    return JSON_NULL if value is None else value


def _integer(text: str) -> int | Decimal:
    """Python refuses int() of very long digit strings (a denial-of-service guard); Decimal has no limit."""
    limit = sys.get_int_max_str_digits()
    return int(text) if not limit or len(text) <= limit else Decimal(text)


def json_document_text(value: Any) -> str:
    """TiDB's canonical JSON text: `", "` and `": "` separators, keys in byte order."""
    document = None if value is JSON_NULL else value
    return json.dumps(document, ensure_ascii=False, separators=(", ", ": "), sort_keys=True, allow_nan=False)


class VectorColumn(ColumnType):
    family = "vector"

    def _arrow_type(self) -> pa.DataType:
        return pa.list_(pa.field("element", pa.float32(), nullable=False))

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        text = pa.array(values, pa.string())
        if pc.all(pc.and_(pc.starts_with(text, "["), pc.ends_with(text, "]"))).as_py() is False:
            raise ValueError("a vector is written as [x,y,...]")
        inner = pc.utf8_slice_codeunits(text, 1, -1)
        try:  # `[]` has no element to parse: null first, then an empty list again through the offsets
            elements = pc.cast(pc.split_pattern(pc.if_else(pc.equal(inner, ""), None, inner), ","), _FLOATS)
        except pa.ArrowInvalid:  # spacing Arrow's parser does not take: Python's float() decides
            return pa.array([None if v is None else _vector_elements(v) for v in values], self.arrow_type)
        return pa.ListArray.from_arrays(
            elements.offsets, elements.values, type=self.arrow_type, mask=pc.is_null(text)
        )

    def _json_value(self, value: Any) -> Any:
        return "[" + ",".join(float32_text(float(x)) for x in value) + "]"


_FLOATS = pa.list_(pa.float32())


def _vector_elements(text: str) -> list[float]:
    """`[1,-0,2.5]`: parsed with float() because a JSON parser reads `-0` as the integer 0."""
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError("a vector is written as [x,y,...]")
    inner = text[1:-1]
    return [float(x) for x in inner.split(",")] if inner else []


# -- enum, set, bit -------------------------------------------------------------------------------
class EnumColumn(ColumnType):
    """Wire: 1-based index; 0 is MySQL's invalid/empty enum value, decoded as ''."""

    family = "enum"

    def _arrow_type(self) -> pa.DataType:
        return pa.string()

    def _labels(self) -> pa.Array:
        return pa.array(["", *self.data_type.elements], pa.string())

    def _from_text(self, text: pa.Array) -> pa.Array:
        return self._from_index(pc.cast(text, pa.int64()))

    json_wire = int

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        return self._from_numbers(values)

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        return self._from_index(pa.array(values, pa.int64()))

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        return self._from_index(values) if branch == "long" else None

    def _from_index(self, index: pa.Array) -> pa.Array:
        count = len(self.data_type.elements)
        if len(index) and pc.any(pc.or_(pc.less(index, 0), pc.greater(index, count))).as_py():
            raise ValueError(f"enum index outside 0..{count}")
        return pc.take(self._labels(), index)

    def _index(self, value: Any) -> int:
        if value == "" and "" not in self.data_type.elements:
            return 0
        return self.data_type.elements.index(value) + 1

    def _json_value(self, value: Any) -> Any:
        return str(self._index(value))

    def _avro_value(self, value: Any) -> Any:
        return ("long", self._index(value))


class SetColumn(ColumnType):
    """Wire: a bitmask over `elements`; Python/Arrow: labels joined by ',' in definition order."""

    family = "set"

    def _arrow_type(self) -> pa.DataType:
        return pa.string()

    def _from_text(self, text: pa.Array) -> pa.Array:
        return self._from_masks(pc.cast(text, pa.uint64()).to_pylist())

    json_wire = int

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        return self._from_numbers(values)

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        return self._from_masks([None if v is None else _exact_int(v) & _U64 for v in values])

    def _from_masks(self, masks: list[int | None]) -> pa.Array:
        elements = self.data_type.elements
        limit = 1 << len(elements)
        labels: dict[int, str] = {}
        out: list[str | None] = []
        for mask in masks:
            if mask is None:
                out.append(None)
                continue
            if mask >= limit:
                raise ValueError(f"set bitmask {mask} has bits beyond the {len(elements)} elements")
            if mask not in labels:
                labels[mask] = ",".join(e for i, e in enumerate(elements) if mask >> i & 1)
            out.append(labels[mask])
        return pa.array(out, pa.string())

    def _mask(self, value: Any) -> int:
        if not isinstance(value, str):
            raise TypeError(f"expected comma-joined labels, got {type(value).__name__}")
        members = [m for m in value.split(",") if m] if value else []
        return sum(1 << self.data_type.elements.index(m) for m in members)

    def _json_value(self, value: Any) -> Any:
        return str(self._mask(value))

    def _avro_value(self, value: Any) -> Any:
        return ("long", self._mask(value))


class BitColumn(ColumnType):
    """bit(1) is a flag (bool); wider bits are unsigned integers."""

    family = "bit"

    @property
    def _width(self) -> int:
        return self.data_type.length if self.data_type.length > 0 else 1

    def _arrow_type(self) -> pa.DataType:
        if self._width == 1:
            return pa.bool_()
        return pa.int64() if self._width < 64 else pa.decimal128(20, 0)

    def _from_text(self, text: pa.Array) -> pa.Array:
        return self._from_unsigned(pc.cast(text, pa.uint64()))

    json_wire = int

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        if _holds_text(values):  # ticdc sends decimal text; tiflow a long holding the bits as signed
            return self._from_text(pa.array(values, pa.string()))
        return self._from_numbers([None if v is None else _exact_int(v) & _U64 for v in values])

    def _from_numbers(self, values: Sequence[Any]) -> pa.Array:
        return self._from_unsigned(pa.array(values, pa.uint64()))

    def _from_unsigned(self, bits: pa.Array) -> pa.Array:
        limit = pa.scalar(1 << self._width, pa.uint64()) if self._width < 64 else None
        if limit is not None and len(bits) and pc.any(pc.greater_equal(bits, limit)).as_py():
            raise ValueError(f"value wider than bit({self._width})")
        if self._width == 1:
            return pc.not_equal(bits, 0)
        return pc.cast(bits, self.arrow_type)

    def to_python(self, array: pa.Array) -> list[Any]:
        values = array.to_pylist()
        if pa.types.is_decimal(array.type):
            return [None if v is None else int(v) for v in values]
        return values

    def _unsigned(self, value: Any) -> int:
        integer = int(value) if isinstance(value, bool) else _exact_int(value)
        if not 0 <= integer < 1 << self._width:
            raise ValueError(f"{integer} does not fit bit({self._width})")
        return integer

    def _json_value(self, value: Any) -> Any:
        return str(self._unsigned(value))

    def _avro_value(self, value: Any) -> Any:
        return ("string", str(self._unsigned(value)))


# -- dates and times ------------------------------------------------------------------------------
_ZERO_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


_PYTHON_RANGE = {
    "date32[day]": (dt.date.min, dt.date.max),
    "timestamp[us]": (dt.datetime.min, dt.datetime.max),
    "timestamp[us, tz=UTC]": (dt.datetime.min.replace(tzinfo=dt.UTC), dt.datetime.max.replace(tzinfo=dt.UTC)),
}


def in_python_range(array: pa.Array) -> pa.Array:
    """`array` (date32, timestamp[us] naive or UTC) if Python can hold every value, else ValueError: Arrow
    parses year 0000 and computes past 9999, `date`/`datetime` cannot hold them."""
    low, high = _PYTHON_RANGE[str(array.type)]
    bounds = pa.scalar(low, array.type), pa.scalar(high, array.type)
    outside = pc.or_(pc.less(array, bounds[0]), pc.greater(array, bounds[1]))
    if pc.any(outside).as_py():
        raise ValueError("a date beyond 0001-01-01 .. 9999-12-31")
    return array


def _zero_date(value: Any) -> bool:
    """MySQL dates Python cannot hold: year 0000, month 00 or day 00 (zero dates)."""
    if isinstance(value, TimestampWire):
        value = value.value
    text = value.get("value") if isinstance(value, dict) else value
    if not isinstance(text, str) or not _ZERO_DATE.match(text):
        return False
    year, month, day = text[0:4], text[5:7], text[8:10]
    return year == "0000" or month == "00" or day == "00"


def _fraction(microsecond: int, fsp: int) -> str:
    return "." + f"{microsecond:06d}"[:fsp] if fsp else ""


def date_text(value: dt.date) -> str:
    return f"{value.year:04d}-{value.month:02d}-{value.day:02d}"


def datetime_text(value: dt.datetime, fsp: int) -> str:
    clock = f"{value.hour:02d}:{value.minute:02d}:{value.second:02d}"
    return f"{date_text(value)} {clock}{_fraction(value.microsecond, fsp)}"


class DateColumn(ColumnType):
    family = "date"
    avro_text_wire = True

    def _arrow_type(self) -> pa.DataType:
        return pa.date32()

    def _is_unrepresentable(self, value: Any) -> bool:
        return _zero_date(value)

    def _from_text(self, text: pa.Array) -> pa.Array:
        return in_python_range(pc.cast(text, self.arrow_type))

    def _json_value(self, value: Any) -> Any:
        if not isinstance(value, dt.date) or isinstance(value, dt.datetime):
            raise TypeError(f"expected date, got {type(value).__name__}")
        return date_text(value)


class DateTimeColumn(ColumnType):
    family = "datetime"
    avro_text_wire = True

    def _arrow_type(self) -> pa.DataType:
        return pa.timestamp("us")

    def _is_unrepresentable(self, value: Any) -> bool:
        return _zero_date(value)

    def _from_text(self, text: pa.Array) -> pa.Array:
        return in_python_range(pc.cast(text, self.arrow_type))

    def _json_value(self, value: Any) -> Any:
        if not isinstance(value, dt.datetime) or value.tzinfo is not None:
            raise TypeError("expected a naive datetime")
        return datetime_text(value, fsp_of(self.data_type))


class TimestampWire(msgspec.Struct, gc=False):
    """A JSON TIMESTAMP value as the per-table row Struct decodes it: cheaper than a dict, untracked by GC."""

    location: str
    value: str


class TimestampColumn(ColumnType):
    """Wire: wall-clock text in the zone named by `location`; Python: aware UTC datetime."""

    family = "timestamp"
    json_wire = TimestampWire

    def _arrow_type(self) -> pa.DataType:
        return pa.timestamp("us", tz="UTC")

    def _is_unrepresentable(self, value: Any) -> bool:
        return _zero_date(value)

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        return in_python_range(self._utc(values))

    def from_avro_branch(self, branch: str, values: pa.Array) -> pa.Array | None:
        """`_utc` of Timestamp records, for one zone (the usual case)."""
        if not branch.endswith(".Timestamp"):
            return None
        locations, texts = values.flatten()
        zones = pc.unique(locations.drop_null()).to_pylist()
        naive = pc.cast(texts.cast(pa.string()), pa.timestamp("us"))
        if set(zones) <= {"UTC"}:
            return in_python_range(naive.cast(self.arrow_type))
        if len(zones) != 1:
            return None
        local = pc.assume_timezone(naive, _zone_name(zones[0]), ambiguous="earliest", nonexistent="earliest")
        return in_python_range(local.cast(self.arrow_type))

    def _utc(self, values: Sequence[Any]) -> pa.Array:
        present = [v for v in values if v is not None]
        dicts = bool(present) and isinstance(present[0], dict)  # Avro, or dict-decoded rows
        location_of, text_of = _TIMESTAMP_DICT if dicts else _TIMESTAMP_WIRE
        if len(present) == len(values):
            texts = pa.array(list(map(text_of, values)), pa.string())
        else:
            texts = pa.array([None if v is None else text_of(v) for v in values], pa.string())
        naive = pc.cast(texts, pa.timestamp("us"))
        zones = set(map(location_of, present))
        if zones <= {"UTC"}:
            return naive.cast(self.arrow_type)
        if len(zones) == 1:  # one TiCDC server zone: the usual case
            (zone,) = zones
            return pc.assume_timezone(
                naive, _zone_name(zone), ambiguous="earliest", nonexistent="earliest"
            ).cast(self.arrow_type)
        locations = [None if v is None else location_of(v) for v in values]
        result = pa.nulls(len(values), self.arrow_type)
        for zone in zones:
            mask = pa.array([loc == zone for loc in locations])
            local = pc.assume_timezone(naive, _zone_name(zone), ambiguous="earliest", nonexistent="earliest")
            result = pc.if_else(mask, local.cast(self.arrow_type), result)
        return result

    def _json_value(self, value: Any) -> Any:
        if not isinstance(value, dt.datetime) or value.tzinfo is None:
            raise TypeError("expected an aware datetime")
        location = self.policy.timestamp_location
        local = value.astimezone(ZoneInfo(_zone_name(location)))
        return {"location": location, "value": datetime_text(local, fsp_of(self.data_type))}

    def _avro_value(self, value: Any) -> Any:
        return (AVRO_TIMESTAMP, self._json_value(value))


_TIMESTAMP_WIRE = (attrgetter("location"), attrgetter("value"))
_TIMESTAMP_DICT = (itemgetter("location"), itemgetter("value"))


def _zone_name(location: str) -> str:
    """`Local` means the producer's zone, which we cannot know: read it as this machine's zone. A name is
    looked up only if it has the shape of an IANA zone name (a directory such as `Europe`, or a name too long
    for a file, makes the lookup itself fail with OSError)."""
    if location == "Local":
        local = dt.datetime.now().astimezone().tzinfo
        return getattr(local, "key", None) or "UTC"
    if not isinstance(location, str) or not _ZONE_NAME.fullmatch(location):
        raise ValueError(f"unknown time zone {_short(location)}")
    try:
        ZoneInfo(location)
    except (ZoneInfoNotFoundError, ValueError, OSError) as exc:
        raise ValueError(f"unknown time zone {location!r}") from exc
    return location


_ZONE_NAME = re.compile(r"[A-Za-z0-9_+-]{1,64}(?:/[A-Za-z0-9_+-]{1,64}){0,3}")


_TIME_PATTERN = r"^(?P<sign>-?)(?P<h>\d{2,3}):(?P<m>\d{2}):(?P<s>\d{2})(?:\.(?P<f>\d{1,6}))?$"
_MAX_TIME_US = (838 * 3600 + 59 * 60 + 59) * 1_000_000


class TimeColumn(ColumnType):
    """MySQL TIME: a signed duration up to ±838:59:59.999999, not a time of day."""

    family = "time"
    avro_text_wire = True

    def _arrow_type(self) -> pa.DataType:
        return pa.duration("us")

    def _from_text(self, text: pa.Array) -> pa.Array:
        parts = pc.extract_regex(text, _TIME_PATTERN)
        if parts.null_count != text.null_count:
            raise ValueError("not a [-]HH:MM:SS[.ffffff] duration")
        fields = {name: pc.struct_field(parts, name) for name in ("sign", "h", "m", "s", "f")}
        seconds = pc.add(
            pc.add(
                pc.multiply(pc.cast(fields["h"], pa.int64()), 3600),
                pc.multiply(pc.cast(fields["m"], pa.int64()), 60),
            ),
            pc.cast(fields["s"], pa.int64()),
        )
        fraction = pc.cast(
            pc.utf8_rpad(pc.if_else(pc.equal(fields["f"], ""), "0", fields["f"]), 6, "0"), pa.int64()
        )
        micros = pc.add(pc.multiply(seconds, 1_000_000), fraction)
        if len(micros) and pc.any(pc.greater(micros, _MAX_TIME_US)).as_py():
            raise ValueError("duration beyond 838:59:59.999999")
        signed = pc.if_else(pc.equal(fields["sign"], "-"), pc.negate(micros), micros)
        return pc.cast(signed, pa.duration("us"))

    def _json_value(self, value: Any) -> Any:
        if not isinstance(value, dt.timedelta):
            raise TypeError(f"expected timedelta, got {type(value).__name__}")
        micros = (value.days * 86_400 + value.seconds) * 1_000_000 + value.microseconds
        if abs(micros) > _MAX_TIME_US:
            raise ValueError("duration beyond 838:59:59.999999")
        sign = "-" if micros < 0 else ""
        seconds, micro = divmod(abs(micros), 1_000_000)
        hours, rest = divmod(seconds, 3600)
        clock = f"{hours:02d}:{rest // 60:02d}:{rest % 60:02d}"
        return f"{sign}{clock}{_fraction(micro, fsp_of(self.data_type))}"


# -- types this SDK does not know -----------------------------------------------------------------
class UnknownColumn(ColumnType):
    """A mysqlType a newer TiDB may send: each value is kept as its wire text, so nothing is lost and the
    column can be re-typed later. TiCDC sends such values as text (JSON string, Avro string); an Avro number
    keeps its decimal text, and Avro bytes their UTF-8 text (bytes that are not text fail the row)."""

    family = "unknown"

    def _arrow_type(self) -> pa.DataType:
        return pa.string()

    def _json_array(self, values: Sequence[Any]) -> pa.Array:
        return pa.array(values, pa.string())

    def _avro_array(self, values: Sequence[Any]) -> pa.Array:
        return pa.array([None if v is None else _wire_text(v) for v in values], pa.string())

    def _json_value(self, value: Any) -> Any:
        if not isinstance(value, str):
            raise TypeError(f"a value of an unknown type is its wire text, not {type(value).__name__}")
        return value


def _wire_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode()  # strict: raw bytes that are not text have no lossless text form
    if isinstance(value, dict):  # an Avro record branch (Timestamp, UnsignedBigint)
        return msgspec.json.encode(value, order="sorted").decode()
    return str(value)


# -- registry -------------------------------------------------------------------------------------
_FAMILIES: dict[str, type[ColumnType]] = {
    **dict.fromkeys(_INT_WIDTH, IntegerColumn),
    "year": YearColumn,
    "float": FloatColumn,
    "double": FloatColumn,
    "decimal": DecimalColumn,
    **dict.fromkeys(("char", "varchar", "tinytext", "text", "mediumtext", "longtext"), TextColumn),
    **dict.fromkeys(("binary", "varbinary", "tinyblob", "blob", "mediumblob", "longblob"), BinaryColumn),
    "date": DateColumn,
    "datetime": DateTimeColumn,
    "timestamp": TimestampColumn,
    "time": TimeColumn,
    "enum": EnumColumn,
    "set": SetColumn,
    "bit": BitColumn,
    "json": JsonColumn,
    "vector": VectorColumn,
}

MYSQL_TYPES: tuple[str, ...] = tuple(_FAMILIES)


def column_type(
    column: Column, policy: ValuePolicy | None = None, stats: DecodeStats | None = None
) -> ColumnType:
    """The conversions of a column; an unknown mysqlType is kept as text unless `policy.unknown_types`
    is "error". Values the policy nulls are counted in `stats`."""
    policy = policy or ValuePolicy()
    family = _FAMILIES.get(column.data_type.mysql_type)
    if family is None:
        if policy.unknown_types == "error":
            raise UnsupportedTypeError(
                f"column {column.name!r} has mysqlType {column.data_type.mysql_type!r}, "
                "which this SDK does not know"
            )
        family = UnknownColumn
    return family(column, policy, stats)
