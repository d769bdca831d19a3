"""What an operator asks of a lakehouse: how far is it, and is anything stuck? (`ticdc-consumer status`)

Everything here is read from the lake alone, and cheaply: the catalog (the live tables, and the TSO each
mirror holds every change up to, as members recorded it: `mirror_ts`), each table's Delta
log (row counts from its add actions, the newest change's commit ts from their statistics, the last
commit's time), `_progress` (per group and partition: the resume offset, the applied ts, what the last stop
left unapplied) and `consistent_ts`. Kafka's side of a partition (committed and end offsets: the lag) is
merged in with `with_kafka`, the dead letters by the caller that knows where they go
(`consumer.cli.lake_status`, the `status` command).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from datetime import UTC, datetime

import msgspec
import pyarrow as pa
import pyarrow.compute as pc

from consumer.errors import ConsumerError
from consumer.lakehouse.catalog import CATALOG, Catalog, CatalogEntry
from consumer.lakehouse.progress import PROGRESS, ProgressLog, consistent_ts
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import entry_uri, retained_range
from consumer.protocol.model import TSO_PHYSICAL_SHIFT
from consumer.sources.lookups import PartitionOffsets
from consumer.sources.record import TopicPartition


class NotALakehouseError(ConsumerError):
    """The root holds neither a catalog nor progress records: no sink ever wrote there."""

    code = "not-a-lakehouse"


class TableStatus(msgspec.Struct, kw_only=True):
    """A live table: where it is, how big, how recent. Counts come from the Delta log (None: no such Delta
    table, e.g. no mirror for a table without a key, or a Parquet changelog)."""

    database: str
    table: str
    location: str
    mirror_rows: int | None
    changelog_rows: int | None
    last_change_ts: int | None  # the newest `_commit_ts` the table holds (mirror, else changelog)
    last_commit_at: datetime | None  # the newest Delta commit of its mirror or changelog
    freshness_s: float | None  # seconds since that commit
    mirror_ts: int | None = None  # the catalog's: every change up to it is in the mirror (None: unrecorded)
    mirror_exact: bool | None = None  # the mirror at `mirror_version` is the table exactly as of `mirror_ts`
    mirror_version: int | None = None
    mirror_age_s: float | None = None  # the age of `mirror_ts`


class PartitionStatus(msgspec.Struct, kw_only=True):
    """One partition of one group: what the lake recorded, and Kafka's offsets when asked for."""

    group: str
    topic: str
    partition: int
    lake_offset: int | None  # the furthest resume offset `_progress` holds
    applied_ts: int | None  # every change of the partition up to it is in the lake
    waiting_rows: int | None  # left unapplied at the last stop: waiting for a WATERMARK (None: no stop)
    held_rows: int | None  # ... held for a schema that had not arrived
    stopped_at: datetime | None
    resent: int | None = None  # records skipped as copies TiCDC sent again (None: none recorded)
    committed_offset: int | None = None  # Kafka's committed offset for the group
    end_offset: int | None = None  # Kafka's end (high watermark) offset
    lag_records: int | None = None  # records past where the group resumes (the later of the two offsets)
    lag_s: float | None = None  # 0 without lag, else the age of `applied_ts`


class DeadLetterStatus(msgspec.Struct, kw_only=True):
    destination: str
    total: int
    by_reason_code: dict[str, int]


class _DeltaLog(msgspec.Struct):
    rows: int | None  # None: a file without statistics
    last_change_ts: int | None
    last_commit_at: datetime


class LakeStatus(msgspec.Struct, kw_only=True):
    """The answer; `msgspec.json.encode` gives the `status --json` shape (the README documents it)."""

    root: str
    checked_at: datetime
    consistent_ts: int | None
    consistent_at: datetime | None
    consistent_age_s: float | None  # None when unknown (no watermarks yet, or arrival ordering)
    as_of_from: int | None = None  # the oldest TSO as-of reads answer (`retained_range`; to consistent_ts)
    tables: list[TableStatus]
    partitions: list[PartitionStatus]
    dead_letters: DeadLetterStatus | None = None

    def behind(self, max_lag_s: float) -> bool:
        """Whether the consistent point is older than `max_lag_s` (unknown counts as behind: a health check
        must not pass on a lake it cannot vouch for)."""
        return self.consistent_age_s is None or self.consistent_age_s > max_lag_s


def tso_time(ts: int) -> datetime:
    """A TSO's physical part (milliseconds since the epoch) as a UTC time."""
    return datetime.fromtimestamp((ts >> TSO_PHYSICAL_SHIFT) / 1000, UTC)


