"""TiCDC's large-message handling on the producer side (docs/protocols/simple.md §7), for simulators and
users' tests.

A DML whose record would exceed `max_message_bytes` is sent with only its handle-key columns and
`handleKeyOnly`; with claim-check, its full value is first written to storage and the location added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from consumer.errors import EncodeError
from consumer.large_messages.claim_check import ClaimCheckWriter
from consumer.protocol.model import DML, Message, TableSchema
from consumer.protocol.simple.encoder import MessageEncoder

LargeMessageOption = Literal["none", "handle-key-only", "claim-check"]
DEFAULT_MAX_MESSAGE_BYTES = 10 * 1024 * 1024
_RECORD_OVERHEAD = 36  # bytes TiCDC adds to key + value when it checks a message against the limit


@dataclass
class LargeMessageEncoder:
    """Wraps a `MessageEncoder` with `large-message-handle-option` (`claim_check` needed for claim-check)."""

    encoder: MessageEncoder
    option: LargeMessageOption = "none"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    claim_check: ClaimCheckWriter | None = None

    def __post_init__(self) -> None:
        if self.option == "claim-check" and self.claim_check is None:
            raise ValueError("the claim-check option needs a ClaimCheckWriter")

    def encode(self, message: Message, schema: TableSchema | None = None) -> bytes:
        value = self.encoder.encode(message, schema)
        if self._fits(value) or not isinstance(message, DML) or schema is None:
            return value
        if self.option == "none":
            raise EncodeError(f"a {len(value)}-byte DML exceeds max_message_bytes {self.max_message_bytes}")
        location = self.claim_check.write(value) if self.claim_check is not None else ""
        key_only = self.encoder.encode(key_only_dml(message, schema, location), schema)
        if not self._fits(key_only):
            raise EncodeError(f"even the key-only form of a DML exceeds {self.max_message_bytes} bytes")
        return key_only

    def _fits(self, value: bytes) -> bool:
        return len(value) + _RECORD_OVERHEAD <= self.max_message_bytes


def key_only_dml(dml: DML, schema: TableSchema, location: str = "") -> DML:
    """The DML with only its handle-key columns, and the claim-check location if any (its checksum still
    covers the full row, as TiCDC sends it)."""
    key = schema.handle_key()

    def image(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if row is None else {name: row[name] for name in key if name in row}

    return msgspec.structs.replace(
        dml, data=image(dml.data), old=image(dml.old), handle_key_only=True, claim_check_location=location
    )
