"""Small capture files the pipeline tests replay through a `FileSource`."""

from __future__ import annotations

from pathlib import Path

from consumer.protocol.model import DML, Bootstrap, Column, DataType, DMLType, Index, TableSchema, Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.sources.capture import write_capture
from consumer.sources.record import SourceRecord

TS = 449512873440575500


def keyed_table(table: str, table_id: int) -> TableSchema:
    """`shop.<table>`: one BIGINT primary key column `id`."""
    return TableSchema(
        database="shop",
        table=table,
        table_id=table_id,
        version=1,
        columns=(Column("id", DataType("bigint", length=20), nullable=False),),
        indexes=(Index("primary", True, True, False, ("id",)),),
    )


def one_row_per_table(path: Path, tables: str) -> Path:
    """Partition ("t", 0): for the n-th table a BOOTSTRAP and the row id n at commit ts TS + n (offsets 2n-2
    and 2n-1), then a WATERMARK past them all."""
    encoder = MessageEncoder()
    values = []
    for n, table in enumerate(tables, start=1):
        schema = keyed_table(table, n)
        row = DML(
            type=DMLType.INSERT,
            database="shop",
            table=table,
            table_id=n,
            commit_ts=TS + n,
            build_ts=0,
            schema_version=1,
            data={"id": n},
        )
        values += [encoder.encode(Bootstrap(table_schema=schema, build_ts=0)), encoder.encode(row, schema)]
    values.append(encoder.encode(Watermark(commit_ts=TS + 100, build_ts=0)))
    with path.open("wb") as fp:
        write_capture((SourceRecord("t", 0, offset, value=v) for offset, v in enumerate(values)), fp)
    return path
