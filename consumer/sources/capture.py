"""Capture files: a topic's records frozen as JSON Lines, to replay a pipeline offline or attach to a bug.

One record per line: `{"topic", "partition", "offset", "timestamp", "key", "value"}`, with key and value in
standard base64 (or null) so arbitrary bytes survive the round trip. `consumer.sources.kafka.capture_topic`
writes one from a live topic.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO

import msgspec

from consumer.sources.errors import CaptureFormatError
from consumer.sources.record import SourceRecord

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SourceRecord)


def write_capture(records: Iterable[SourceRecord], fp: IO[bytes]) -> int:
    """Append records to a binary file object, one JSON line each; returns how many were written."""
    count = 0
    for record in records:
        fp.write(_encoder.encode(record) + b"\n")
        count += 1
    return count


def read_capture(path: str | os.PathLike[str]) -> Iterator[SourceRecord]:
    """Records of a capture file in file order; blank lines are skipped, anything else invalid raises."""
    path = Path(path)
    with path.open("rb") as fp:
        for line_number, line in enumerate(fp, start=1):
            if not line.strip():
                continue
            try:
                yield _decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise CaptureFormatError(path, line_number, str(exc)) from exc
