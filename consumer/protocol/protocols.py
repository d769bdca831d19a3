"""The Kafka protocols TiCDC writes (`simple`, `avro`, `debezium`): the configured one, chosen once.

`protocol_for` turns the `decode.protocol` setting into a `Protocol` (`consumer.protocol.base`); its record
decoder is what the pipeline, the CLI and the state machine use, and the `TableCodec`s they build take the
protocol that decoder names (`RecordDecoder.protocol`).
"""

from __future__ import annotations

from collections.abc import Callable

from consumer.protocol.base import (
    DecoderSettings,
    Protocol,
    ProtocolName,
    ProtocolSettingsError,
    RecordDecoder,
)
from consumer.protocol.simple.decoder import SIMPLE

PROTOCOLS: tuple[ProtocolName, ...] = ("simple", "avro", "debezium")


# The other protocols are imported when configured: TiCDC Avro's registry client loads an HTTP stack, and
# `consumer.config` (which reads `resolves_by_watermark`) stays light.
def _ticdc_avro(settings: DecoderSettings) -> Protocol:
    from consumer.protocol.ticdc_avro.decoder import TicdcAvroProtocol
    from consumer.protocol.ticdc_avro.registry import SchemaRegistry

    if not settings.registry_url:
        raise ProtocolSettingsError("the avro protocol needs a schema registry URL (--schema-registry)")
    return TicdcAvroProtocol(SchemaRegistry(settings.registry_url, settings.registry_config))


def _debezium(settings: DecoderSettings) -> Protocol:
    from consumer.protocol.debezium.decoder import DEBEZIUM

    return DEBEZIUM


_BUILDERS: dict[str, Callable[[DecoderSettings], Protocol]] = {
    "simple": lambda _: SIMPLE,
    "avro": _ticdc_avro,
    "debezium": _debezium,
}


def protocol_for(settings: DecoderSettings) -> Protocol:
    """The protocol `settings.protocol` names, with what it needs (TiCDC Avro: a registry client)."""
    build = _BUILDERS.get(settings.protocol)
    if build is None:
        raise ProtocolSettingsError(
            f"unknown protocol {settings.protocol!r}: expected one of {', '.join(PROTOCOLS)}"
        )
    return build(settings)


def record_decoder(settings: DecoderSettings) -> RecordDecoder:
    """The configured protocol's record decoder."""
    return protocol_for(settings).record_decoder(settings)


def resolves_by_watermark(protocol: ProtocolName) -> bool:
    """Whether a protocol's streams always carry watermarks (the default ordering follows it)."""
    return protocol == SIMPLE.name