def read_status(
    root: str | LakeRoot,
    storage_options: Mapping[str, str] | None = None,
    *,
    group: str | None = None,
    now: float | None = None,
) -> LakeStatus:
    """The lake's own account of itself; `group` limits progress (and `consistent_ts`) to one group."""
    lake = LakeRoot.of(root, storage_options)
    if lake.open(lake.join(CATALOG)) is None and lake.open(lake.join(PROGRESS)) is None:
        raise NotALakehouseError(f"{lake.uri}: no lakehouse here (neither {CATALOG} nor {PROGRESS})")
    now = time.time() if now is None else now
    point = consistent_ts(lake, group)
    known = point or None  # 0: no watermarks, nothing to date
    return LakeStatus(
        root=lake.uri,
        checked_at=datetime.fromtimestamp(now, UTC),
        consistent_ts=point,
        consistent_at=None if known is None else tso_time(known),
        consistent_age_s=_age(known, now),
        as_of_from=retained_range(lake)[0] if point else None,
        tables=[_table(lake, entry, now) for entry in Catalog(lake).entries() if entry.live],
        partitions=_partitions(ProgressLog(lake), group),
    )


def with_kafka(
    status: LakeStatus, offsets: Mapping[str, Mapping[TopicPartition, PartitionOffsets]]
) -> LakeStatus:
    """The status with each group's Kafka offsets (per group, per partition) and the lag they give."""
    now = status.checked_at.timestamp()
    known = {(p.group, p.topic, p.partition): p for p in status.partitions}
    for group, partitions in offsets.items():
        for (topic, partition), kafka in partitions.items():
            recorded = known.get((group, topic, partition)) or _unrecorded(group, topic, partition)
            known[group, topic, partition] = _lagging(recorded, kafka, now)
    return msgspec.structs.replace(status, partitions=[known[key] for key in sorted(known)])


def _lagging(partition: PartitionStatus, kafka: PartitionOffsets, now: float) -> PartitionStatus:
    """A group resumes from the later of Kafka's commit and the lake's record: the lag lies past it."""
    starts = [offset for offset in (kafka.committed, partition.lake_offset) if offset is not None]
    lag = max(0, kafka.end - max(starts, default=kafka.start))
    return msgspec.structs.replace(
        partition,
        committed_offset=kafka.committed,
        end_offset=kafka.end,
        lag_records=lag,
        lag_s=0.0 if lag == 0 else _age(partition.applied_ts, now),
    )


def _unrecorded(group: str, topic: str, partition: int) -> PartitionStatus:
    return PartitionStatus(
        group=group,
        topic=topic,
        partition=partition,
        lake_offset=None,
        applied_ts=None,
        waiting_rows=None,
        held_rows=None,
        stopped_at=None,
    )


def _partitions(progress: ProgressLog, group: str | None) -> list[PartitionStatus]:
    """Every partition a group recorded, and those of its topics it has not (no consistent point then)."""
    found = []
    for name in [group] if group is not None else progress.groups():
        stops = progress.last_stops(name)
        partitions = progress.partitions(name)
        for topic, count in progress.topic_partitions(name).items():
            found += [_unrecorded(name, topic, p) for p in range(count) if (topic, p) not in partitions]
        for tp, recorded in sorted(partitions.items()):
            stop = stops.get(tp)
            found.append(
                PartitionStatus(
                    group=name,
                    topic=tp[0],
                    partition=tp[1],
                    lake_offset=recorded.resume_offset,
                    applied_ts=recorded.applied_ts,
                    waiting_rows=None if stop is None else stop.waiting_rows,
                    held_rows=None if stop is None else stop.held_rows,
                    stopped_at=None if stop is None else stop.recorded_at,
                    resent=recorded.resent,
                )
            )
    return sorted(found, key=lambda p: (p.group, p.topic, p.partition))


def _table(lake: LakeRoot, entry: CatalogEntry, now: float) -> TableStatus:
    mirror = _delta_log(lake, entry_uri(lake, entry, "mirror"))
    changelog = _delta_log(lake, entry_uri(lake, entry, "changelog"))
    newest = mirror or changelog
    committed = None if newest is None else newest.last_commit_at
    recorded = entry.mirror
    return TableStatus(
        database=entry.name[0],
        table=entry.name[1],
        location=entry.location,
        mirror_rows=None if mirror is None else mirror.rows,
        changelog_rows=None if changelog is None else changelog.rows,
        last_change_ts=None if newest is None else newest.last_change_ts,
        last_commit_at=committed,
        freshness_s=None if committed is None else max(0.0, now - committed.timestamp()),
        mirror_ts=None if recorded is None else recorded.complete_ts,
        mirror_exact=None if recorded is None else recorded.exact,
        mirror_version=None if recorded is None else recorded.version,
        mirror_age_s=None if recorded is None else _age(recorded.complete_ts, now),
    )


def _delta_log(lake: LakeRoot, uri: str) -> _DeltaLog | None:
    """What a Delta table's log says, without reading its data files."""
    table = lake.open(uri)
    if table is None:
        return None
    actions = pa.table(table.get_add_actions(flatten=True))
    records = actions["num_records"]
    newest = actions["max._commit_ts"] if "max._commit_ts" in actions.column_names else None
    commit = table.history(1)[0]["timestamp"]
    return _DeltaLog(
        rows=None if records.null_count else pc.sum(records).as_py() or 0,
        last_change_ts=None if newest is None else pc.max(newest).as_py(),
        last_commit_at=datetime.fromtimestamp(commit / 1000, UTC),
    )


def _age(ts: int | None, now: float) -> float | None:
    return None if not ts else max(0.0, now - tso_time(ts).timestamp())
