"""The SDK's exception family.

Every failure caused by input data is a `ConsumerError`, so a pipeline can route a bad record to its error
policy with one `except` and never crash on a stray KeyError. Each error carries where it happened
(`RecordLocation`) once that is known; the codec raises without it and the stage that knows the Kafka
coordinates attaches them with `with_location`.

Each class has a stable, machine-readable `code` (kebab-case): it is what a dead letter records as its
`reason_code`, so tooling can sort bad records without parsing messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import msgspec


class RecordLocation(msgspec.Struct, frozen=True, gc=False):
    """Kafka coordinates of one record (a Struct: one is made per record, 4x faster than a dataclass)."""

    topic: str
    partition: int
    offset: int

    def __str__(self) -> str:
        return f"{self.topic}[{self.partition}]@{self.offset}"


@dataclass(frozen=True, slots=True, eq=False)
class DeadLetter:
    """A record the error policy set aside: undecodable, or a row whose schema never arrived or was
    rejected. `reason_code` is the `code` of the error that set it aside (machine-readable, stable).
    `value`: the record's value, or for a row set aside after its header decoded, the DML's decompressed
    payload (what decoding it again needs either way)."""

    location: RecordLocation
    reason: str
    value: bytes | None
    reason_code: str
    key: bytes | None = None  # the record's key, where the record itself was set aside (replay needs it)


MAX_REASON_CHARS = 1000  # a reason quoting a hostile value (Arrow quotes whole values) stays readable


class ConsumerError(Exception):
    """Base of every error the SDK raises for bad input or a failed stage.

    `code` is the machine-readable reason (kebab-case, stable): dead letters carry it as `reason_code`.
    """

    code: ClassVar[str] = "consumer-error"

    def __init__(self, message: str, *, location: RecordLocation | None = None) -> None:
        if len(message) > MAX_REASON_CHARS:
            message = f"{message[: MAX_REASON_CHARS - 20]}... ({len(message)} chars)"
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


class ConfigError(ConsumerError, ValueError):
    """The configuration is invalid; the message says which setting and why. Also a `ValueError`, which it
    was before it joined the family: `except ValueError` around `load_config` still catches it."""

    code = "config-invalid"


class DecodeError(ConsumerError):
    """A record's bytes cannot be turned into a message."""

    code = "decode-error"


class CompressionError(DecodeError):
    """The value is not valid for the configured (or detected) compression."""

    code = "compression-invalid"


class CompressionBombError(CompressionError):
    """The value would decompress beyond `DecodeLimits.max_decompressed_bytes`: refused before inflating."""

    code = "compression-bomb"


class MalformedMessageError(DecodeError):
    """Bad JSON or Avro, a missing field, a wrong Avro branch, or a shape TiCDC never produces."""

    code = "malformed-message"


class UnknownMessageTypeError(MalformedMessageError):
    """The `type` field holds a value outside the protocol."""

    code = "unknown-message-type"


class ImplausibleTimestampError(MalformedMessageError):
    """A commitTs outside the range a TiDB TSO can have (see `DecodeLimits`): never waited for."""

    code = "commit-ts-implausible"


class LimitExceededError(DecodeError):
    """A record goes beyond one of the configured `DecodeLimits`."""

    code = "limit-exceeded"


class NestingTooDeepError(LimitExceededError):
    """JSON nested deeper than `DecodeLimits.max_nesting_depth` (or than Python's recursion limit)."""

    code = "nesting-too-deep"


class ValueDecodeError(DecodeError):
    """A column value does not parse for its column type (names the column and the row in the batch)."""

    code = "value-decode"

    def __init__(
        self, message: str, *, column: str, row: int | None = None, location: RecordLocation | None = None
    ) -> None:
        super().__init__(f"column {column!r}: {message}", location=location)
        self.column = column
        self.row = row


class ValueTooLargeError(ValueDecodeError):
    """A column value is longer than `DecodeLimits.max_value_bytes`."""

    code = "value-too-large"


class DocumentTooDeepError(ValueDecodeError):
    """A JSON column's document nests deeper than `DecodeLimits.max_nesting_depth`."""

    code = "nesting-too-deep"


class InternalDecodeError(DecodeError):
    """Decoding raised something the SDK did not anticipate (a bug): the record still goes to the error
    policy, with the original exception chained. The fuzz suite fails on any of these. `row` is None: which
    row of a batch caused it is unknown, so a caller decodes the rows one by one to find out."""

    code = "decode-internal"
    row: int | None = None


class UnsupportedTypeError(DecodeError):
    """A column declares a mysqlType this SDK does not know, under `unknown_types = "error"`."""

    code = "unsupported-type"


class UnrepresentableValueError(ValueDecodeError):
    """A valid MySQL value Python cannot hold (zero dates) under the `raise` policy."""

    code = "unrepresentable-value"


