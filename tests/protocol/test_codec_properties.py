"""Property tests: decode(encode(m)) == m and encode(decode(b)) == b, for both encodings and compressions."""

from __future__ import annotations

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.protocol.base import ImageKind
from consumer.protocol.model import DML, DMLType, RawDML, TableSchema
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.testing.strategies import dml_messages, table_messages, table_schemas

ENCODINGS = st.sampled_from(["json", "avro"])
COMPRESSIONS = st.sampled_from(["none", "snappy", "lz4"])
PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode(value: bytes, schema: TableSchema) -> object:
    decoded = MessageDecoder().decode(value)
    return TableCodec(schema).decode(decoded) if isinstance(decoded, RawDML) else decoded


@PROPERTY
@given(table_messages(), ENCODINGS, COMPRESSIONS)
def test_decode_encode_is_identity(pair: tuple, encoding: str, compression: str) -> None:
    message, schema = pair
    value = MessageEncoder(encoding, compression).encode(message, schema)  # type: ignore[arg-type]
    assert _decode(value, schema) == message


@PROPERTY
@given(table_messages(), ENCODINGS)
def test_encode_of_decoded_bytes_is_identity(pair: tuple, encoding: str) -> None:
    message, schema = pair
    encoder = MessageEncoder(encoding)  # type: ignore[arg-type]
    value = encoder.encode(message, schema)
    assert encoder.encode(_decode(value, schema), schema) == value  # type: ignore[arg-type]


@st.composite
def _dml_batches(draw: st.DrawFn) -> tuple[TableSchema, list[DML]]:
    schema = draw(table_schemas())
    return schema, draw(st.lists(dml_messages(schema), min_size=1, max_size=6))


def _raws(schema: TableSchema, dmls: list[DML], encoding: str) -> list[RawDML]:
    encoder = MessageEncoder(encoding)  # type: ignore[arg-type]
    return [MessageDecoder().decode(encoder.encode(d, schema)) for d in dmls]  # type: ignore[misc]


def _python_columns(codec: TableCodec, batch: pa.RecordBatch) -> dict[str, list]:
    return {c.name: c.to_python(batch.column(i)) for i, c in enumerate(codec.columns)}


@PROPERTY
@given(_dml_batches(), ENCODINGS)
def test_columnar_batch_equals_per_row_values(batch: tuple, encoding: str) -> None:
    schema, dmls = batch
    codec = TableCodec(schema)
    images = codec.decode_batch(_raws(schema, dmls, encoding))
    for image, has, attribute in (
        (images.data, images.has_data, "data"),
        (images.old, images.has_old, "old"),
    ):
        columns = _python_columns(codec, image)
        for row, dml in enumerate(dmls):
            expected = getattr(dml, attribute)
            assert has[row] == (expected is not None)
            got = {name: values[row] for name, values in columns.items()}
            assert got == {c.name: (expected or {}).get(c.name) for c in schema.columns}


@PROPERTY
@given(_dml_batches(), ENCODINGS)
def test_change_images_are_the_per_row_images_in_change_order(batch: tuple, encoding: str) -> None:
    schema, dmls = batch
    codec = TableCodec(schema)
    images = codec.decode_changes(_raws(schema, dmls, encoding))
    expected = []  # (DML index, kind, image) as the per-row decode gives them
    for row, dml in enumerate(dmls):
        if dml.type is DMLType.UPDATE:
            expected += [(row, ImageKind.UPDATE_OLD, dml.old), (row, ImageKind.UPDATE_NEW, dml.data)]
        elif dml.type is DMLType.INSERT:
            expected.append((row, ImageKind.INSERT, dml.data))
        else:
            expected.append((row, ImageKind.DELETE, dml.old))
    columns = _python_columns(codec, images.rows)
    got = [
        (source, kind, {name: values[index] for name, values in columns.items()})
        for index, (source, kind) in enumerate(zip(images.source, images.kinds, strict=True))
    ]
    assert got == [
        (row, kind, {c.name: (image or {}).get(c.name) for c in schema.columns})
        for row, kind, image in expected
    ]
