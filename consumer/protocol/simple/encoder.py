"""Typed messages -> record values exactly as TiCDC writes them in the Simple protocol: JSON or Avro, then
compression (docs/protocols/simple.md §1-§5)."""

from __future__ import annotations

from consumer.errors import EncodeError
from consumer.protocol.compression import Compression, compress
from consumer.protocol.model import DML, Message, TableSchema
from consumer.protocol.simple import avro_messages, json_messages
from consumer.protocol.simple.avro_messages import AvroVariant
from consumer.protocol.simple.rows import Encoding
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy


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
            payload = json_messages.encode(message, data, old)
        else:
            payload = avro_messages.encode(message, data, old, self.variant)
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
