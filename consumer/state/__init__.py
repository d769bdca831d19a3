"""The consumer state machine: decoded records in, ordered units and safe offsets out
(docs/protocols/simple.md §9-§11).

Pure library code, no I/O: a source feeds `ConsumerState`, a sink applies the units it resolves.
"""

from consumer.state.machine import ConsumerState, ErrorPolicy, Ordering, StateStats, Unapplied
from consumer.state.pending import PendingBuffer
from consumer.state.resolver import Resolver
from consumer.state.schema_cache import SchemaCache
from consumer.state.units import BlockBatch, DDLUnit, RowBatch, RowBlock, Unit
from consumer.state.watermarks import PartitionWatermarks

__all__ = [
    "BlockBatch",
    "ConsumerState",
    "DDLUnit",
    "ErrorPolicy",
    "Ordering",
    "PartitionWatermarks",
    "PendingBuffer",
    "Resolver",
    "RowBatch",
    "RowBlock",
    "SchemaCache",
    "StateStats",
    "Unapplied",
    "Unit",
]
