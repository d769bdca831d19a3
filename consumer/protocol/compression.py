"""Value compression (docs/protocols/simple.md §1.2): none, raw-block snappy, or LZ4 frame; configured or
sniffed.

Decompression is bounded: a value that declares or produces more than `max_bytes` is refused with a
`CompressionBombError` without that much ever being allocated (a snappy block states its length up front;
an LZ4 frame is inflated in growing steps, stopping one byte past the bound).
"""

from __future__ import annotations

from typing import Literal

import cramjam
import lz4.frame

from consumer.errors import CompressionBombError, CompressionError
from consumer.protocol.limits import DecodeLimits

Compression = Literal["none", "snappy", "lz4"]
CompressionSetting = Literal["auto", "none", "snappy", "lz4"]

LZ4_MAGIC = b"\x04\x22\x4d\x18"
PLAIN_FIRST_BYTES = (ord("{"), 0x16)  # JSON object, Avro union branch 11
DEFAULT_MAX_BYTES = DecodeLimits().max_decompressed_bytes
_LZ4_FIRST_STEP = 64 * 1024  # output asked for at once at first; an LZ4 buffer is allocated at that size


def compress(value: bytes, compression: Compression) -> bytes:
    if compression == "none":
        return value
    if compression == "snappy":
        return bytes(cramjam.snappy.compress_raw(value))
    if compression == "lz4":
        return lz4.frame.compress(value)
    raise CompressionError(f"unknown compression {compression!r}")


def decompress(
    value: bytes, compression: CompressionSetting = "auto", max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes:
    """Undo the producer's compression; `auto` sniffs LZ4's magic, then plain JSON/Avro, then snappy. More
    than `max_bytes` of output is refused."""
    sniffed = compression == "auto"
    if sniffed:
        compression = _sniff(value)
    if compression == "none":
        return value
    try:
        if compression == "lz4":
            return _lz4_exact(value, max_bytes)
        if compression == "snappy":
            return _snappy_bounded(value, max_bytes)
    except CompressionError:
        raise
    except Exception as exc:  # the libraries raise assorted types (and words) for corrupt input
        if sniffed and compression == "snappy":
            first = f"0x{value[0]:02x}" if value else "nothing"
            raise CompressionError(
                f"value starts with {first}: not JSON, Avro or LZ4, and not a valid snappy block either"
            ) from exc
        what = "LZ4 frame" if compression == "lz4" else "snappy block"
        raise CompressionError(f"{compression} decompression failed: not a valid {what}") from exc
    raise CompressionError(f"unknown compression {compression!r}")


def _sniff(value: bytes) -> Compression:
    if value.startswith(LZ4_MAGIC):
        return "lz4"
    if value and value[0] in PLAIN_FIRST_BYTES:
        return "none"
    return "snappy"


def _snappy_bounded(value: bytes, max_bytes: int) -> bytes:
    declared = cramjam.snappy.decompress_raw_len(value)  # the block's length header, read without inflating
    if declared > max_bytes:
        raise CompressionBombError(
            f"snappy block declares {declared} bytes, beyond max_decompressed_bytes = {max_bytes}"
        )
    return bytes(cramjam.snappy.decompress_raw(value))


def _lz4_exact(value: bytes, max_bytes: int) -> bytes:
    """Decode exactly one LZ4 frame, in steps that double, so a bomb stops one step past `max_bytes`;
    trailing garbage is corruption, not something to ignore."""
    decompressor = lz4.frame.LZ4FrameDecompressor()
    pieces: list[bytes] = []
    produced = 0
    step = min(max_bytes + 1, max(_LZ4_FIRST_STEP, 8 * len(value)))
    data = value
    while True:
        piece = decompressor.decompress(data, max_length=step)
        data = b""
        produced += len(piece)
        pieces.append(piece)
        if produced > max_bytes:
            raise CompressionBombError(
                f"lz4 frame of {len(value)} bytes inflates beyond max_decompressed_bytes = {max_bytes}"
            )
        if decompressor.eof:
            break
        if decompressor.needs_input:
            raise CompressionError("lz4 frame is truncated")
        step = min(max_bytes + 1 - produced, 2 * step)
    if decompressor.unused_data:
        raise CompressionError(f"{len(decompressor.unused_data)} bytes of garbage after the lz4 frame")
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)
