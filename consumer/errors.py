"""The SDK's exception family.

Every failure caused by input data is a `ConsumerError`, so a pipeline can route a bad record to its error
policy with one `except` and never crash on a stray KeyError. Each error carries where it happened
(`RecordLocation`) once that is known; the codec raises without it and the stage that knows the Kafka
coordinates attaches them with `with_location`.
"""

from __future__ import annotations

import msgspec


class RecordLocation(msgspec.Struct, frozen=True, gc=False):
    """Kafka coordinates of one record (a Struct: one is made per record, 4x faster than a dataclass)."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


class ConsumerError(Exception):
    """Base of every error the SDK raises for bad input or a failed stage."""

    def __init__(self, message: str, *, location: RecordLocation | None = None) -> None:
        super().__init__(message)
        self.reason = message
        self.location = location

    def with_location(self, location: RecordLocation) -> ConsumerError:
        """Attach Kafka coordinates (keeps the original exception type and fields)."""
        if self.location is None:
            self.location = location
        return self

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}" if self.location else self.reason


class DecodeError(ConsumerError):
    """A record's bytes cannot be turned into a message."""


class CompressionError(DecodeError):
    """The value is not valid for the configured (or detected) compression."""


class MalformedMessageError(DecodeError):
    """Bad JSON or Avro, a missing field, a wrong Avro branch, or a shape TiCDC never produces."""


class UnknownMessageTypeError(MalformedMessageError):
    """The `type` field holds a value outside the protocol."""


class ValueDecodeError(DecodeError):
    """A column value does not parse for its column type (names the column and the row in the batch)."""

    def __init__(
        self, message: str, *, column: str, row: int | None = None, location: RecordLocation | None = None
    ) -> None:
        super().__init__(f"column {column!r}: {message}", location=location)
        self.column = column
        self.row = row


class UnsupportedTypeError(DecodeError):
    """A column declares a mysqlType this SDK does not know; we refuse to guess."""


class UnrepresentableValueError(ValueDecodeError):
    """A valid MySQL value Python cannot hold (zero dates) under the `raise` policy."""


class EncodeError(ConsumerError):
    """A message or value cannot be encoded (e.g. a row value outside its column's range)."""


class SchemaNotFoundError(ConsumerError):
    """A DML's schema (database, table, version) never arrived within the pending timeout."""


class SinkError(ConsumerError):
    """A sink could not durably apply a batch."""


class DependencyError(ConsumerError):
    """A service the consumer needs failed (not the record's fault): the consumer stops instead of setting
    records aside, so nothing is dead-lettered for an outage."""


class SchemaRegistryError(DependencyError):
    """The schema registry could not be reached or answered with a server error."""


class UnknownSchemaError(DecodeError):
    """A record names a writer schema id the registry does not have (the record's fault)."""
