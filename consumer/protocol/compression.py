"""Value compression (spec §1.2): none, raw-block snappy, or LZ4 frame; configured or sniffed."""

from __future__ import annotations

from typing import Literal

import cramjam
import lz4.frame

from consumer.errors import CompressionError

Compression = Literal["none", "snappy", "lz4"]
CompressionSetting = Literal["auto", "none", "snappy", "lz4"]

LZ4_MAGIC = b"\x04\x22\x4d\x18"
PLAIN_FIRST_BYTES = (ord("{"), 0x16)  # JSON object, Avro union branch 11


def compress(value: bytes, compression: Compression) -> bytes:
    if compression == "none":
        return value
    if compression == "snappy":
        return bytes(cramjam.snappy.compress_raw(value))
    if compression == "lz4":
        return lz4.frame.compress(value)
    raise CompressionError(f"unknown compression {compression!r}")


def decompress(value: bytes, compression: CompressionSetting = "auto") -> bytes:
    """Undo the producer's compression; `auto` sniffs LZ4's magic, then plain JSON/Avro, then snappy."""
    sniffed = compression == "auto"
    if sniffed:
        compression = _sniff(value)
    if compression == "none":
        return value
    try:
        if compression == "lz4":
            return _lz4_exact(value)
        if compression == "snappy":
            return bytes(cramjam.snappy.decompress_raw(value))
    except CompressionError:
        raise
    except Exception as exc:  # the libraries raise assorted types for corrupt input
        if sniffed and compression == "snappy":
            first = f"0x{value[0]:02x}" if value else "nothing"
            raise CompressionError(
                f"value starts with {first}: not JSON, Avro or LZ4, and not snappy either ({exc})"
            ) from exc
        raise CompressionError(f"{compression} decompression failed: {exc}") from exc
    raise CompressionError(f"unknown compression {compression!r}")


def _sniff(value: bytes) -> Compression:
    if value.startswith(LZ4_MAGIC):
        return "lz4"
    if value and value[0] in PLAIN_FIRST_BYTES:
        return "none"
    return "snappy"


def _lz4_exact(value: bytes) -> bytes:
    """Decode exactly one LZ4 frame: trailing garbage is corruption, not something to ignore."""
    decompressor = lz4.frame.LZ4FrameDecompressor()
    out = decompressor.decompress(value)
    if not decompressor.eof:
        raise CompressionError("lz4 frame is truncated")
    if decompressor.unused_data:
        raise CompressionError(f"{len(decompressor.unused_data)} bytes of garbage after the lz4 frame")
    return out
