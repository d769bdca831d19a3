"""Bounds on what one record can make the decoder do: how far it may decompress, how deep its JSON may nest,
how long one value may be, and which commitTs a TiDB TSO can plausibly carry.

Every bound is checked before the work it bounds (no decompression bomb is inflated to be measured), and
crossing one is a `LimitExceededError` (or, for a commitTs, an `ImplausibleTimestampError` from
`checks.MessageChecks`) for that record alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from consumer.errors import NestingTooDeepError
from consumer.protocol.model import TSO_PHYSICAL_SHIFT

MiB = 1 << 20
MAX_TSO = (1 << 63) - 1  # TSOs are uint64 on the wire but stay below 2^63 (they travel as Avro longs)


@dataclass(frozen=True)
class DecodeLimits:
    """The `[decode]` limits (defaults are generous for TiDB's own limits, tight against abuse).

    - `max_decompressed_bytes`: a compressed value declaring or producing more is refused (64 MiB: ten times
      TiCDC's default `max-message-bytes`, and TiDB's default row limit `txn-entry-size-limit` is 6 MiB).
    - `max_nesting_depth`: JSON nesting accepted in a message's structure and in a JSON column's document
      (TiDB refuses documents deeper than 100; a Simple message itself nests 6 deep).
    - `max_value_bytes`: the longest single column value (text, binary, JSON...) accepted.
    - `max_commit_ts_ahead_s`: a commitTs (DML, DDL, WATERMARK) must be positive and its physical time at
      most this far past this machine's clock; anything else is corrupt, never something to wait for.
    """

    max_decompressed_bytes: int = 64 * MiB
    max_nesting_depth: int = 128
    max_value_bytes: int = 32 * MiB
    max_commit_ts_ahead_s: float = 86_400.0


def tso_of(unix_seconds: float) -> int:
    """The TSO whose physical part is `unix_seconds` (logical part 0)."""
    return int(unix_seconds * 1000) << TSO_PHYSICAL_SHIFT


def check_nesting(text: bytes, limit: int, what: str) -> None:
    """Refuse JSON text nested deeper than `limit`. Counting brackets first makes the exact scan rare: text
    with at most `limit` of them cannot be that deep."""
    if text.count(b"[") + text.count(b"{") > limit:
        depth = nesting_depth(text)
        if depth > limit:
            raise NestingTooDeepError(f"{what} nests {depth} deep, beyond max_nesting_depth = {limit}")


_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_SPECIAL = np.zeros(256, bool)
_SPECIAL[list(b'"\\[]{}')] = True
_STEP = np.zeros(256, np.int64)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def nesting_depth(text: bytes) -> int:
    """The deepest bracket nesting of JSON text, brackets inside strings not counted, in linear time (a
    regex over strings backtracks quadratically on hostile escapes). Invalid text gets a depth too: an
    unterminated string runs to the end."""
    data = np.frombuffer(text, np.uint8)
    positions = np.flatnonzero(_SPECIAL[data])
    kinds = data[positions]
    quotes = kinds == _QUOTE
    if (kinds == _BACKSLASH).any():
        quotes &= ~_escaped(data, positions)
    outside = (np.cumsum(quotes) & 1) == 0  # an opening quote is "inside"; it is no bracket anyway
    steps = _STEP[kinds] * outside
    return max(0, int(np.cumsum(steps).max())) if len(steps) else 0


def _escaped(data: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """For each position, whether an odd run of backslashes precedes it."""
    index = np.arange(len(data))
    last_other = np.maximum.accumulate(np.where(data == _BACKSLASH, -1, index))
    before = np.concatenate(([-1], last_other[:-1]))[positions]  # last non-backslash before each position
    return ((positions - 1 - before) & 1).astype(bool)
