"""Claim-check objects (docs/protocols/simple.md §7.2): what TiCDC writes, and how one becomes the full
message again.

TiCDC writes the full record value (compressed like a Kafka value) as `<uuid4>.json` under its
`claim-check-storage-uri`, either wrapped in the JSON object `{"key": null, "value": "<base64>"}` (Go's
encoding of two `[]byte` fields) or, with `claim-check-raw-value`, as the bare value.
"""

from __future__ import annotations

import uuid
from typing import Literal

import msgspec
import pyarrow.fs as pafs

from consumer.errors import ClaimCheckInvalidError, DecodeError
from consumer.protocol.model import KeyOnlyDML, RawDML
from consumer.protocol.parse_errors import JSON_ERRORS, json_problem
from consumer.protocol.simple.decoder import MessageDecoder

RawValueSetting = bool | Literal["auto"]
"""`claim_check_raw_value`: True (bare values), False (wrapped), or "auto" (a wrapped object is told apart
by its exact shape: a bare value is compressed bytes or a Simple message, never `{"key","value"}`)."""


class ClaimCheckEnvelope(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """TiCDC's `ClaimCheckMessage` (fields in Go's order); `key` is always null for the Simple protocol."""

    key: bytes | None = None
    value: bytes


_ENVELOPE = msgspec.json.Decoder(ClaimCheckEnvelope)
_ENCODER = msgspec.json.Encoder()
_HEADER = ("database", "table", "table_id", "type", "commit_ts", "schema_version")


def unwrap(stored: bytes, raw_value: RawValueSetting = "auto") -> bytes:
    """The record value a claim-check object holds."""
    if raw_value is True:
        return stored
    try:
        return _ENVELOPE.decode(stored).value
    except JSON_ERRORS as exc:
        if raw_value == "auto":
            return stored
        raise ClaimCheckInvalidError(
            f'claim-check object is not a {{"key","value"}} envelope: {json_problem(exc, stored)}'
        ) from exc


def full_message(
    stored: bytes, key_only: KeyOnlyDML, decoder: MessageDecoder, raw_value: RawValueSetting = "auto"
) -> RawDML:
    """The full DML a claim-check object holds, checked to be the row of the key-only message that points
    at it (same table, version, change type and commit), so a misplaced object is never applied."""
    try:
        message = decoder.decode(unwrap(stored, raw_value))
    except DecodeError as exc:
        raise ClaimCheckInvalidError(f"claim-check object does not decode: {exc.reason}") from exc
    if not isinstance(message, RawDML):
        kind = "key-only DML" if isinstance(message, KeyOnlyDML) else type(message).__name__
        raise ClaimCheckInvalidError(f"claim-check object holds a {kind} message, not a full DML")
    differing = [name for name in _HEADER if getattr(message, name) != getattr(key_only.row, name)]
    if differing:
        raise ClaimCheckInvalidError(
            f"claim-check object is another row's: its {', '.join(differing)} differ from the message's"
        )
    return message


class ClaimCheckWriter:
    """Writes claim-check objects exactly as TiCDC does (the simulator's and users' tests' side).

    `uri` is TiCDC's `claim-check-storage-uri` (pyarrow.fs options may follow a `?`); the location written
    into a message is the URI without options, then `/`, then the file name.
    """

    def __init__(
        self, uri: str, *, raw_value: bool = False, filesystem: pafs.FileSystem | None = None
    ) -> None:
        base, _, _ = uri.partition("?")
        self.base = base.rstrip("/")
        self.raw_value = raw_value
        if filesystem is None:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        else:
            path = base.partition("://")[2]
        self.filesystem = filesystem
        self._path = path.rstrip("/")
        if isinstance(filesystem, pafs.LocalFileSystem):
            filesystem.create_dir(self._path, recursive=True)

    def write(self, value: bytes) -> str:
        """Store one record value; returns its claim-check location."""
        name = f"{uuid.uuid4()}.json"
        stored = value if self.raw_value else _ENCODER.encode(ClaimCheckEnvelope(value=value))
        with self.filesystem.open_output_stream(f"{self._path}/{name}") as out:
            out.write(stored)
        return f"{self.base}/{name}"
