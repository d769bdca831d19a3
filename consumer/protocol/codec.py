"""Record value <-> message: compression, then JSON or Avro (spec §1.2), in both directions.

`MessageDecoder.decode` is the containment boundary for a record's bytes: whatever they hold, it returns a
message or raises a `ConsumerError`. Schemas are validated there, once, as they arrive, and commitTs values
checked for plausibility (`checks`); anything the SDK did not anticipate still comes out as
an `InternalDecodeError`, never as a stray exception that would stop a consumer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from consumer.errors import (
    CompressionError,
    ConsumerError,
    DecodeError,
    EncodeError,
    InternalDecodeError,
    MalformedMessageError,
    NestingTooDeepError,
)
from consumer.protocol import avro_codec, json_codec
from consumer.protocol.avro_codec import AvroVariant
from consumer.protocol.checks import MessageChecks
from consumer.protocol.compression import (
    PLAIN_FIRST_BYTES,
    Compression,
    CompressionSetting,
    compress,
    decompress,
)
from consumer.protocol.containment import KeyedValue, decoded_each
from consumer.protocol.model import DML, DecodedMessage, Message, TableSchema
from consumer.protocol.rows import Encoding, TableCodec
from consumer.protocol.types import ValuePolicy

EncodingSetting = Literal["auto", "json", "avro"]


class MessageDecoder:
    """Turns a Kafka record value into a message; DML values wait in a RawDML for their schema.

    `policy` brings the `DecodeLimits` (decompressed size, nesting depth, commitTs range) and what to do
    with unknown column types in the schemas that arrive.
    """

    registry = None  # Simple records name no registry schema (see `RecordDecoder`)

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

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage:
        """A record as `RecordDecoder` takes it: the Simple protocol puts nothing in the key."""
        return self.decode(value)

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        """In a poll of at least `_FEWEST_READ_AT_ONCE` records whose first is Avro (a topic's records share
        an encoding), the plain Avro DMLs of known routes have their headers read at once
        (`avro_codec.known_headers`); every other record is read by `decode`."""
        known = None
        first = records[0].value if len(records) >= _FEWEST_READ_AT_ONCE else None
        if self._plain_avro and type(first) is bytes and first[:1] == _AVRO_START:
            try:
                known = avro_codec.known_headers([record.value for record in records], self._checks)
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
                    return json_codec.decode(value, self._checks)
                except DecodeError as error:
                    return self._not_plain_json(value, error)
            if self._plain_avro and value.__class__ is bytes and value.startswith(avro_codec.DML_PREFIX):
                known = avro_codec.known_header(value, self._checks)  # what a plain reading would give
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
            return json_codec.decode(payload, self._checks)
        return avro_codec.decode(payload, self._checks)

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
_AVRO_START = bytes((avro_codec.MESSAGE_BRANCH,))


def _sniffed(first: int) -> Encoding:
    """`{` starts JSON, 0x16 (union branch 11) starts Avro; nothing else is a Simple message."""
    if first == _JSON_START:
        return "json"
    if first == avro_codec.MESSAGE_BRANCH:
        return "avro"
    shown = f"0x{first:02x}" if first >= 0 else "nothing"
    raise MalformedMessageError(f"neither JSON nor Avro: value starts with {shown}")


class MessageEncoder:
    """Produces record values exactly as TiCDC does (a product feature: simulators and users' tests).

    `variant` picks the Avro dialect of classic ("tiflow") or new ("ticdc") TiCDC; `policy` carries the
    zone TIMESTAMP values are written in.
    """

    def __init__(
        self,
        encoding: Encoding = "json",
        compression: Compression = "none",
        *,
        variant: AvroVariant = "ticdc",
        policy: ValuePolicy | None = None,
    ) -> None:
        self.encoding = encoding
        self.compression = compression
        self.variant = variant
        self.policy = policy or ValuePolicy()
        self._codecs: dict[tuple[str, str, int], TableCodec] = {}

    def encode(self, message: Message, schema: TableSchema | None = None) -> bytes:
        """Encode any message; a DML needs the schema of its `schema_version`."""
        data = old = None
        if isinstance(message, DML):
            if schema is None:
                raise EncodeError("encoding a DML needs its TableSchema")
            codec = self.table_codec(schema)
            data = self._image(codec, message.data)
            old = self._image(codec, message.old)
        if self.encoding == "json":
            payload = json_codec.encode(message, data, old)
        else:
            payload = avro_codec.encode(message, data, old, self.variant)
        return compress(payload, self.compression)

    def table_codec(self, schema: TableSchema) -> TableCodec:
        codec = self._codecs.get(schema.key)
        if codec is None or codec.schema != schema:
            codec = self._codecs[schema.key] = TableCodec(schema, self.policy)
        return codec

    def _image(self, codec: TableCodec, image: dict | None) -> dict | None:
        wire = codec.encode_image(image, self.encoding)
        if wire and self.encoding == "avro" and self.variant == "tiflow":
            return {name: _tiflow_bit(codec, name, value) for name, value in wire.items()}
        return wire


def _tiflow_bit(codec: TableCodec, name: str, value: object) -> object:
    """Classic TiCDC writes BIT as a `long` holding the uint64 bits reinterpreted as signed."""
    column = codec.schema.column(name)
    if value is None or column is None or column.data_type.mysql_type != "bit":
        return value
    unsigned = int(value[1])  # type: ignore[index]
    return ("long", unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned)
