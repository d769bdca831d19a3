"""What every decoded message is checked against, whatever its encoding: a plausible commitTs, schemas within
TiDB's limits (`validation`), bounded nesting. The codecs call these checks where the values are at hand, so
a DML, nearly every record, pays one comparison.
"""

from __future__ import annotations

import time

from cachetools import LRUCache

from consumer.errors import ImplausibleTimestampError, SchemaRejectedError
from consumer.protocol.limits import MAX_TSO, DecodeLimits, tso_of
from consumer.protocol.model import DDL, Bootstrap, TableSchema, Watermark
from consumer.protocol.validation import UnknownTypePolicy, validate_schema

VALIDATED_SCHEMAS = 4096  # schemas a decoder remembers as valid (the least recently seen are dropped)


class MessageChecks:
    """The checks of one decoder, with its `DecodeLimits` and unknown-type policy.

    `ceiling` is the highest plausible commitTs as of the last look at the clock: a commitTs within
    `0 < ts <= ceiling` passes without one; anything else calls `commit_ts`, which looks again.
    """

    def __init__(
        self, limits: DecodeLimits | None = None, unknown_types: UnknownTypePolicy = "lossless"
    ) -> None:
        limits = limits or DecodeLimits()
        self.max_nesting_depth = limits.max_nesting_depth
        self.ahead_s = limits.max_commit_ts_ahead_s
        self.unknown_types: UnknownTypePolicy = unknown_types
        self.ceiling = 0
        # per schema key, the schema last found valid: TiCDC sends a table's BOOTSTRAP again and again, and
        # comparing it with the one validated before is cheaper than validating it again
        self._valid: LRUCache[tuple[str, str, int], TableSchema] = LRUCache(VALIDATED_SCHEMAS)

    def commit_ts(self, commit_ts: int, what: str) -> None:
        """Raise unless `commit_ts` is positive and at most `ahead_s` past this machine's clock."""
        if 0 < commit_ts <= self.ceiling:
            return
        if not 0 < commit_ts <= self.clock_ceiling():
            raise ImplausibleTimestampError(
                f"{what} commitTs {commit_ts} is no TSO of a running TiDB: it must be positive and at most "
                f"{self.ahead_s:g} s past this machine's clock (TSO {self.ceiling})"
            )

    def clock_ceiling(self) -> int:
        """`ceiling` as of a look at the clock now (a batch of commitTs is checked against one look)."""
        self.ceiling = min(MAX_TSO, tso_of(time.time() + self.ahead_s))
        return self.ceiling

    def message(self, message: Watermark | Bootstrap | DDL) -> Watermark | Bootstrap | DDL:
        """A schema or watermark message, once checked."""
        if isinstance(message, Bootstrap):
            self._schemas(message.table_schema)
            return message
        self.commit_ts(message.commit_ts, "WATERMARK" if isinstance(message, Watermark) else "DDL")
        if isinstance(message, DDL):
            self._schemas(message.table_schema, message.pre_table_schema)
        return message

    def _schemas(self, *schemas: TableSchema | None) -> None:
        rejected: list[SchemaRejectedError] = []
        for schema in schemas:
            if schema is not None and self._valid.get(schema.key) != schema:
                try:
                    validate_schema(schema, self.unknown_types)
                except SchemaRejectedError as error:
                    rejected.append(error)
                else:
                    self._valid[schema.key] = schema
        if rejected:
            raise SchemaRejectedError(
                "; ".join(error.reason for error in rejected),
                keys=tuple(key for error in rejected for key in error.keys),
            )
