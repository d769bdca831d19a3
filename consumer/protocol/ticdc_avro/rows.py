"""Columnar decoding of TiCDC Avro rows, straight into the SDK's typed Arrow columns.

A batch's datums of one writer schema are read columnar through `avro_container` (~10x faster than fastavro's
generic reader, benchmarks/decode.py); vectorized casts then give each column its SDK type. Where the
container cannot settle the datums, fastavro reads them one by one, strictly (no byte may be left over, no
varint over 10 bytes: `avro_varints`), which names the bad row, or builds the columns when all are valid.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import fastavro
import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from consumer.errors import MalformedMessageError, ValueDecodeError
from consumer.protocol.avro_container import DatumContainer, datum_error, private_field
from consumer.protocol.avro_varints import overlong_reason, overlong_varint
from consumer.protocol.base import ImageKind, Images
from consumer.protocol.model import DMLType, RawDML, TableSchema
from consumer.protocol.self_described import enum_labels, set_labels
from consumer.protocol.ticdc_avro.registry import SchemaRegistry
from consumer.protocol.ticdc_avro.schemas import (
    BEFORE_FIELD,
    COMMIT_TS,
    OP,
    AvroColumn,
    AvroLayout,
    frame_id,
    layout,
    schema_ids,
)
from consumer.protocol.types import CONVERSION_ERRORS, ColumnType, ValuePolicy, in_python_range

_FRAME_FIELD = private_field("frame")  # a datum's Confluent frame, read and dropped
_WIDEST_NATIVE_DECIMAL = 38  # polars panics on wider decimals: those are read as bytes and converted here
_OPS = {DMLType.INSERT: "c", DMLType.UPDATE: "u", DMLType.DELETE: "d"}
_NEW_IMAGE = {
    DMLType.INSERT: ImageKind.INSERT,
    DMLType.UPDATE: ImageKind.UPDATE_NEW,
    DMLType.DELETE: ImageKind.DELETE,
}
_U64 = pa.scalar(1 << 64, pa.decimal128(21, 0))
_JSON_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])


class _Reader:
    """Datums of one writer schema -> Arrow columns (see the module docstring)."""

    def __init__(self, writer: Any) -> None:
        self.reader_json = _readable(writer)
        frame = {"name": _FRAME_FIELD, "type": {"type": "fixed", "name": _FRAME_FIELD, "size": 5}}
        self.container = DatumContainer({**self.reader_json, "fields": [frame, *self.reader_json["fields"]]})
        self.named: dict[str, Any] = {}
        self.parsed = fastavro.parse_schema(self.reader_json, self.named)

    def read(self, payloads: Sequence[bytes]) -> pa.RecordBatch:
        """Columns of the datums (after their 5-byte frames, which must all be the same: the native reader
        reads them as a field). Errors carry `.row` = index in payloads."""
        batch = self.container.read(payloads)
        if batch is not None:
            return _plain(batch.drop_columns([_FRAME_FIELD]))
        return self._read_each(payloads)

    def _read_each(self, payloads: Sequence[bytes]) -> pa.RecordBatch:
        rows = []
        for index, payload in enumerate(payloads):
            stream = io.BytesIO(payload)
            stream.seek(5)
            try:
                rows.append(fastavro.schemaless_reader(stream, self.parsed, None))
            except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError... on corrupt input
                raise ValueDecodeError(datum_error(exc, stream), column="<row>", row=index) from exc
            if stream.tell() != len(payload):
                left = len(payload) - stream.tell()
                raise ValueDecodeError(
                    f"{left} bytes of garbage after the Avro datum", column="<row>", row=index
                )
            overlong = overlong_varint(payload, 5, self.parsed, self.named)  # fastavro reads any length
            if overlong is not None:
                raise ValueDecodeError(overlong_reason(overlong), column="<row>", row=index)
        schema = _arrow_schema(self.reader_json)
        try:
            return pa.RecordBatch.from_pylist(rows, schema=schema)
        except CONVERSION_ERRORS as exc:
            first: BaseException = exc
        for index, row in enumerate(rows):  # fastavro does not check an int's range: name the row
            try:
                pa.RecordBatch.from_pylist([row], schema=schema)
            except CONVERSION_ERRORS as exc:
                raise ValueDecodeError(f"invalid Avro datum: {exc}", column="<row>", row=index) from exc
        raise ValueDecodeError(f"invalid Avro datums: {first}", column="<row>") from first


def _readable(schema: Any) -> Any:
    """The writer schema with decimals wider than polars handles read as their bytes (same encoding)."""
    if isinstance(schema, list):
        return [_readable(branch) for branch in schema]
    if not isinstance(schema, dict):
        return schema
    if schema.get("logicalType") == "decimal" and int(schema.get("precision", 0)) > _WIDEST_NATIVE_DECIMAL:
        return {"type": "bytes"}
    out = dict(schema)
    if "fields" in schema:
        out["fields"] = [{**f, "type": _readable(f["type"])} for f in schema["fields"]]
    if isinstance(schema.get("type"), dict | list):
        out["type"] = _readable(schema["type"])
    return out


_PRIMITIVES = {
    "int": pa.int32(),
    "long": pa.int64(),
    "float": pa.float32(),
    "double": pa.float64(),
    "string": pa.string(),
    "bytes": pa.binary(),
    "boolean": pa.bool_(),
}


def _arrow_type(schema: Any) -> pa.DataType:
    if isinstance(schema, list):
        (branch,) = [b for b in schema if b != "null"]
        return _arrow_type(branch)
    if isinstance(schema, str):
        return _PRIMITIVES[schema]
    if schema.get("logicalType") == "decimal":
        return pa.decimal128(int(schema["precision"]), int(schema.get("scale", 0)))
    if schema.get("type") == "record":
        return pa.struct([pa.field(f["name"], _arrow_type(f["type"])) for f in schema["fields"]])
    return _arrow_type(schema["type"])


def _arrow_schema(record: Any) -> pa.Schema:
    return pa.schema([pa.field(f["name"], _arrow_type(f["type"])) for f in record["fields"]])


def _plain(batch: pa.RecordBatch) -> pa.RecordBatch:
    """The native reader's large strings and binaries as the SDK's plain ones."""
    return pa.RecordBatch.from_arrays(
        [_plain_array(column) for column in batch.columns], names=batch.schema.names
    )


def _plain_array(array: pa.Array) -> pa.Array:
    kind = array.type
    if pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return array.cast(pa.string())
    if pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind) or pa.types.is_fixed_size_binary(kind):
        return array.cast(pa.binary())
    if pa.types.is_struct(kind):
        children = [_plain_array(array.field(i)) for i in range(kind.num_fields)]
        return pa.StructArray.from_arrays(
            children, names=[kind.field(i).name for i in range(kind.num_fields)], mask=array.is_null()
        )
    return array


# -- wire columns -> SDK columns ------------------------------------------------------------------------
def typed_column(column: ColumnType, wire: AvroColumn, values: pa.Array, policy: ValuePolicy) -> pa.Array:
    """One column of decoded datums as its SDK Arrow type (docs/protocols/ticdc-avro.md §5.1). Errors name the
    column and the row (index in `values`)."""
    try:
        return _converter(column, wire)(values, policy)
    except ValueDecodeError:
        raise
    except CONVERSION_ERRORS as exc:
        first = exc
    for row in range(len(values)):  # name the first value that does not convert
        try:
            _converter(column, wire)(values.slice(row, 1), policy)
        except ValueDecodeError as exc:
            exc.row = row
            raise
        except CONVERSION_ERRORS as exc:
            shown = repr(values[row].as_py())[:80]
            raise ValueDecodeError(
                f"value {shown} is not a valid {wire.data_type.mysql_type}: {exc}",
                column=column.name,
                row=row,
            ) from exc
    raise ValueDecodeError(str(first), column=column.name)


_Converter = Callable[[pa.Array, ValuePolicy], pa.Array]


def _converter(column: ColumnType, wire: AvroColumn) -> _Converter:
    kind = wire.data_type.mysql_type
    target = column.arrow_type
    if kind == "bigint" and wire.data_type.unsigned:
        if wire.avro == "string":
            return lambda values, _: column.from_text(values)
        return lambda values, _: _unsigned_bigint(values)
    if kind in ("int", "bigint", "year"):
        return lambda values, _: _integers(values, target, unsigned=wire.data_type.unsigned)
    if kind in ("float", "double"):
        return lambda values, _: pc.cast(_numbers(values), target, safe=False)
    if kind == "decimal":
        if wire.precise is not None and wire.precise[0] <= _WIDEST_NATIVE_DECIMAL:
            return lambda values, _: values.cast(target)
        if wire.precise is not None:
            return lambda values, _: column.from_text(_wide_decimals(values, wire.precise[1]))  # type: ignore[index]
        return lambda values, _: column.from_text(values)
    if kind in ("date", "datetime", "time"):
        return lambda values, _: column.from_text(values)
    if kind == "timestamp":
        return lambda values, policy: _timestamps(column, values, policy)
    if kind == "bit":
        return lambda values, _: column.from_json(
            [None if b is None else int.from_bytes(b, "big") for b in values.to_pylist()]
        )
    if kind == "json":
        return lambda values, _: _json_documents(column, values)
    if kind == "vector":
        return lambda values, _: column.from_json(values.to_pylist())
    if kind == "enum":
        return lambda values, _: enum_labels(values, wire.data_type.elements)
    if kind == "set":
        return lambda values, _: set_labels(values, wire.data_type.elements)
    return lambda values, _: values.cast(target)


def _json_documents(column: ColumnType, values: pa.Array) -> pa.Array:
    """`column.from_json(values.to_pylist())` of JSON text, checked in one parse of the documents joined in
    Arrow, not built as Python strings first (the same parse `JsonColumn` makes). Anything that parse does
    not settle (a document long enough to nest too deep, an invalid one) takes `from_json`, which names it."""
    if pa.types.is_string(values.type):
        documents = values.drop_null()
        if not len(documents):
            return values
        limit = column.policy.limits.max_nesting_depth
        if (pc.max(pc.binary_length(documents)).as_py() or 0) <= limit:
            listed = pa.ListArray.from_arrays(pa.array([0, len(documents)], pa.int32()), documents)
            joined = pc.binary_join(listed, ",")[0].as_buffer()
            try:
                parsed = len(_JSON_ARRAY.decode(b"[" + joined.to_pybytes() + b"]"))
            except msgspec.DecodeError:
                parsed = -1
            if parsed == len(documents):
                return values
    return column.from_json(values.to_pylist())


def _numbers(values: pa.Array) -> pa.Array:
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise TypeError(f"expected numbers, got {values.type}")
    return values


def _integers(values: pa.Array, target: pa.DataType, *, unsigned: bool) -> pa.Array:
    if unsigned and len(values) and pc.any(pc.less(values, 0)).as_py():
        raise ValueError("negative value in an unsigned column")
    return values.cast(target)


def _unsigned_bigint(values: pa.Array) -> pa.Array:
    """The uint64 bit pattern as a signed long: negatives are values >= 2^63 (lossless)."""
    wide = values.cast(pa.decimal128(21, 0))
    restored = pc.if_else(pc.less(values, 0), pc.add(wide, _U64), wide)
    return restored.cast(pa.decimal128(20, 0))


def _wide_decimals(values: pa.Array, scale: int) -> pa.Array:
    """Two's-complement big-endian unscaled integers (decimals too wide for the native reader) as text."""
    out: list[str | None] = []
    for raw in values.to_pylist():
        if raw is None:
            out.append(None)
            continue
        unscaled = int.from_bytes(raw, "big", signed=True)
        digits = str(abs(unscaled)).rjust(scale + 1, "0")
        text = digits[: len(digits) - scale] + ("." + digits[len(digits) - scale :] if scale else "")
        out.append(("-" if unscaled < 0 else "") + text)
    return pa.array(out, pa.string())


