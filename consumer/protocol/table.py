"""`TableCodec`: the rows of one table version, whichever protocol carries them.

It validates the schema, types its columns (`ColumnType`, the Arrow schema sinks store), and decodes rows
through the `TableRows` its protocol gives (`Protocol.table_rows`); the protocol defaults to Simple.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from consumer.errors import ValueDecodeError
from consumer.protocol.base import ChangeImages, Protocol, RowImages, TableRows
from consumer.protocol.model import DML, RawDML, TableSchema
from consumer.protocol.simple.decoder import SIMPLE
from consumer.protocol.simple.rows import Encoding
from consumer.protocol.types import ColumnType, DecodeStats, ValuePolicy, column_type
from consumer.protocol.validation import validate_schema


class TableCodec:
    """Decoding and encoding of the rows of one TableSchema version.

    The schema is validated first (`SchemaRejectedError`), so no type outside TiDB's limits reaches Arrow.
    Decoding raises only `ConsumerError`s: a `ValueDecodeError` names the column and the row, and anything
    unanticipated comes out as an `InternalDecodeError` without a row.
    """

    def __init__(
        self,
        schema: TableSchema,
        policy: ValuePolicy | None = None,
        *,
        protocol: Protocol | None = None,
        stats: DecodeStats | None = None,
    ) -> None:
        """`protocol`: the protocol the rows are in (Simple when None; a record decoder names its own,
        `RecordDecoder.protocol`). `stats`: where values the policy nulled and row images verified are
        counted (codecs may share one)."""
        self.policy = policy or ValuePolicy()
        self.stats = DecodeStats() if stats is None else stats
        validate_schema(schema, self.policy.unknown_types)
        self.schema = schema
        self.protocol: Protocol = SIMPLE if protocol is None else protocol
        self.columns: tuple[ColumnType, ...] = tuple(
            column_type(c, self.policy, self.stats) for c in schema.columns
        )
        self.arrow_schema = pa.schema(
            [pa.field(c.name, c.arrow_type, nullable=c.column.nullable) for c in self.columns]
        )
        self.rows: TableRows = self.protocol.table_rows(schema, self.columns, self.policy)

    def decode_batch(self, raws: Sequence[RawDML]) -> RowImages:
        """Typed Arrow images of many DMLs of this table version. Errors carry `.row` = index in raws."""
        return self.rows.decode_batch(raws)

    def decode_changes(self, raws: Sequence[RawDML]) -> ChangeImages:
        """The batch's row images in change order (see `ChangeImages`), typed. Errors carry `.row` = the
        index in raws of the DML whose value did not decode."""
        return self.rows.decode_changes(raws)

    def decode(self, raw: RawDML) -> DML:
        """One DML with typed values; columns absent from the wire stay absent from the dicts."""
        return self.rows.decode(raw)

    def encode_image(self, image: dict[str, Any] | None, encoding: Encoding) -> dict[str, Any] | None:
        """Typed row -> Simple wire map (JSON values or Avro (branch, value) pairs)."""
        if image is None:
            return None
        known = {c.name: c for c in self.columns}
        wire: dict[str, Any] = {}
        for name, value in image.items():
            column = known.get(name)
            if column is None:
                raise ValueDecodeError("not in the table schema", column=name)
            wire[name] = column.to_json(value) if encoding == "json" else column.to_avro(value)
        return wire
