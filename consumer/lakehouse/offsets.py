"""Exactly-once bookkeeping every lakehouse sink shares: which rows of a batch a table already holds.

A table records, per (group, topic, partition), the next offset of that partition not yet in it: as a Delta
app transaction `ticdc:<group>:<topic>:<partition>` (Delta tables) or in its manifest (Parquet). A table's
rows of one partition are applied in offset order, so the rows of a replayed batch below that offset are
already there and are dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, Transaction

from consumer.sources.record import TopicPartition


def app_id(group: str, topic: str, partition: int) -> str:
    return f"ticdc:{group}:{topic}:{partition}"


def next_offsets(changelog: pa.Table) -> dict[TopicPartition, int]:
    """Per partition in the batch, the offset after its last row."""
    last = changelog.group_by(["_topic", "_partition"], use_threads=False).aggregate([("_offset", "max")])
    columns = (last[name].to_pylist() for name in ("_topic", "_partition", "_offset_max"))
    return {(topic, partition): offset + 1 for topic, partition, offset in zip(*columns, strict=True)}


def advanced(applied: Mapping[TopicPartition, int], changelog: pa.Table) -> dict[TopicPartition, int]:
    """`applied` moved past the batch's rows."""
    merged = dict(applied)
    for tp, offset in next_offsets(changelog).items():
        merged[tp] = max(merged.get(tp, 0), offset)
    return merged


def unapplied(changelog: pa.Table, applied: Mapping[TopicPartition, int]) -> pa.Table:
    """The rows at or after each partition's next unapplied offset."""
    old = None
    for (topic, partition), offset in applied.items():
        mine = pc.and_(pc.equal(changelog["_topic"], topic), pc.equal(changelog["_partition"], partition))
        here = pc.and_(mine, pc.less(changelog["_offset"], offset))
        old = here if old is None else pc.or_(old, here)
    return changelog if old is None else changelog.filter(pc.invert(old))


def delta_applied(
    table: DeltaTable | None, group: str, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """What a Delta table's app transactions say it holds of `partitions`."""
    if table is None:
        return {}
    versions = {tp: table.transaction_version(app_id(group, *tp)) for tp in partitions}
    return {tp: version for tp, version in versions.items() if version is not None}


def transactions(changelog: pa.Table, group: str) -> list[Transaction]:
    """The app transactions a commit of `changelog`'s rows sets."""
    return [Transaction(app_id(group, *tp), offset) for tp, offset in next_offsets(changelog).items()]
