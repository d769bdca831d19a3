"""Exactly-once bookkeeping every lakehouse sink shares: which rows of a batch a table already holds.

A table records, per (group, topic, partition), the next offset of that partition not yet in it: as a Delta
app transaction `ticdc:<group>:<topic>:<partition>` (Delta tables) or in its manifest (Parquet). A table's
rows of one partition are applied in offset order, so the rows of a replayed batch below that offset are
already there and are dropped. Beside it, the newest commit ts it holds of the partition
(`ticdc-ts:<group>:<topic>:<partition>`), which tells re-sent changes at later offsets apart
(`consumer.lakehouse.resends`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, Transaction

from consumer.lakehouse.resends import Frontier
from consumer.sources.record import TopicPartition


def app_id(group: str, topic: str, partition: int) -> str:
    return f"ticdc:{group}:{topic}:{partition}"


def ts_app_id(group: str, topic: str, partition: int) -> str:
    return f"ticdc-ts:{group}:{topic}:{partition}"


def newest_commit_ts(changelog: pa.Table) -> dict[TopicPartition, int]:
    """Per partition in the batch, its newest commit ts (0 where every row's is unknown)."""
    newest = changelog.group_by(["_topic", "_partition"], use_threads=False).aggregate(
        [("_commit_ts", "max")]
    )
    columns = (newest[name].to_pylist() for name in ("_topic", "_partition", "_commit_ts_max"))
    return {(topic, partition): ts for topic, partition, ts in zip(*columns, strict=True)}


def next_offsets(changelog: pa.Table) -> dict[TopicPartition, int]:
    """Per partition in the batch, the offset after its last row."""
    last = changelog.group_by(["_topic", "_partition"], use_threads=False).aggregate([("_offset", "max")])
    columns = (last[name].to_pylist() for name in ("_topic", "_partition", "_offset_max"))
    return {(topic, partition): offset + 1 for topic, partition, offset in zip(*columns, strict=True)}


def unapplied(changelog: pa.Table, applied: Mapping[TopicPartition, int]) -> pa.Table:
    """The rows at or after each partition's next unapplied offset."""
    old = None
    for (topic, partition), offset in applied.items():
        mine = pc.and_(pc.equal(changelog["_topic"], topic), pc.equal(changelog["_partition"], partition))
        here = pc.and_(mine, pc.less(changelog["_offset"], offset))
        old = here if old is None else pc.or_(old, here)
    return changelog if old is None else changelog.filter(pc.invert(old))


def delta_frontiers(
    table: DeltaTable | None, group: str, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, Frontier]:
    """What a Delta table's app transactions say it holds of `partitions`: offsets and commit ts."""
    if table is None:
        return {}
    frontiers = {}
    for tp in partitions:
        offset = table.transaction_version(app_id(group, *tp))
        if offset is not None:
            frontiers[tp] = Frontier(offset, table.transaction_version(ts_app_id(group, *tp)) or 0)
    return frontiers


def delta_applied(
    table: DeltaTable | None, group: str, partitions: Iterable[TopicPartition]
) -> dict[TopicPartition, int]:
    """What a Delta table's app transactions say it holds of `partitions`."""
    if table is None:
        return {}
    versions = {tp: table.transaction_version(app_id(group, *tp)) for tp in partitions}
    return {tp: version for tp, version in versions.items() if version is not None}


def transactions(changelog: pa.Table, group: str) -> list[Transaction]:
    """The app transactions a commit of `changelog`'s rows sets: offsets and newest commit ts."""
    return frontier_transactions(group, next_offsets(changelog), newest_commit_ts(changelog))


def frontier_transactions(
    group: str, offsets: Mapping[TopicPartition, int], newest: Mapping[TopicPartition, int]
) -> list[Transaction]:
    """The app transactions of a commit holding rows up to `offsets`, the newest at `newest` commit ts."""
    marks = [Transaction(app_id(group, *tp), offset) for tp, offset in offsets.items()]
    return marks + [Transaction(ts_app_id(group, *tp), ts) for tp, ts in newest.items() if ts]
