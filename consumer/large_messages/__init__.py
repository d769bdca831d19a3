"""Key-only DMLs (docs/protocols/simple.md §7) made whole between the decoder and the state machine:
claim-checks read from storage under configured roots, handle-key-only rows looked up in upstream TiDB; and
the producer side (TiCDC's large-message handling) for simulators and tests.

Each name is imported on first use: the configuration, which only parses locations and DSNs here, and Spark's
tasks load neither the encoders nor the MySQL client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from consumer.exports import exported

if TYPE_CHECKING:
    from consumer.large_messages.claim_check import ClaimCheckWriter, full_message, unwrap
    from consumer.large_messages.encoder import LargeMessageEncoder, key_only_dml
    from consumer.large_messages.resolver import LargeMessageResolver
    from consumer.large_messages.storage import ClaimCheckRoot, ClaimCheckStore, parse_location
    from consumer.large_messages.upstream import UpstreamLookup

__all__ = [
    "ClaimCheckRoot",
    "ClaimCheckStore",
    "ClaimCheckWriter",
    "LargeMessageEncoder",
    "LargeMessageResolver",
    "UpstreamLookup",
    "full_message",
    "key_only_dml",
    "parse_location",
    "unwrap",
]
_HOMES = {  # public name -> the module defining it
    "ClaimCheckWriter": "consumer.large_messages.claim_check",
    "full_message": "consumer.large_messages.claim_check",
    "unwrap": "consumer.large_messages.claim_check",
    "LargeMessageEncoder": "consumer.large_messages.encoder",
    "key_only_dml": "consumer.large_messages.encoder",
    "LargeMessageResolver": "consumer.large_messages.resolver",
    "ClaimCheckRoot": "consumer.large_messages.storage",
    "ClaimCheckStore": "consumer.large_messages.storage",
    "parse_location": "consumer.large_messages.storage",
    "UpstreamLookup": "consumer.large_messages.upstream",
}


def __getattr__(name: str) -> Any:
    return exported(__name__, _HOMES, globals(), name)


def __dir__() -> list[str]:
    return list(__all__)
