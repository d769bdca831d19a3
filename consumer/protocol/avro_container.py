"""Many Avro datums of one schema read columnar, straight into Arrow, by polars-avro's native reader.

The datums are framed as one in-memory Avro object container file (the header names the schema; one block
holds the datums back to back, which is all a block is). The reader is ~10x faster than fastavro's generic
one, and its traps are handled here:

- it loops forever on bytes left in a block after its rows, so only its first batch of exactly the block's
  row count is taken;
- a datum longer or shorter than its schema would shift every later row, so each datum is followed by an
  8-byte sentinel (random per process) that the reader schema reads back as a `fixed` field: a row whose
  sentinel differs is misaligned;
- it may fail or panic on hostile bytes.

It refuses a varint over 10 bytes, as Avro does (fastavro does not: the datum-by-datum reading checks
them itself, `avro_varints`).

In each case `read` gives None, and the caller reads the datums one by one (fastavro, strictly), which
names the bad row.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from consumer.protocol.parse_errors import datum_problem

_SYNC = b"ticdc-consumer.."  # 16 bytes: the container's sync marker
_SENTINEL = os.urandom(8)
_SENTINEL_FIELD = "ticdc_consumer_row_end_" + _SENTINEL.hex()


def zigzag(number: int) -> bytes:
    """An Avro long's bytes."""
    encoded = (number << 1) ^ (number >> 63)
    out = bytearray()
    while encoded >= 0x80:
        out.append((encoded & 0x7F) | 0x80)
        encoded >>= 7
    out.append(encoded)
    return bytes(out)


def datum_error(exc: Exception, stream: io.BytesIO) -> str:
    """A reason for fastavro's error on the datum `stream` holds, in the SDK's words (`parse_errors`): the
    same bytes give the same reason, whatever fastavro's release."""
    return f"invalid Avro datum: {datum_problem(exc, stream.getvalue(), stream.tell())}"


def private_field(name: str) -> str:
    """A field name no writer schema uses: a reader-only field (a frame, a prefix) is named by it."""
    return f"ticdc_consumer_{name}_{_SENTINEL.hex()}"


class DatumContainer:
    """Reads datums of `record` (a record schema, named types inlined) as one record batch of its fields."""

    def __init__(self, record: dict[str, Any]) -> None:
        sentinel = {"name": _SENTINEL_FIELD, "type": {"type": "fixed", "name": "RowEnd", "size": 8}}
        schema = json.dumps({**record, "fields": [*record["fields"], sentinel]}, separators=(",", ":"))
        meta = zigzag(2) + _avro_string(b"avro.schema") + _avro_string(schema.encode())
        self._header = (
            b"Obj\x01" + meta + _avro_string(b"avro.codec") + _avro_string(b"null") + b"\x00" + _SYNC
        )

    def read(self, payloads: Sequence[bytes]) -> pa.RecordBatch | None:
        """The datums' fields, or None where only a datum-by-datum reading can settle them."""
        count = len(payloads)
        framed: list[bytes] = [_SENTINEL] * (2 * count)  # each datum, then its sentinel: copied once
        framed[0::2] = payloads
        size = sum(map(len, payloads)) + len(_SENTINEL) * count
        container = b"".join((self._header, zigzag(count), zigzag(size), *framed, _SYNC))
        try:
            batch = _native_block(container, count)
        except BaseException as exc:  # an error, or a panic of the native code
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return None
        if batch.num_rows != count:
            return None
        ends = batch.column(_SENTINEL_FIELD).cast(pa.binary())
        if not pc.all(pc.equal(ends, pa.scalar(_SENTINEL, pa.binary()))).as_py():
            return None
        return batch.drop_columns([_SENTINEL_FIELD])


def _native_block(container: bytes, count: int) -> pa.RecordBatch:
    # The public readers iterate until the source is exhausted (and hang on a short block): the native
    # source gives one batch of exactly `count` rows
    from polars_avro._avro_rs import AvroSource

    source = AvroSource([lambda: contextlib.nullcontext(io.BytesIO(container))], False, False)
    return pa.record_batch(next(iter(source.batch_iter(count, None))))


def _avro_string(data: bytes) -> bytes:
    return zigzag(len(data)) + data
