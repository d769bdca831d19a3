"""Record value -> message in the Simple protocol: compression, then JSON or Avro (docs/protocols/simple.md
§1.2).

`MessageDecoder.decode` is the containment boundary for a record's bytes: whatever they hold, it returns a
message or raises a `ConsumerError`. Schemas are validated there, once, as they arrive, and commitTs values
checked for plausibility (`checks`); anything the SDK did not anticipate still comes out as
an `InternalDecodeError`, never as a stray exception that would stop a consumer.
"""

from __future__ import annotations

from collections.abc import Sequence

from consumer.errors import (
    CompressionError,
    ConsumerError,
    DecodeError,
    InternalDecodeError,
    MalformedMessageError,
    NestingTooDeepError,
)
from consumer.protocol.base import DecoderSettings, EncodingSetting, Protocol, TableRows
from consumer.protocol.checks import MessageChecks
from consumer.protocol.compression import PLAIN_FIRST_BYTES, CompressionSetting, decompress
from consumer.protocol.containment import KeyedValue, decoded_each
from consumer.protocol.model import DecodedMessage, TableSchema
from consumer.protocol.simple import avro_messages, json_messages
from consumer.protocol.simple.rows import Encoding, SimpleRows
from consumer.protocol.types import ColumnType, ValuePolicy

__all__ = ["EncodingSetting", "MessageDecoder", "SimpleProtocol"]


class MessageDecoder:
    """Turns a Kafka record value into a message; DML values wait in a RawDML for their schema.

    `policy` brings the `DecodeLimits` (decompressed size, nesting depth, commitTs range) and what to do
    with unknown column types in the schemas that arrive.
    """

    def __init__(
        self,
        encoding: EncodingSetting = "auto",
        compression: CompressionSetting = "auto",
        *,
        policy: ValuePolicy | None = None,
    ) -> None:
        self.encoding = encoding
        self.compression = compression
        self.policy = policy or ValuePolicy()
        self.limits = self.policy.limits
        self._plain_json = encoding != "avro" and compression in ("auto", "none")  # `{` may start JSON
        self._plain_avro = encoding != "json" and compression in ("auto", "none")  # 0x16 may start Avro
        self._checks = MessageChecks(self.limits, self.policy.unknown_types)

    @property
    def protocol(self) -> SimpleProtocol:
        return SIMPLE

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        """A record as `RecordDecoder` takes it: the Simple protocol puts nothing in the key."""
        return self.decode(value)

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        """In a poll of at least `_FEWEST_READ_AT_ONCE` records whose first is Avro (a topic's records share
        an encoding), the plain Avro DMLs of known routes have their headers read at once
        (`avro_messages.known_headers`); every other record is read by `decode`."""
        known = None
        first = records[0].value if len(records) >= _FEWEST_READ_AT_ONCE else None
        if self._plain_avro and type(first) is bytes and first[:1] == _AVRO_START:
            try:
                known = avro_messages.known_headers([record.value for record in records], self._checks)
            except Exception:  # only a shortcut: the records are then read one by one, each contained
                known = None
        return decoded_each(self.decode_record, records, known)

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None:
        """Simple DMLs carry no schema: BOOTSTRAP and DDL records announce every version."""
        return None

    def decode(self, value: bytes | None) -> DecodedMessage:
        try:
            if value and value[0] == _JSON_START and self._plain_json:  # the hottest case, fewest calls
                try:
                    return json_messages.decode(value, self._checks)
                except DecodeError as error:
                    return self._not_plain_json(value, error)
            if self._plain_avro and value.__class__ is bytes and value.startswith(avro_messages.DML_PREFIX):
                known = avro_messages.known_header(value, self._checks)  # what a plain reading would give
                if known is not None:
                    return known
            return self._decode(value)
        except ConsumerError:
            raise
        except RecursionError as exc:
            raise NestingTooDeepError("message nests deeper than Python's recursion limit") from exc
        except Exception as exc:  # a gap in the checks: still this record's problem alone
            raise InternalDecodeError(f"unexpected {type(exc).__name__} decoding a message: {exc}") from exc

    def _decode(self, value: bytes | None) -> DecodedMessage:
        if not value:
            raise MalformedMessageError("empty record value")
        if self.compression == "auto" and value[0] in PLAIN_FIRST_BYTES:
            try:
                return self._decode_plain(value)
            except DecodeError as error:
                return self._decode_snappy_lookalike(value, error)
        return self._decode_plain(decompress(value, self.compression, self.limits.max_decompressed_bytes))

    def _not_plain_json(self, value: bytes, error: DecodeError) -> DecodedMessage:
        if self.compression == "none":
            raise error
        return self._decode_snappy_lookalike(value, error)

    def _decode_plain(self, payload: bytes) -> DecodedMessage:
        encoding = self.encoding if self.encoding != "auto" else _sniffed(payload[0] if payload else -1)
        if encoding == "json":
            return json_messages.decode(payload, self._checks)
        return avro_messages.decode(payload, self._checks)

    def _decode_snappy_lookalike(self, value: bytes, plain_error: DecodeError) -> DecodedMessage:
        """A snappy block starts with its uncompressed length as a varint: 123 bytes look like `{`, 22 like
        Avro's 0x16. When the plain reading fails, the snappy reading gets its chance."""
        try:
            payload = decompress(value, "snappy", self.limits.max_decompressed_bytes)
        except CompressionError:
            raise plain_error from None
        return self._decode_plain(payload)


_JSON_START = ord("{")
_FEWEST_READ_AT_ONCE = 16  # fewer are read one by one: the columnar reading costs more than it saves
_AVRO_START = bytes((avro_messages.MESSAGE_BRANCH,))


def _sniffed(first: int) -> Encoding:
    """`{` starts JSON, 0x16 (union branch 11) starts Avro; nothing else is a Simple message."""
    if first == _JSON_START:
        return "json"
    if first == avro_messages.MESSAGE_BRANCH:
        return "avro"
    shown = f"0x{first:02x}" if first >= 0 else "nothing"
    raise MalformedMessageError(f"neither JSON nor Avro: value starts with {shown}")


class SimpleProtocol(Protocol):
    """TiCDC's Simple protocol: `MessageDecoder` for records, `SimpleRows` for a table version's rows."""

    name = "simple"
    resolves_by_watermark = True

    def record_decoder(self, settings: DecoderSettings) -> MessageDecoder:
        return MessageDecoder(settings.encoding, settings.compression, policy=settings.policy)

    def table_rows(
        self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy
    ) -> TableRows:
        return SimpleRows(schema, columns, policy)

    def __eq__(self, other: object) -> bool:
        return type(other) is SimpleProtocol

    def __hash__(self) -> int:
        return hash(SimpleProtocol)


SIMPLE = SimpleProtocol()
