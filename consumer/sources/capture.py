"""Capture files: a topic's records frozen as JSON Lines, to replay a pipeline offline or attach to a bug.

One record per line: `{"topic", "partition", "offset", "timestamp", "key", "value"}`, with key and value in
standard base64 (or null) so arbitrary bytes survive the round trip.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO

import msgspec

from consumer.sources.base import Source
from consumer.sources.errors import CaptureFormatError
from consumer.sources.kafka import ALL_PARTITIONS, KafkaSource
from consumer.sources.record import SourceRecord

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(SourceRecord)

_CAPTURE_BATCH = 10_000
# consume() waits its full timeout unless the batch fills: short polls keep the idle clock accurate.
_POLL_SECONDS = 0.2


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


def capture_topic(
    bootstrap_servers: str,
    topic: str,
    out_path: str | os.PathLike[str],
    idle_seconds: float = 5.0,
    from_committed_group: str | None = None,
    *,
    config: Mapping[str, object] | None = None,
) -> int:
    """Write every partition of `topic` to a capture file until no record arrived for `idle_seconds`.

    Reads from the beginning, or from `from_committed_group`'s committed offsets (that group's offsets are
    read, never changed). The file appears only once complete, so a failed capture leaves nothing behind.
    Returns the number of records written.

    A partition whose start offset must be looked up (no committed offset) can deliver its first record about
    a second after the others (librdkafka's offset-query timer plus one fetch long-poll), so an
    `idle_seconds` below ~2 s risks missing whole partitions.
    """
    group_id = from_committed_group or f"capture-{uuid.uuid4().hex}"
    out_path = Path(out_path)
    partial = out_path.with_name(f".{out_path.name}.partial")
    try:
        with (
            KafkaSource(
                bootstrap_servers, [topic], group_id, partitions=ALL_PARTITIONS, config=config
            ) as source,
            partial.open("wb") as fp,
        ):
            count = write_capture(_until_idle(source, idle_seconds), fp)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out_path)
    return count


def _until_idle(source: Source, idle_seconds: float) -> Iterator[SourceRecord]:
    last_arrival = time.monotonic()
    while (remaining := idle_seconds - (time.monotonic() - last_arrival)) > 0:
        batch = source.poll_batch(_CAPTURE_BATCH, timeout=min(remaining, _POLL_SECONDS))
        if batch:
            last_arrival = time.monotonic()
            yield from batch
