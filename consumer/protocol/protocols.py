"""The Kafka protocols TiCDC writes (`simple`, `avro`, `debezium`) behind the one decoder interface the
pipeline, the CLI and the state machine use."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from consumer.errors import ConsumerError
from consumer.protocol.codec import EncodingSetting, MessageDecoder
from consumer.protocol.compression import CompressionSetting
from consumer.protocol.containment import KeyedValue
from consumer.protocol.model import DecodedMessage, TableSchema
from consumer.protocol.types import ValuePolicy

if TYPE_CHECKING:  # the registry client loads an HTTP stack: only TiCDC Avro needs it
    from consumer.protocol.registry import SchemaRegistry

ProtocolName = Literal["simple", "avro", "debezium"]
PROTOCOLS: tuple[ProtocolName, ...] = ("simple", "avro", "debezium")


class RecordDecoder(Protocol):
    """Kafka record (key, value) -> message. `described_schema` gives the table version a returned row's own
    record described (None when BOOTSTRAP/DDL records announce versions, as in the Simple protocol);
    `registry` is where row values' writer schemas are, for protocols that have one."""

    @property
    def registry(self) -> SchemaRegistry | None: ...

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage: ...

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        """A poll's records: each one's message or the `ConsumerError` it met (see `decoded_each`)."""
        ...

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None: ...


@dataclass(frozen=True)
class DecoderSettings:
    """`encoding` applies to the Simple protocol, `compression` to Simple and Debezium, the registry to
    TiCDC Avro (URL, may hold `user:password@`; `registry_config`: more `SchemaRegistryClient` settings)."""

    protocol: ProtocolName = "simple"
    encoding: EncodingSetting = "auto"
    compression: CompressionSetting = "auto"
    registry_url: str = ""
    registry_config: dict[str, Any] = field(default_factory=dict)
    policy: ValuePolicy = field(default_factory=ValuePolicy)


class ProtocolSettingsError(ConsumerError):
    """The decoder cannot be built as configured (e.g. Avro without a registry URL)."""


def record_decoder(settings: DecoderSettings) -> RecordDecoder:
    if settings.protocol == "simple":
        return MessageDecoder(settings.encoding, settings.compression, policy=settings.policy)
    if settings.protocol == "avro":
        from consumer.protocol.confluent_avro import ConfluentAvroDecoder
        from consumer.protocol.registry import SchemaRegistry

        if not settings.registry_url:
            raise ProtocolSettingsError("the avro protocol needs a schema registry URL (--schema-registry)")
        return ConfluentAvroDecoder(
            SchemaRegistry(settings.registry_url, settings.registry_config), settings.policy
        )
    if settings.protocol == "debezium":
        from consumer.protocol.debezium import DebeziumDecoder

        return DebeziumDecoder(settings.compression, settings.policy)
    raise ProtocolSettingsError(
        f"unknown protocol {settings.protocol!r}: expected one of {', '.join(PROTOCOLS)}"
    )


def resolves_by_watermark(protocol: ProtocolName) -> bool:
    """Whether a protocol's streams always carry watermarks (the default ordering follows it)."""
    return protocol == "simple"