class SchemaRejectedError(DecodeError):
    """A table schema (BOOTSTRAP or DDL) breaks MySQL/TiDB's own limits, so no row of it can be typed.

    `keys` are the (database, table, version) keys rejected: a state machine remembers them and sets their
    rows aside as they arrive instead of holding them for a schema that will never be usable.
    """

    code = "schema-rejected"

    def __init__(
        self,
        message: str,
        *,
        keys: tuple[tuple[str, str, int], ...] = (),
        location: RecordLocation | None = None,
    ) -> None:
        super().__init__(message, location=location)
        self.keys = keys


class EncodeError(ConsumerError):
    """A message or value cannot be encoded (e.g. a row value outside its column's range)."""

    code = "encode-error"


class SchemaNotFoundError(ConsumerError):
    """A DML's schema (database, table, version) never arrived within the pending timeout."""

    code = "schema-not-found"


class SinkError(ConsumerError):
    """A sink could not durably apply a batch."""

    code = "sink-error"


class ConflictingResendError(SinkError):
    """A change TiCDC sent again whose image differs from the one the lake holds (same table, partition,
    commit ts, key and change type): TiCDC never does this, so neither image wins silently."""

    code = "conflicting-resend"


class DependencyError(ConsumerError):
    """A service the consumer needs failed (not the record's fault): the consumer stops instead of setting
    records aside, so nothing is dead-lettered for an outage."""

    code = "dependency-unavailable"


class SchemaRegistryError(DependencyError):
    """The schema registry could not be reached or answered with a server error."""

    code = "schema-registry-unavailable"


class UnknownSchemaError(DecodeError):
    """A record names a writer schema id the registry does not have (the record's fault)."""

    code = "schema-id-unknown"


class ReplayWithoutCommitTsError(ConsumerError):
    """A replayed DML carries no commit ts (a TiCDC Avro tombstone): nothing says whether the lake's row of
    its key is newer, so a dead-letter replay keeps its letter rather than risk overwriting it."""

    code = "replay-without-commit-ts"


class LargeMessageError(ConsumerError):
    """A DML whose message carries only its handle key (docs/protocols/simple.md §7) could not be made
    whole."""

    code = "large-message"


class HandleKeyOnlyError(LargeMessageError):
    """A handle-key-only row without a claim-check: only upstream TiDB has the rest of it."""

    code = "handle-key-only"


class ClaimCheckNotAllowedError(LargeMessageError):
    """The claim-check location lies under none of the configured roots: it is never opened."""

    code = "claim-check-not-allowed"


class ClaimCheckMissingError(LargeMessageError):
    """The claim-check object does not exist (or is not a regular file)."""

    code = "claim-check-missing"


class ClaimCheckTooLargeError(LargeMessageError):
    """The claim-check object is larger than the configured limit; it is not read."""

    code = "claim-check-too-large"


class ClaimCheckInvalidError(LargeMessageError):
    """The claim-check object is not the full message of the row that points at it."""

    code = "claim-check-invalid"


class LargeMessageUnavailableError(LargeMessageError, DependencyError):
    """Claim-check storage or upstream TiDB kept failing after the retries: an outage, not bad input, so
    the pipeline stops without committing past the row (a later run reads it again) instead of sending it
    to the error policy."""

    code = "large-message-unavailable"


class ClaimCheckUnavailableError(LargeMessageUnavailableError):
    code = "claim-check-unavailable"


class UpstreamUnavailableError(LargeMessageUnavailableError):
    code = "upstream-unavailable"


class UpstreamLookupError(LargeMessageError):
    """Upstream TiDB did not give the row of a handle-key-only message."""

    code = "upstream-lookup"


class SnapshotTooOldError(UpstreamLookupError):
    """The row's commit is older than upstream TiDB's GC safe point: its versions are gone."""

    code = "upstream-snapshot-too-old"


class IntegrityError(ConsumerError):
    """A row's checksum (docs/protocols/simple.md §8) says it is not the row TiDB wrote."""

    code = "integrity"

    def __init__(
        self, message: str, *, row: int | None = None, location: RecordLocation | None = None
    ) -> None:
        super().__init__(message, location=location)
        self.row = row


class ChecksumMismatchError(IntegrityError):
    """The checksum computed over an image differs from the one TiCDC sent."""

    code = "checksum-mismatch"


class RowCorruptedError(IntegrityError):
    """TiCDC itself flagged the row `corrupted` (its upstream verification failed)."""

    code = "checksum-corrupted"


class RejectedRowsError(ConsumerError):
    """Some rows of a batch failed verification; `rejected` maps each one's index in the batch to why.
    The rest of the batch is sound: a caller takes the rejected rows out and decodes it again."""

    code = "rows-rejected"

    def __init__(self, rejected: dict[int, IntegrityError]) -> None:
        first = rejected[min(rejected)]
        super().__init__(f"{len(rejected)} row(s) failed verification, the first: {first.reason}")
        self.rejected = rejected
