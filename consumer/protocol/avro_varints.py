"""Avro varints of more than 10 bytes, which no Avro long (nor int, length, count or union index) has.

fastavro reads a varint of any length: `ff` x11 `01` as -2^63, a value padded with `80` bytes as the value
itself. So a datum fastavro read is trusted only once `overlong_varint` finds none in it. Every over-long
varint starts with 10 bytes that have their high bit set; most datums hold no such run (it takes binary
values, doubles or text of non-Latin scripts), so one C scan of the bytes settles them, and only the rest
are walked by their schema. polars-avro's native reader refuses over-long varints itself: a chunk holding
one falls back to the datum-by-datum reading, which is where this check runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_VARINT_BYTES = 10  # 64 bits in 7-bit groups
_HIGH_BITS = bytes(0xFF if byte & 0x80 else 0 for byte in range(256))
_RUN = b"\xff" * MAX_VARINT_BYTES
_FIXED_SIZES = {"null": 0, "boolean": 1, "float": 4, "double": 8}
_U64 = (1 << 64) - 1


def overlong_varint(payload: bytes, start: int, schema: Any, named: Mapping[str, Any]) -> int | None:
    """Where the first varint over 10 bytes begins in the datum at `payload[start:]`, or None. `schema` is
    the fastavro-parsed schema fastavro read the datum with (successfully: this walks it the same way),
    `named` its named types by full name."""
    if payload.translate(_HIGH_BITS).find(_RUN, start) < 0:
        return None
    walk = _Walk(payload, start, named)
    try:
        walk.skip(schema)
    except _Overlong as found:
        return found.position
    return None


def overlong_reason(position: int) -> str:
    return f"Avro varint at byte {position} is longer than {MAX_VARINT_BYTES} bytes (no Avro long is)"


class _Overlong(Exception):
    def __init__(self, position: int) -> None:
        super().__init__(position)
        self.position = position


class _Walk:
    """Skips a datum value by value, as fastavro read it (a negative union or enum index counts from the
    end, as Python's indexing does)."""

    def __init__(self, payload: bytes, position: int, named: Mapping[str, Any]) -> None:
        self.payload = payload
        self.position = position
        self.named = named

    def long(self) -> int:
        payload, start = self.payload, self.position
        end = start
        while payload[end] & 0x80:
            end += 1
            if end - start == MAX_VARINT_BYTES:
                raise _Overlong(start)
        self.position = end + 1
        # fastavro keeps 64 bits of a tenth byte's groups: a length or index read as it does
        packed = sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(payload[start : end + 1])) & _U64
        return (packed >> 1) ^ -(packed & 1)

    def skip(self, schema: Any) -> None:
        if isinstance(schema, list):
            self.skip(schema[self.long()])
            return
        if isinstance(schema, str):
            schema = self.named.get(schema, schema)
        kind = schema if isinstance(schema, str) else schema["type"]
        if not isinstance(kind, str):  # a type nested as {"type": {...}}
            self.skip(kind)
        elif kind in _FIXED_SIZES:
            self.position += _FIXED_SIZES[kind]
        elif kind in ("int", "long", "enum"):
            self.long()
        elif kind in ("string", "bytes"):
            self._bytes()
        elif kind == "fixed":
            self.position += schema["size"]
        elif kind in ("record", "error"):
            for field in schema["fields"]:
                self.skip(field["type"])
        elif kind in ("array", "map"):
            self._blocks(schema)

    def _bytes(self) -> None:
        size = self.long()  # read before the position it moves is added to
        self.position += size

    def _blocks(self, schema: Any) -> None:
        """Blocks of items (or entries) until an empty one; a negative count comes with the block's size."""
        while count := self.long():
            if count < 0:
                count = -count
                self.long()
            for _ in range(count):
                if schema["type"] == "map":
                    self._bytes()  # the key
                self.skip(schema["values"] if schema["type"] == "map" else schema["items"])