def _timestamps(column: ColumnType, values: pa.Array, policy: ValuePolicy) -> pa.Array:
    """Wall-clock text in the producer's zone (configured: the wire does not say) -> UTC."""
    try:
        naive = pc.cast(values, pa.timestamp("us"))
        if policy.timestamp_location == "UTC":
            return in_python_range(naive.cast(column.arrow_type))
        local = pc.assume_timezone(
            naive, policy.timestamp_location, ambiguous="earliest", nonexistent="earliest"
        )
        return in_python_range(local.cast(column.arrow_type))
    except (pa.ArrowInvalid, ValueError):  # zero dates and the like: the per-value path applies the policy
        wired = [
            None if v is None else {"location": policy.timestamp_location, "value": v}
            for v in values.to_pylist()
        ]
        return column.from_json(wired)


# -- a batch of rows of one table version --------------------------------------------------------------
class AvroRows:
    """The rows of one table version (`TableSchema` derived by the decoder) -> typed images."""

    def __init__(
        self,
        schema: TableSchema,
        columns: Sequence[ColumnType],
        registry: SchemaRegistry,
        policy: ValuePolicy,
    ) -> None:
        key_id, value_id = schema_ids(schema.version)
        self.layout: AvroLayout = layout(
            registry.schema(key_id) if key_id else None,
            registry.schema(value_id) if value_id else None,
            key_id,
            value_id,
        )
        self.columns = tuple(columns)
        self.policy = policy
        self.image_schema = pa.schema([pa.field(c.name, c.arrow_type) for c in self.columns])
        self._values = _Reader(self.layout.value_json) if self.layout.value_json is not None else None
        self._keys = _Reader(self.layout.key_json) if self.layout.key_json is not None else None
        self._frames = (_frame(self.layout.value_id), _frame(self.layout.key_id))

    def images(self, raws: Sequence[RawDML]) -> Images:
        """(rows, source, kinds, key_only): the images in change order (an UPDATE's old image only when the
        record has it), the DML each comes from, its `ImageKind` value, and whether it holds only the key."""
        value_rows, key_rows = self._split(raws)
        parts: list[pa.RecordBatch] = []
        positions: dict[str, int] = {}
        before_missing: list[bool] = []
        if value_rows:
            datums = self._read(self._values, raws, value_rows)
            self._check_extension(datums, raws, value_rows)
            positions["value"] = 0
            parts.append(self._typed(datums, self.layout.columns, value_rows))
            if self.layout.before:
                before = datums.column(datums.schema.get_field_index(BEFORE_FIELD))
                before_missing = before.is_null().to_pylist()
                positions["before"] = len(value_rows)
                parts.append(self._typed(_struct_batch(before), self.layout.columns, value_rows))
        if key_rows:
            datums = self._read(self._keys, raws, key_rows)
            positions["key"] = sum(p.num_rows for p in parts)
            parts.append(self._typed(datums, self.layout.key_columns, key_rows))
        if len(parts) == 1 and not key_rows:  # rows of the value schema without before images: in order
            in_order: list[int] = [_NEW_IMAGE[raw.type] for raw in raws]
            return Images(parts[0], list(range(len(raws))), in_order, [False] * len(raws))
        order, source, kinds, key_only = self._order(raws, value_rows, key_rows, positions, before_missing)
        table = pa.Table.from_batches(parts, schema=self.image_schema).combine_chunks()
        rows = table.take(pa.array(order, pa.int64())).to_batches()
        batch = rows[0] if rows else pa.RecordBatch.from_pylist([], schema=self.image_schema)
        return Images(batch, source, kinds, key_only)

    def _split(self, raws: Sequence[RawDML]) -> tuple[list[int], list[int]]:
        """(rows framed by the value schema, key-only DELETEs framed by the key schema): so every payload
        of a part starts with the same 5-byte frame (`_Reader.read`)."""
        value_frame, key_frame = self._frames
        if value_frame is not None and all(raw.payload[:5] == value_frame for raw in raws):
            return list(range(len(raws))), []
        value_rows: list[int] = []
        key_rows: list[int] = []
        for index, raw in enumerate(raws):
            frame = raw.payload[:5]
            if frame == value_frame:
                value_rows.append(index)
            elif frame == key_frame and raw.type is DMLType.DELETE:
                key_rows.append(index)
            else:
                schema_id = frame_id(raw.payload) if len(raw.payload) >= 5 and raw.payload[0] == 0 else -1
                raise ValueDecodeError(
                    f"payload of schema id {schema_id} in a batch of version {self.layout.schema.version}",
                    column="<row>",
                    row=index,
                )
        return value_rows, key_rows

    def _read(self, reader: _Reader | None, raws: Sequence[RawDML], rows: list[int]) -> pa.RecordBatch:
        assert reader is not None  # _split only lists rows whose schema the layout has
        try:
            return reader.read([raws[i].payload for i in rows])
        except ValueDecodeError as exc:
            if exc.row is not None:
                exc.row = rows[exc.row]
            raise

    def _check_extension(self, datums: pa.RecordBatch, raws: Sequence[RawDML], rows: list[int]) -> None:
        """Routing read `_tidb_op` and `_tidb_commit_ts` backwards: the decoded fields must agree."""
        if not (self.layout.extension or self.layout.before):
            return
        ops = datums.column(datums.schema.get_field_index(OP)).to_pylist()
        stamps = (
            datums.column(datums.schema.get_field_index(COMMIT_TS)).to_pylist()
            if self.layout.extension
            else None
        )
        for position, index in enumerate(rows):
            raw = raws[index]
            stamped = stamps is None or stamps[position] == raw.commit_ts
            if ops[position] != _OPS[raw.type] or not stamped:
                raise ValueDecodeError(
                    "the TiDB extension fields are not where the datum ends", column=OP, row=index
                )

    def _typed(self, datums: pa.RecordBatch, wires: Sequence[AvroColumn], rows: list[int]) -> pa.RecordBatch:
        by_name = {wire.name: wire for wire in wires}
        arrays = []
        for column in self.columns:
            wire = by_name.get(column.name)
            if wire is None:
                arrays.append(pa.nulls(datums.num_rows, column.arrow_type))
                continue
            try:
                arrays.append(
                    typed_column(
                        column, wire, datums.column(datums.schema.get_field_index(column.name)), self.policy
                    )
                )
            except ValueDecodeError as exc:
                if exc.row is not None:
                    exc.row = rows[exc.row]
                raise
        return pa.RecordBatch.from_arrays(arrays, schema=self.image_schema)

    def _order(
        self,
        raws: Sequence[RawDML],
        value_rows: list[int],
        key_rows: list[int],
        positions: dict[str, int],
        before_missing: list[bool],
    ) -> tuple[list[int], list[int], list[int], list[bool]]:
        value_at = {index: position for position, index in enumerate(value_rows)}
        key_at = {index: position for position, index in enumerate(key_rows)}
        order: list[int] = []
        source: list[int] = []
        kinds: list[int] = []
        key_only: list[bool] = []
        for index, raw in enumerate(raws):
            if index in key_at:
                order.append(positions["key"] + key_at[index])
                source.append(index)
                kinds.append(ImageKind.DELETE)
                key_only.append(True)
                continue
            position = value_at[index]
            if raw.type is DMLType.UPDATE and before_missing and not before_missing[position]:
                order.append(positions["before"] + position)
                source.append(index)
                kinds.append(ImageKind.UPDATE_OLD)
                key_only.append(False)
            order.append(positions["value"] + position)
            source.append(index)
            kinds.append(_NEW_IMAGE[raw.type])
            key_only.append(False)
        return order, source, kinds, key_only


def _frame(schema_id: int) -> bytes | None:
    """The Confluent frame of a schema id (0: none)."""
    return b"\x00" + schema_id.to_bytes(4, "big") if schema_id else None


def _struct_batch(values: pa.Array) -> pa.RecordBatch:
    """The `_ticdc_before` struct column as a batch of its fields (null where the struct is null)."""
    if not isinstance(values, pa.StructArray):
        raise MalformedMessageError(f"{BEFORE_FIELD} is not a record")
    fields = values.flatten()
    mask = values.is_null()
    arrays = [pc.if_else(mask, pa.nulls(len(values), f.type), f) for f in fields]
    return pa.RecordBatch.from_arrays(
        arrays, names=[values.type.field(i).name for i in range(values.type.num_fields)]
    )
