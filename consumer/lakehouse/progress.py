"""How far each consumer group got, kept in the lake: where to resume and how far the output is consistent.

`<root>/_progress` (Delta) gets rows appended by every group member after its cycles:

    group, topic, partition   the partition
    resume_offset             re-reading from here loses nothing: every record before it is durably applied
    applied_ts                every change of the partition with commit ts <= it is durably applied (null:
                              not known yet, e.g. while rows wait for their schema)
    member, recorded_at       who recorded it, when
    waiting_rows, held_rows   only in a record made at a stop (the run ends, the partition goes): rows left
                              unapplied then, waiting for a WATERMARK / held for their schema; null otherwise
    topic_partitions          how many partitions the topic has, as the member knew it (null: not known)
    resent                    records of the partition skipped as copies TiCDC sent again (since the lake
                              began; null: not counted yet)

Offsets and applied ts only ever grow as claims (a row stays true once written), so readers take the maximum
of each per partition, a stale member's row is harmless, and appends of different members never conflict.
The counts at a stop are no claim: readers take the newest stop row of each partition (`last_stops`).
A topic's partition count is a claim too (the largest wins): until every partition of it has a row, the
group's output is consistent nowhere, as a member that started late has not recorded its partitions yet. So is
the count of re-sent records (each member goes on from the largest it finds).
`<root>/_schemas` keeps each member's schema-cache snapshot (msgpack), so a member taking over a partition
decodes rows whose schema no later message announces. Both are compacted to their newest rows now and then.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError

from consumer.lakehouse.storage import LakeRoot, by_version, retry_commits
from consumer.sources.record import TopicPartition
from consumer.state.machine import Unapplied

log = logging.getLogger(__name__)

PROGRESS = "_progress"
SCHEMAS = "_schemas"
COMPACT_EVERY = 50  # commits between compactions of the progress tables
_Compaction = Callable[[pa.Table], pa.Table]  # a table's rows -> its newest facts

PROGRESS_SCHEMA = pa.schema(
    [
        pa.field("group", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("partition", pa.int32(), nullable=False),
        pa.field("resume_offset", pa.int64(), nullable=False),
        pa.field("applied_ts", pa.int64()),
        pa.field("member", pa.string(), nullable=False),
        pa.field("recorded_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("waiting_rows", pa.int64()),  # added later: older tables gain them on the next append
        pa.field("held_rows", pa.int64()),
        pa.field("topic_partitions", pa.int32()),
        pa.field("resent", pa.int64()),
    ]
)
SCHEMAS_SCHEMA = pa.schema(
    [
        pa.field("member", pa.string(), nullable=False),
        pa.field("recorded_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("snapshot", pa.binary(), nullable=False),
    ]
)


@dataclass(frozen=True)
class PartitionProgress:
    resume_offset: int
    applied_ts: int | None
    resent: int = 0  # records skipped as copies TiCDC sent again


@dataclass(frozen=True)
class PartitionStop:
    """What a partition left unapplied at its last stop: rows waiting for a WATERMARK, rows held for their
    schema (a restart reads both again)."""

    waiting_rows: int
    held_rows: int
    recorded_at: datetime


class ProgressLog:
    """A root's progress and schema records; `member` names this writer in the rows it appends."""

    def __init__(self, root: LakeRoot, member: str | None = None) -> None:
        self.root = root
        self.member = member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.progress_uri = root.join(PROGRESS)
        self.schemas_uri = root.join(SCHEMAS)

    def record(
        self,
        group: str,
        resume_offsets: Mapping[TopicPartition, int],
        applied_ts: Mapping[TopicPartition, int],
        schema_snapshot: bytes | None = None,
        stopped: Sequence[Unapplied] | None = None,
        topic_partitions: Mapping[str, int] | None = None,
        resent: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        """Append a member's progress (and its schema snapshot, when given: record it whenever it changed).
        `stopped`: at a stop, what the partitions left unapplied (a partition not in it left nothing).
        `topic_partitions`: per topic, its partition count, where the member knows it. `resent`: per
        partition, the records skipped as re-sent since the lake began."""
        counts = topic_partitions or {}
        now = datetime.now(UTC)
        if schema_snapshot:
            row = {"member": self.member, "recorded_at": now, "snapshot": schema_snapshot}
            self._append(
                self.schemas_uri, pa.Table.from_pylist([row], schema=SCHEMAS_SCHEMA), _newest_schemas
            )
        rows = [
            {
                "group": group,
                "topic": topic,
                "partition": partition,
                "resume_offset": offset,
                "applied_ts": applied_ts.get((topic, partition)),
                "member": self.member,
                "recorded_at": now,
                **_stop_counts((topic, partition), stopped),
                "topic_partitions": counts.get(topic),
                "resent": (resent or {}).get((topic, partition)),
            }
            for (topic, partition), offset in sorted(resume_offsets.items())
        ]
        if rows:
            self._append(
                self.progress_uri, pa.Table.from_pylist(rows, schema=PROGRESS_SCHEMA), _newest_progress
            )

    def partitions(self, group: str) -> dict[TopicPartition, PartitionProgress]:
        """Per partition the group recorded, the furthest resume offset and applied ts any row claims."""
        table = self.root.open(self.progress_uri)
        if table is None:
            return {}
        rows = self.root.scan(table).to_table(filter=pc.field("group") == group)
        return {
            (row["topic"], row["partition"]): PartitionProgress(
                row["resume_offset_max"], row["applied_ts_max"], row.get("resent_max") or 0
            )
            for row in _furthest(rows).to_pylist()
        }

    def topic_partitions(self, group: str) -> dict[str, int]:
        """Per topic, the largest partition count the group's rows claim (a topic without one: left out)."""
        table = self.root.open(self.progress_uri)
        dataset = None if table is None else self.root.scan(table)
        if dataset is None or "topic_partitions" not in dataset.schema.names:
            return {}
        rows = dataset.to_table(columns=["topic", "topic_partitions"], filter=pc.field("group") == group)
        counts = rows.group_by("topic", use_threads=False).aggregate([("topic_partitions", "max")])
        return {
            row["topic"]: row["topic_partitions_max"]
            for row in counts.to_pylist()
            if row["topic_partitions_max"]
        }

    def last_stops(self, group: str) -> dict[TopicPartition, PartitionStop]:
        """Per partition, what it left unapplied at its newest recorded stop."""
        table = self.root.open(self.progress_uri)
        if table is None:
            return {}
        rows = self.root.scan(table).to_table(filter=pc.field("group") == group)
        return {
            (row["topic"], row["partition"]): PartitionStop(
                row["waiting_rows"], row["held_rows"], row["recorded_at"]
            )
            for row in _newest_stops(rows)
        }

    def schema_snapshot(self) -> bytes | None:
        """Every schema any member recorded, as one snapshot."""
        table = self.root.open(self.schemas_uri)
        if table is None:
            return None
        snapshots = self.root.scan(table).to_table(columns=["snapshot"])["snapshot"].to_pylist()
        return merged_snapshots(snapshots) if snapshots else None

    def groups(self) -> list[str]:
        table = self.root.open(self.progress_uri)
        if table is None:
            return []
        return sorted(set(self.root.scan(table).to_table(columns=["group"])["group"].to_pylist()))

    def _append(self, uri: str, rows: pa.Table, compacted: _Compaction) -> None:
        def attempt() -> DeltaTable | None:  # conflicts only with a compaction that removed files it saw
            table = self.root.open(uri)
            target = table if table is not None else uri
            write_deltalake(
                target, rows, mode="append", schema_mode="merge", storage_options=self.root.options()
            )
            return table  # a handle written through is at the version its write made

        written = retry_commits(f"progress {uri}", attempt)
        table = written if written is not None else self.root.open(uri)
        if table is not None and table.version() % COMPACT_EVERY == 0:
            self._compact(table, compacted)

    def _compact(self, table: DeltaTable, compacted: _Compaction) -> None:
        """Rewrite the table as its newest facts; best effort: another member's concurrent compaction wins,
        and rows appended meanwhile stay (only the files read are replaced)."""
        try:
            write_deltalake(table, compacted(self.root.scan(table).to_table()), mode="overwrite")
        except CommitFailedError as exc:
            log.info("%s: compaction skipped, another writer changed it: %s", table.table_uri, exc)


def _furthest(rows: pa.Table) -> pa.Table:
    counted = [("resent", "max")] if "resent" in rows.column_names else []  # a table older than the count
    return rows.group_by(["topic", "partition"], use_threads=False).aggregate(
        [("resume_offset", "max"), ("applied_ts", "max"), *counted]
    )


def _stop_counts(tp: TopicPartition, stopped: Sequence[Unapplied] | None) -> dict[str, int | None]:
    if stopped is None:
        return {"waiting_rows": None, "held_rows": None}
    mine = [u for u in stopped if u.partition == tp]
    return {"waiting_rows": sum(u.waiting_rows for u in mine), "held_rows": sum(u.held_rows for u in mine)}


def _newest_stops(rows: pa.Table) -> list[dict[str, Any]]:
    """The newest stop row of each (group, topic, partition) among `rows` (none in a table older than the
    stop counts)."""
    if "waiting_rows" not in rows.column_names:
        return []
    newest: dict[tuple[str, str, int], dict[str, Any]] = {}
    for row in rows.filter(pc.field("waiting_rows").is_valid()).to_pylist():
        key = (row["group"], row["topic"], row["partition"])
        if key not in newest or row["recorded_at"] > newest[key]["recorded_at"]:
            newest[key] = row
    return list(newest.values())


def _newest_progress(rows: pa.Table) -> pa.Table:
    """The furthest offsets and applied ts per partition, and its newest stop row as it was."""
    now = datetime.now(UTC)
    if "resent" not in rows.column_names:  # a table older than the count
        rows = rows.append_column("resent", pa.nulls(rows.num_rows, pa.int64()))
    furthest = rows.group_by(["group", "topic", "partition"], use_threads=False).aggregate(
        [("resume_offset", "max"), ("applied_ts", "max"), ("topic_partitions", "max"), ("resent", "max")]
    )
    compacted = pa.table(
        {
            "group": furthest["group"],
            "topic": furthest["topic"],
            "partition": furthest["partition"],
            "resume_offset": furthest["resume_offset_max"],
            "applied_ts": furthest["applied_ts_max"],
            "member": pa.array(["compacted"] * furthest.num_rows, pa.string()),
            "recorded_at": pa.array([now] * furthest.num_rows, pa.timestamp("us", tz="UTC")),
            "waiting_rows": pa.nulls(furthest.num_rows, pa.int64()),
            "held_rows": pa.nulls(furthest.num_rows, pa.int64()),
            "topic_partitions": furthest["topic_partitions_max"],
            "resent": furthest["resent_max"],
        },
        schema=PROGRESS_SCHEMA,
    )
    stops = pa.Table.from_pylist(_newest_stops(rows), schema=PROGRESS_SCHEMA)
    return pa.concat_tables([compacted, stops])


def _newest_schemas(rows: pa.Table) -> pa.Table:
    snapshot = merged_snapshots(rows["snapshot"].to_pylist())
    row = {"member": "compacted", "recorded_at": datetime.now(UTC), "snapshot": snapshot}
    return pa.Table.from_pylist([row], schema=SCHEMAS_SCHEMA)


def merged_snapshots(snapshots: list[bytes]) -> bytes:
    """One schema-cache snapshot (a msgpack array of schemas) holding every schema of several, without
    decoding the schemas (this layer does not know their type)."""
    seen: dict[bytes, msgspec.Raw] = {}
    for snapshot in snapshots:
        for item in msgspec.msgpack.decode(snapshot, type=list[msgspec.Raw]):
            seen.setdefault(bytes(item), item)
    return msgspec.msgpack.encode(list(seen.values()))


def consistent_ts(
    root: str | os.PathLike[str] | LakeRoot,
    group: str | None = None,
    storage_options: Mapping[str, str] | None = None,
) -> int | None:
    """A commit ts the lakehouse holds every change up to, with any number of group members: the smallest,
    over the partitions the group recorded, of the furthest applied ts each partition's rows claim.

    `group`: the consumer group; None takes the only group that recorded progress (several: the smallest
    over them). None when nothing is known yet, a partition has no applied ts, or a topic has partitions
    the group has not recorded yet (a member that started late: its partitions' rows may be older).
    """
    lake = LakeRoot.of(root, storage_options)
    table = lake.open(lake.join(PROGRESS))
    if table is None:
        return None
    return by_version(table, f"consistent_ts {group}", lambda t: _consistent(lake, t, group))


def _consistent(lake: LakeRoot, table: DeltaTable, group: str | None) -> int | None:
    """`consistent_ts` from the progress table's rows (`group`'s, or every group's: the smallest over them
    is the smallest over all their partitions)."""
    dataset = lake.scan(table)
    counted = "topic_partitions" in dataset.schema.names  # a table older than the counts has none
    rows = dataset.to_table(
        columns=["group", "topic", "partition", "applied_ts", *(["topic_partitions"] if counted else [])],
        filter=None if group is None else pc.field("group") == group,
    )
    keys = ["group", "topic", "partition"]
    furthest = rows.group_by(keys, use_threads=False).aggregate([("applied_ts", "max")])["applied_ts_max"]
    if not len(furthest) or furthest.null_count or (counted and _unrecorded_partitions(rows)):
        return None
    return int(pc.min(furthest).as_py())


def _unrecorded_partitions(rows: pa.Table) -> bool:
    """Whether a topic has more partitions, as the largest count any row claims, than the group recorded."""
    topics = rows.group_by(["group", "topic"], use_threads=False).aggregate(
        [("topic_partitions", "max"), ("partition", "count_distinct")]
    )
    short = pc.greater(topics["topic_partitions_max"], topics["partition_count_distinct"])
    return bool(pc.any(short).as_py())
