"""The watermark an offset commit carries, as Kafka commit metadata (a string stored beside the offset).

Other tools may commit for the same group with metadata of their own, and brokers may drop it: whatever does
not read as this format is no watermark, never an error.
"""

from __future__ import annotations

import re

_PREFIX = "ticdc-watermark:"
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,19}")  # a TSO: an unsigned 64-bit integer, in ASCII digits
_TSO_LIMIT = 1 << 64


def watermark_metadata(commit_ts: int) -> str:
    """The commit metadata carrying watermark `commit_ts`."""
    if not 0 <= commit_ts < _TSO_LIMIT:
        raise ValueError(f"a watermark is an unsigned 64-bit commit ts, not {commit_ts}")
    return f"{_PREFIX}{commit_ts}"


def metadata_watermark(metadata: str | None) -> int | None:
    """The watermark commit metadata carries; None for none, or for metadata some other tool wrote."""
    if metadata is None or not metadata.startswith(_PREFIX):
        return None
    digits = metadata[len(_PREFIX) :]
    if _DECIMAL.fullmatch(digits) is None:
        return None
    commit_ts = int(digits)
    return commit_ts if commit_ts < _TSO_LIMIT else None
