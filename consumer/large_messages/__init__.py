"""Key-only DMLs (docs/protocols/simple.md §7) made whole between the decoder and the state machine:
claim-checks read from storage under configured roots, handle-key-only rows looked up in upstream TiDB; and
the producer side (TiCDC's large-message handling) for simulators and tests."""

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
