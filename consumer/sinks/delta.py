"""Delta Lake sink (delta-rs): per upstream table an append-only changelog and a pure mirror of its live rows.

Where things live, and how the tables are found and read, is `consumer.lakehouse`: the root may be a local
directory or any object-store URI delta-rs supports, and every writer coordinates through Delta commits
alone (the catalog, the DDL log, the progress records), so group members on several machines share a root.

Exactly-once: each commit carries Delta app transactions with app id `ticdc:<group>:<topic>:<partition>`
and version = the next offset of that partition not yet in this table (`consumer.lakehouse.offsets`), so
the rows of a replayed batch that a table already holds are dropped; a DDL found in the `_ddl` log is
skipped whole. Commits carry `ticdc.group` and `ticdc.resolved_ts` as commit metadata; every commit that
changes a mirror's rows also says which changes it holds (`consumer.lakehouse.tables.mirror_versions`), so a
mirror version plus the changelog after it gives the table as of any TSO.

Mirror: MERGE on the key, each key reduced to its last change of the batch; a change older than the row's
`_commit_ts` never wins; a DELETE removes the row. A deleted key is also appended (key and commit ts) to
the table's `deletes` side table first, and upserts of a key deleted later are dropped: another group
member may still hold an older change of that key (a RENAME re-hashes keys to other partitions), and it
must not bring the row back. The MERGE names the key ranges the batch touches, so delta-rs reads and
rewrites only the files holding those keys; files are bounded (`target_file_size`).

Lazy mirrors (`mirror_interval_s`, `mirror_interval_rows`): the changelog is still appended every batch, the
mirror MERGEd when due (as progress is recorded, which the pipeline does as soon as one is due: `merge_due`,
on an idle stream too) from the changelog rows its app transactions say it lacks, per partition up to the
consistent point, so its commit is exact at the TSO it records; a restart finds them the same way (nothing
is kept in memory that the lake does not also say). Every writer of a lake MERGEs on the cadence the lake
records (`consumer.lakehouse.settings`), or refuses to start; without one, every cycle (the loop engine from
the batch, the Spark engine from the changelog on its executors). So that either engine may take over from
the other, every mirror writer first MERGEs what the changelogs hold and their mirrors lack (a run that
stopped between its changelog commit and its MERGE).

Where MERGEs run: a lazy MERGE is a `MergeJob` (a table's location and catalog entry, the group, the TSOs it
may claim: no rows) that `MirrorMerges.merge_pending` runs in any process with the lake's storage options,
with the same app transactions and commit metadata wherever it runs; each mirror commit names the process
that made it (`ticdc.process`, `host:pid`). By default the sink runs jobs itself; `run_merges_with(runner)`
hands them to a runner instead (the Spark engine: one task per due table on the executors,
`consumer.spark.merges`), which makes every mirror lazy (MERGEd at each progress record without a cadence).
A job run twice, or twice at once, commits once: its rows are then in the mirror's app transactions.
A large MERGE into a bucketed mirror (`mirror_split_rows`) runs in groups of buckets
(`consumer.sinks.bucket_merges`): on threads where the job runs, or, with the Spark engine's runner, as
Spark tasks of their own (`prepare_merge_job`, then `finish_split` on the driver); either way one commit.

Where changelog files are written: a batch whose rows are spooled files (`SpooledChanges`, the Spark engine)
is written by an `AppendJob` that `append_with(runner)` hands to a runner (a Spark task on the executors,
`write_changelog_files`); this process commits the file with the batch's app transactions. A file whose
commit never comes is never committed later (a retry writes a new one): `maintain` vacuums it.

Type mapping: MySQL TIME (an Arrow duration, which Delta lacks) is stored as int64 microseconds, marked in
the field's metadata so the readers give it back as a duration. User columns are nullable in Delta, so a
dropped column can be null from then on.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Field, Transaction, write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, RemoveAction

from consumer.batches.changes import (
    META_COLUMNS,
    SpooledChanges,
    TableChanges,
    ordered_changelog,
    stored_name,
    stored_schema,
)
from consumer.batches.spool import SpooledPiece, read_pieces
from consumer.config import sink_outputs
from consumer.errors import DeadLetter, SinkError
from consumer.kill_points import kill_point
from consumer.lakehouse.catalog import CatalogEntry, MirrorVersion, Name
from consumer.lakehouse.history import (
    CLOSED_PROPERTY,
    HISTORY_FIELDS,
    change_versions,
    identity,
    marked,
    matching,
    rechained,
    to_write,
)
from consumer.lakehouse.offsets import (
    delta_applied,
    delta_frontiers,
    frontier_transactions,
    newest_commit_ts,
    next_offsets,
    transactions,
    unapplied,
)
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.resends import Fresh, Frontier, Held, conflict_letters, fresh_changes
from consumer.lakehouse.settings import MirrorCadence, require_mirror_cadence
from consumer.lakehouse.storage import LakeRoot, retry_commits
from consumer.lakehouse.tables import (
    BUCKET,
    BUCKETS_PROPERTY,
    COMPLETE_TS,
    FLOOR_PROPERTY,
    KEY_PROPERTY,
    MIRROR_META,
    NEWEST_TS,
    STORED_AS,
    STORED_DURATION,
    as_durations,
    bucket_of,
    latest_mirror_version,
    latest_per_key,
    mirror_versions,
    stored_durations,
)
from consumer.protocol.model import DDL, DDLType, TableSchema
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, Written
from consumer.sinks.bucket_merges import (
    SPLIT_METRICS,
    BucketOutcome,
    Split,
    commit_split,
    file_stats,
    merge_bucket_part,
    remove_spooled,
    split_merge,
    split_metrics,
    spooled,
)
from consumer.sinks.lakehouse import LakehouseSink, commit_metadata
from consumer.sources.record import TopicPartition

log = logging.getLogger(__name__)
T = TypeVar("T")

KINDS = ("changelog", "mirror", "history")
DEFAULT_TARGET_FILE_SIZE = 1024 * 1024  # mirror files: a MERGE rewrites the few holding changed keys
# commit ts 0 is "unknown" (a change without one, e.g. an Avro tombstone first on its partition): it came
# after the row's earlier changes on that partition, so it is never stale
NEWER = "s._commit_ts >= t._commit_ts OR s._commit_ts = 0"
MAX_KEY_RANGES = 16  # key ranges a MERGE names (more would make its predicate the bottleneck)
PURGE_DELETES_EVERY = 32  # commits to a deletes side table between purges below the consistent point
UNBOUNDED_TS = 2**63 - 1  # a lazy MERGE's limit when the lake has no consistent point (no watermarks)
PROCESS_META = "ticdc.process"  # a mirror commit's metadata: the process that made it (`process_name`)
ROWS_META = "ticdc.rows"  # a changelog commit's metadata: its rows
WRITER_META = "ticdc.writer"  # a changelog commit's metadata: the sink that made it (`DeltaSink.writer`)
MERGE_METRICS = (  # delta-rs MERGE metrics summed in `operation_metrics` (a split MERGE's: `SPLIT_METRICS`)
    *SPLIT_METRICS,
    "num_target_files_skipped_during_scan",
    "num_output_rows",
    "execution_time_ms",
)


@dataclass
class _Lagging:
    """A lazy mirror's pending MERGE: its table, how many changelog rows it lacks (-1: unknown, left by a
    run before this sink), when it was last MERGEd (`time.monotonic`) and how many rows that MERGE left
    for later (past the consistent point)."""

    entry: CatalogEntry
    rows: int = 0
    merged_at: float = dataclasses.field(default_factory=time.monotonic)
    left: int = 0


@dataclass(frozen=True)
class MergeJob:
    """One lazy mirror's MERGE, all a process needs to run it: the lake (root URI and storage options), the
    table's catalog entry, the group whose app transactions say what the mirror holds, the commit metadata
    (`resolved_ts`), the consistent point `point` the MERGE may claim (`upto`: how far a DDL barrier lets
    it MERGE), `since` (a TSO the mirror holds every change up to; None: read from its commits), how
    mirrors are laid out and commits retried, and from how many keys a MERGE runs in bucket groups. Small
    and picklable: a Spark task's input."""

    root: str
    storage_options: dict[str, str]
    entry: CatalogEntry
    group: str
    resolved_ts: int
    point: int
    upto: int | None
    since: int | None
    max_commit_retries: int = 20
    retry_backoff: float = 0.05
    target_file_size: int = DEFAULT_TARGET_FILE_SIZE
    mirror_buckets: int = 0
    split_rows: int = 0


@dataclass(frozen=True)
class MergeResult:
    """What a `MergeJob` gives back: `gone` (the table has no lazy mirror any more: emptied by a TRUNCATE
    or DROP), the TSO the mirror now holds every change up to, how many changelog rows still await it,
    the MERGE's delta-rs metrics, the process that ran it (`process_name`) and, when it committed, what the
    mirror's version after its commit holds (`latest_mirror_version`: the sink records it in the catalog
    without loading the mirror's log again). `split`: a MERGE `prepare_merge_job` split in bucket groups and
    left for its caller to run and commit (`finish_split`)."""

    location: str
    gone: bool = False
    merged_ts: int = 0
    left: int = 0
    metrics: dict[str, int] = dataclasses.field(default_factory=dict)
    process: str = ""
    version: MirrorVersion | None = None
    split: Split | None = None


MergeRunner = Callable[[Sequence[MergeJob]], Sequence[MergeResult]]
"""Runs lazy mirrors' MERGEs (`DeltaSink.run_merges_with`): each job as `run_merge_job` runs it, the results
in any order, every job's or an exception."""

_MERGERS: dict[tuple[Any, ...], MirrorMerges] = {}  # per process: reused handles, side tables read


def run_merge_job(job: MergeJob) -> MergeResult:
    """Run `job` in this process (a Spark executor's Python worker): the same MERGE, app transactions and
    commit metadata as a sink MERGEing in its own process (a split one's bucket groups on threads)."""
    return _merger(job, defer_splits=False).merge_pending(job)


def prepare_merge_job(job: MergeJob) -> MergeResult:
    """`run_merge_job`, but a MERGE split in bucket groups is only prepared: its parts' source rows spooled
    beside the mirror, the `Split` in the result for the caller to run its parts elsewhere (Spark tasks,
    `merge_bucket_part`) and commit them (`finish_split`)."""
    return _merger(job, defer_splits=True).merge_pending(job)


def finish_split(job: MergeJob, result: MergeResult, outcomes: Sequence[BucketOutcome]) -> MergeResult | None:
    """Commit a prepared split MERGE (`prepare_merge_job`) its parts' `outcomes` make up, as one commit: the
    job's result, or None when the commit conflicted (prepare the job again)."""
    assert result.split is not None
    merger = _merger(job, defer_splits=True)
    try:
        committed = merger.commit_split(result.split, outcomes)
    finally:
        remove_spooled(result.split)
    if not committed:
        return None
    mirror = merger.root.open(result.split.mirror)
    version = None if mirror is None else latest_mirror_version(mirror, job.entry.mirror)
    metrics = {"merges": 1, **split_metrics(outcomes)}
    return dataclasses.replace(result, metrics=metrics, version=version, split=None)


def _merger(job: MergeJob, *, defer_splits: bool) -> MirrorMerges:
    """This process's `MirrorMerges` for the job's lake and settings, made once."""
    settings = (job.max_commit_retries, job.retry_backoff, job.target_file_size, job.mirror_buckets)
    key = (job.root, tuple(sorted(job.storage_options.items())), settings, job.split_rows, defer_splits)
    merger = _MERGERS.get(key)
    if merger is None:
        merger = _MERGERS[key] = MirrorMerges(
            LakeRoot.of(job.root, job.storage_options),
            max_commit_retries=job.max_commit_retries,
            retry_backoff=job.retry_backoff,
            target_file_size=job.target_file_size,
            mirror_buckets=job.mirror_buckets,
            split_rows=job.split_rows,
            defer_splits=defer_splits,
        )
    return merger


@dataclass(frozen=True)
class AppendJob:
    """One table's changelog append of rows Spark tasks spooled, all a process needs to write its file:
    the lake root and its storage options, the changelog's location (the file is written with `pyarrow.fs`),
    the spooled rows to take, the schema they are typed in and the changelog's (`target`,
    which they are conformed to), per partition how far the changelog holds it (rows before the next
    offset are dropped, copies of changes it holds too: `fresh_changes`), and the table's key columns.
    A Spark task's input."""

    root: str
    storage_options: dict[str, str]
    uri: str
    pieces: tuple[SpooledPiece, ...]
    schema: pa.Schema
    target: pa.Schema
    frontiers: dict[TopicPartition, Frontier]
    keys: tuple[str, ...]

    def rows(self) -> int:
        """The changelog rows the job's pieces hold (an UPDATE two), before dropping those it has."""
        return sum(rows.image_count(offsets) for rows, offsets in self.pieces)


@dataclass(frozen=True)
class AppendResult:
    """The files an `AppendJob` wrote (path in the table, size, modification time in ms, Delta stats
    JSON), the app transactions their commit sets (per partition the offset after its last row and its
    newest commit ts), their rows, and the records it skipped as re-sent and the conflicting copies (rows);
    nothing is committed yet."""

    files: tuple[tuple[str, int, int, str], ...]
    next_offsets: dict[TopicPartition, int]
    newest_ts: dict[TopicPartition, int]
    rows: int
    resent: dict[TopicPartition, int]
    conflicts: pa.Table

    def actions(self) -> list[AddAction | RemoveAction]:
        return [
            AddAction(path, size, {}, modified, True, stats) for path, size, modified, stats in self.files
        ]


AppendRunner = Callable[[Sequence[AppendJob]], Sequence[AppendResult]]
"""Writes changelog files (`DeltaSink.append_with`): each job as `write_changelog_files` does, the results
in the jobs' order."""
_STATS_COLUMNS = ("_commit_ts", "_schema_version", "_topic", "_partition", "_offset")  # data skipping


def write_changelog_files(job: AppendJob) -> AppendResult:
    """Run `job` in this process (a Spark executor's Python worker): the rows sorted as the driver would
    sort them, without the copies of changes the changelog holds, conformed to its columns, in one Parquet
    file in the table's directory. A file nothing commits (the writer died, or its commit conflicted) is an
    orphan `maintain`'s vacuum removes."""
    root = LakeRoot.of(job.root, job.storage_options)
    rows = ordered_changelog(read_pieces(job.pieces), job.schema)
    fresh = fresh_changes(rows, job.frontiers, job.keys, held_in(root, job.uri))
    offsets = {tp: frontier.next_offset for tp, frontier in job.frontiers.items()}
    changelog = unapplied(fresh.rows, offsets)
    if changelog.num_rows == 0:
        return AppendResult((), {}, {}, 0, fresh.resent, fresh.conflicts)
    data = _conform(changelog, job.target)
    name = f"part-00000-{uuid.uuid4()}-c000.snappy.parquet"
    filesystem, base = root.filesystem()  # the sink's storage options reach an object store from here too
    path = f"{base}{job.uri.removeprefix(root.uri)}/{name}"
    pq.write_table(data, path, filesystem=filesystem, compression="snappy")
    size = filesystem.get_file_info(path).size
    written = (name, size, int(time.time() * 1000), file_stats(data, _STATS_COLUMNS))
    return AppendResult(
        (written,),
        next_offsets(changelog),
        newest_commit_ts(changelog),
        changelog.num_rows,
        fresh.resent,
        fresh.conflicts,
    )


@dataclass(frozen=True)
class HistoryJob:
    """One table's history MERGE of rows Spark tasks spooled, all a process needs to run it: the lake root
    and its storage options, the history's location and the changelog's (what re-sent copies are compared
    with, `fresh_changes`, with `frontiers` read before the batch), the spooled rows and their schema, the
    table's key, its floor (a TRUNCATE or DROP another member applied), and what its commit records."""

    root: str
    storage_options: dict[str, str]
    uri: str
    authority: str
    pieces: tuple[SpooledPiece, ...]
    schema: pa.Schema
    keys: tuple[str, ...]
    frontiers: dict[TopicPartition, Frontier]
    floor: int
    context: CommitContext
    max_commit_retries: int
    retry_backoff: float


HistoryRunner = Callable[[Sequence[HistoryJob]], Sequence[int]]
"""Runs history MERGEs (`DeltaSink.history_with`): each job as `write_history` does; the changes each
took, in the jobs' order."""


def write_history(job: HistoryJob) -> int:
    """Run `job` in this process (a Spark executor's Python worker); returns the changes it took."""
    root = LakeRoot.of(job.root, job.storage_options)
    rows = ordered_changelog(read_pieces(job.pieces), job.schema)
    fresh = fresh_changes(rows, job.frontiers, job.keys, held_in(root, job.authority)).rows

    def attempt() -> int:
        return merge_history(root, job.uri, fresh, job.keys, job.floor, job.context)

    try:
        return retry_commits(
            f"history {job.uri}", attempt, retries=job.max_commit_retries, backoff=job.retry_backoff
        )
    except (DeltaError, OSError, pa.ArrowException) as exc:
        raise SinkError(f"history {job.uri}: {exc}") from exc


def merge_history(
    root: LakeRoot, uri: str, changelog: pa.Table, keys: tuple[str, ...], floor: int, context: CommitContext
) -> int:
    """Each change opens a version; the batch's keys' stored versions are re-chained with the new ones (a
    late change splits the version it falls in), and one MERGE writes the new versions and the ends that
    moved. Applied offsets (app transactions) and versions already stored are skipped. Returns the changes
    taken; one attempt (the caller retries a conflict)."""
    history = root.existing(uri)
    fresh = unapplied(changelog, delta_applied(history, context.group, next_offsets(changelog)))
    if fresh.num_rows == 0:
        return 0
    columns = [n for n in changelog.column_names if n not in META_COLUMNS]
    cuts = [*_cuts(history), *([floor] if floor else [])]
    schema = _evolved(history, change_versions(fresh.slice(0, 0), columns).schema)
    new = _conform(change_versions(fresh, columns), schema)
    stored = _conform(_versions_of(root, history, new, keys), schema)
    new = matching(new, stored, identity(keys), found=False)  # stored already (another group's)
    both = pa.concat_tables([marked(stored, stored=True), marked(new, stored=False)])
    source = to_write(rechained(both, keys, cuts))
    if source.num_rows:
        _merge_versions(history, source, keys, _properties(context, transactions(fresh, context.group)))
    return fresh.num_rows


def _versions_of(root: LakeRoot, history: DeltaTable, versions: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """The history's versions of the keys `versions` has (files pruned by the first key's stats)."""
    wanted = pc.unique(versions[keys[0]])
    rows = root.scan(history).to_table(filter=pc.field(keys[0]).isin(wanted))
    return rows if len(keys) == 1 else matching(rows, versions, keys, found=True)


def _merge_versions(
    history: DeltaTable, source: pa.Table, keys: tuple[str, ...], properties: CommitProperties
) -> None:
    """A version is its key and the change that opened it: a stored one gets its new end, a new one is
    inserted."""
    assignments = {_quote(n): f"s.{_quote(n)}" for n in source.column_names}
    (
        history.merge(
            source,
            _merge_predicate(history, source, identity(keys), keys),
            source_alias="s",
            target_alias="t",
            streamed_exec=False,
            commit_properties=properties,
        )
        .when_matched_update({"_valid_to_ts": "s._valid_to_ts"})
        .when_not_matched_insert(assignments)
        .execute()
    )


def process_name() -> str:
    """This process, as mirror commits name the one that made them (`PROCESS_META`): `host:pid`."""
    return f"{socket.gethostname()}:{os.getpid()}"


class MirrorMerges:
    """What MERGEs a mirror, apart from the sink that decides when: a lake root, how mirrors are laid out and
    how commits are retried. `DeltaSink` is one; `run_merge_job` builds one where a `MergeJob` runs (an
    executor), from the job alone."""

    def __init__(
        self,
        root: LakeRoot,
        *,
        max_commit_retries: int = 20,
        retry_backoff: float = 0.05,
        target_file_size: int = DEFAULT_TARGET_FILE_SIZE,
        mirror_buckets: int = 0,
        split_rows: int = 0,
        defer_splits: bool = False,
    ) -> None:
        self.root = root
        self.max_commit_retries = max_commit_retries
        self.retry_backoff = retry_backoff
        self.target_file_size = target_file_size
        self.mirror_buckets = mirror_buckets  # for mirrors created from now on (a mirror records its own)
        self.split_rows = split_rows  # a bucketed MERGE of this many keys or more runs in bucket groups
        self.defer_splits = defer_splits  # whether such a MERGE is left to the caller (`prepare_merge_job`)
        self._metrics = dict.fromkeys(("merges", *MERGE_METRICS), 0)
        self._deletes_read: dict[str, dict[str, pa.Table]] = {}  # per side table: rows by file read
        self._complete_ts = 0  # a consistent point of the root this sink read: every mirror holds it
        self._point_read = False  # whether it was read yet (at an assignment, else the first mirror commit)

    def merge_pending(self, job: MergeJob) -> MergeResult:
        """MERGE into a lazy mirror the changes its changelog holds and it lacks (by its app transactions),
        each key's net change. Per partition only a prefix of offsets is MERGEd (app transactions record one
        offset), so the commit claims to be complete up to the job's point, or to just before the oldest
        change left out: a plain Delta reader then sees the table exactly as of the TSO the commit records.
        Runs the same wherever it runs: a job run twice (a task Spark retried) finds its rows applied and
        commits nothing."""
        entry = job.entry
        changelog = self.root.open(self.root.join(entry.location, "changelog"))
        mirror = self.root.open(self.root.join(entry.location, "mirror"))
        keys = (mirror.metadata().configuration.get(KEY_PROPERTY) or "") if mirror is not None else ""
        if changelog is None or mirror is None or not keys or entry.dropped_ts is not None:
            return MergeResult(entry.location, gone=True)  # a TRUNCATEd mirror goes on, from its floor
        since = job.since
        if since is None:
            versions = mirror_versions(mirror)
            since = versions[-1].complete_ts if versions else 0
        context = CommitContext(group=job.group, resolved_ts=job.resolved_ts)
        rows = _changes_after(self.root, changelog, since)
        if rows.num_rows:
            rows = unapplied(rows, delta_applied(mirror, context.group, next_offsets(rows)))
        merged, complete, left = _prefix_up_to(rows, max(job.point, job.upto or 0), job.point)
        before = dict(self._metrics)
        split = None
        if merged.num_rows:
            split = self._merge_changes(entry, merged, tuple(keys.split(",")), context, complete)
        metrics = {name: value - before.get(name, 0) for name, value in self._metrics.items()}
        version = None
        if metrics.get("merges"):
            merged_mirror = self.root.open(self.root.join(entry.location, "mirror"))
            version = None if merged_mirror is None else latest_mirror_version(merged_mirror, entry.mirror)
        complete_ts = max(since, complete)
        return MergeResult(entry.location, False, complete_ts, left, metrics, process_name(), version, split)

    # -- MERGE -----------------------------------------------------------------------------------------
    def _merge_changes(
        self,
        entry: CatalogEntry,
        changelog: pa.Table,
        keys: tuple[str, ...],
        context: CommitContext,
        complete: int | None = None,
    ) -> Split | None:
        """MERGE the changes of `changelog` (a batch, or a lazy mirror's changelog rows) the mirror lacks:
        each key's last change, by (commit ts, partition, offset), deletes winning ties. The commit claims
        the mirror complete up to `complete` (default: the consistent point last read). Returns a split
        MERGE left to the caller (`defer_splits`)."""
        uri = self.root.join(entry.location, "mirror")
        deletes_uri = self.root.join(entry.location, "deletes")
        columns = [*(n for n in changelog.column_names if n not in META_COLUMNS), *MIRROR_META]

        def attempt() -> Split | None:
            mirror = self._mirror(uri, changelog.select(columns).schema, keys, entry.floor)
            floor = _floor(mirror)  # rows from before a TRUNCATE/DROP another member applied
            fresh = unapplied(changelog, delta_applied(mirror, context.group, next_offsets(changelog)))
            fresh = fresh.filter(pc.greater_equal(fresh["_commit_ts"], floor)) if floor else fresh
            if fresh.num_rows == 0:
                return None
            latest = latest_per_key(fresh, keys)
            deleted = pc.equal(latest["_change_type"], "delete")
            if pc.any(deleted).as_py():  # before the mirror: a member reading the mirror after sees them
                recorded = latest.filter(deleted).select([*keys, "_commit_ts"])
                self._append_deletes(deletes_uri, recorded, context.group)
            latest = self._without_revived(deletes_uri, latest, keys)
            if latest.num_rows == 0:
                return None
            source = _conform(latest.select(columns), _evolved(mirror, latest.select(columns).schema))
            source = _bucketed(source, mirror, keys).append_column("_change_type", latest["_change_type"])
            newest = pc.max(fresh["_commit_ts"]).as_py()
            offsets = transactions(fresh, context.group)
            properties = self._properties(context, newest, offsets, complete)
            if self._splits(mirror, source):
                return self._merge_split(mirror, uri, source, keys, properties)
            self._merge(mirror, source, keys, properties)
            return None

        return self._commit(f"mirror {uri}", attempt)

    def _splits(self, mirror: DeltaTable, source: pa.Table) -> bool:
        """Whether a MERGE runs in bucket groups: a bucketed mirror, at least `split_rows` keys in two
        buckets or more, a local root (the groups write their files with `pyarrow.fs`, as appends do)."""
        return (
            0 < self.split_rows <= source.num_rows
            and self.root.is_local
            and _buckets(mirror) > 0
            and len(pc.unique(source[BUCKET])) >= 2
        )

    def _merge_split(
        self,
        mirror: DeltaTable,
        uri: str,
        source: pa.Table,
        keys: tuple[str, ...],
        properties: CommitProperties,
    ) -> Split | None:
        """The MERGE in bucket groups (`consumer.sinks.bucket_merges`), one commit: the groups on threads
        here, or left to the caller (`defer_splits`: Spark tasks), their rows spooled."""
        split = split_merge(mirror, uri, source, keys, properties, self.target_file_size)
        if self.defer_splits:
            return spooled(split)
        with ThreadPoolExecutor(len(split.parts), thread_name_prefix="bucket-merge") as pool:
            outcomes = list(pool.map(merge_bucket_part, split.parts))
        if not self.commit_split(split, outcomes):
            raise CommitFailedError(f"{uri}: a concurrent commit changed the buckets MERGEd")
        return None

    def commit_split(self, split: Split, outcomes: Sequence[BucketOutcome]) -> bool:
        """Commit a split MERGE's outcomes as one commit and count it; False when it conflicted."""
        mirror = self.root.open(split.mirror)
        if mirror is None:
            return False
        try:
            commit_split(mirror, split, outcomes)
        except CommitFailedError:
            return False
        self._metrics["merges"] += 1
        for name, value in split_metrics(outcomes).items():
            self._metrics[name] += value
        return True

    def _merge(
        self,
        mirror: DeltaTable,
        source: pa.Table,
        keys: tuple[str, ...],
        properties: CommitProperties,
    ) -> None:
        # Explicit column maps: delta-rs's *_all forms do not quote names (a backtick in one breaks them).
        assignments = {_quote(n): f"s.{_quote(n)}" for n in source.column_names if n != "_change_type"}
        metrics = (
            mirror.merge(
                source,
                _merge_predicate(mirror, source, keys, keys, bucketed=_buckets(mirror) > 0),
                source_alias="s",
                target_alias="t",
                streamed_exec=False,  # the source's key stats prune files too
                commit_properties=properties,
            )
            .when_matched_update(assignments, f"s._change_type <> 'delete' AND ({NEWER})")
            .when_matched_delete(f"s._change_type = 'delete' AND ({NEWER})")
            .when_not_matched_insert(assignments, "s._change_type <> 'delete'")
            .execute()
        )
        self._metrics["merges"] += 1
        for name in MERGE_METRICS:
            self._metrics[name] += int(metrics.get(name) or 0)

    def _mirror(self, uri: str, schema: pa.Schema, keys: tuple[str, ...], floor: int) -> DeltaTable:
        """The mirror at `uri`, created on first use with bounded files, its key and its floor recorded
        ("ignore": another member may create it first; the properties are set by whoever sees them unset)."""
        table = self.root.open(uri)
        if table is None:
            stored = pa.schema([_storable(field) for field in schema])
            partitions = None
            if self.mirror_buckets:  # the count in the column's metadata: created with the table, at once
                count = {BUCKETS_PROPERTY: str(self.mirror_buckets)}
                stored = stored.append(pa.field(BUCKET, pa.int64(), nullable=False, metadata=count))
                partitions = [BUCKET]
            configuration = {"delta.targetFileSize": str(self.target_file_size)}
            table = self.root.create(uri, stored, configuration, partitions)
        properties = {
            KEY_PROPERTY: ",".join(keys),
            **({FLOOR_PROPERTY: str(floor)} if floor > _floor(table) else {}),
        }
        if any(table.metadata().configuration.get(k) != v for k, v in properties.items()):
            table.alter.set_table_properties(properties, raise_if_not_exists=False)
        return table

    def _append_deletes(self, uri: str, deleted: pa.Table, group: str) -> None:
        """Blind appends: they never conflict, and a replayed delete only repeats a fact. Every
        PURGE_DELETES_EVERY commits the side table loses what the consistent point no longer needs, so
        reading it stays cheap between `maintain` runs."""
        table = self.root.open(uri)
        write_deltalake(
            table if table is not None else uri,
            pa.Table.from_arrays(deleted.columns, schema=pa.schema([_storable(f) for f in deleted.schema])),
            mode="append",
            schema_mode="merge",
            storage_options=self.root.options(),
        )
        table = self.root.open(uri)
        point = (
            consistent_ts(self.root, group) if table and table.version() % PURGE_DELETES_EVERY == 0 else None
        )
        if table is not None and point is not None:
            try:
                table.delete(f"_commit_ts < {point}")
                table.optimize.compact()
            except CommitFailedError:
                log.info("%s: purge skipped, another writer changed it", uri)

    def _without_revived(self, uri: str, latest: pa.Table, keys: tuple[str, ...]) -> pa.Table:
        """`latest` without the upserts of keys the side table says were deleted after them."""
        table = self.root.open(uri)
        upserting = pc.not_equal(latest["_change_type"], "delete")
        if table is None or not pc.any(upserting).as_py():
            return latest
        candidates = pc.unique(latest[keys[0]].filter(upserting))
        recorded = self._recorded_deletes(uri, table, [*keys, "_commit_ts"])
        recorded = recorded.filter(pc.is_in(recorded[keys[0]], candidates))
        if recorded.num_rows == 0:
            return latest
        deleted = recorded.group_by(list(keys), use_threads=False).aggregate([("_commit_ts", "max")])
        rows = pa.array(range(latest.num_rows), pa.int64())
        probe = latest.select([*keys, "_commit_ts", "_change_type"]).append_column("_row", rows)
        joined = probe.join(deleted, list(keys), join_type="inner")
        older = pc.and_(
            pc.greater(joined["_commit_ts_max"], joined["_commit_ts"]), pc.not_equal(joined["_commit_ts"], 0)
        )
        revived = joined.filter(pc.and_(pc.not_equal(joined["_change_type"], "delete"), older))["_row"]
        if len(revived) == 0:
            return latest
        return latest.filter(pc.invert(pc.is_in(rows, revived)))

    def _recorded_deletes(self, uri: str, table: DeltaTable, columns: list[str]) -> pa.Table:
        """The side table's rows, each of its files read once: on an object store every file is a request,
        and between purges a MERGE would otherwise read them all again."""
        files = self._deletes_read.setdefault(uri, {})
        live = set(table.file_uris())
        for gone in set(files) - live:
            del files[gone]
        for name in sorted(live - set(files)):
            files[name] = self.root.scan(table, [name]).to_table(columns=columns)
        schema = pa.schema([_schema(table).field(c) for c in columns])
        return pa.concat_tables(files.values()) if files else schema.empty_table()

    # -- plumbing --------------------------------------------------------------------------------------
    def _properties(
        self,
        context: CommitContext,
        newest_ts: int,
        offsets: list[Transaction] | None = None,
        complete_ts: int | None = None,
    ) -> CommitProperties:
        """A mirror commit's properties, saying which changes the mirror holds after it: every change up
        to `complete_ts` (default: the consistent point last read), and none newer than `newest_ts` besides
        earlier commits'."""
        if complete_ts is None and not self._point_read:  # a sink used without assignments (no pipeline)
            self._learn_point(context.group)
        complete = self._complete_ts if complete_ts is None else complete_ts
        marks = {COMPLETE_TS: str(complete), NEWEST_TS: str(newest_ts), PROCESS_META: process_name()}
        return CommitProperties(
            custom_metadata=commit_metadata(context) | marks, app_transactions=offsets or None
        )

    def _learn_point(self, group: str) -> int | None:
        """The root's consistent point, which every later mirror commit may claim to hold: every member
        applied every change up to it (to the mirrors themselves, or to the changelogs lazy MERGEs take
        them from: one cadence per lake). Read as partitions are assigned, or at the first mirror commit,
        so that a short run's commits are truthful too, not only those after a progress record."""
        self._point_read = True
        point = consistent_ts(self.root, group)
        self._complete_ts = max(self._complete_ts, point or 0)
        return point

    def _commit(self, what: str, attempt: Callable[[], T]) -> T:
        """Run `attempt` (which reloads its table and re-checks what is applied) until it commits."""
        try:
            return retry_commits(what, attempt, retries=self.max_commit_retries, backoff=self.retry_backoff)
        except (DeltaError, OSError, pa.ArrowException) as exc:
            raise SinkError(f"{what}: {exc}") from exc


class DeltaSink(LakehouseSink, MirrorMerges):
    """Writes each resolved batch to its table's changelog and/or mirror; safe for several writers.

    Writers of the same tables (group members in other processes or on other machines) use optimistic
    concurrency: on a commit conflict the table is reloaded, rows another writer already committed are
    dropped again, and the commit is retried with jittered exponential backoff, up to `max_commit_retries`.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        mode: str = "both",
        storage_options: Mapping[str, str] | None = None,
        max_commit_retries: int = 20,
        retry_backoff: float = 0.05,
        target_file_size: int = DEFAULT_TARGET_FILE_SIZE,
        allow_unsafe_commits: bool = False,
        mirror_interval_s: float = 0.0,
        mirror_interval_rows: int = 0,
        mirror_buckets: int = 0,
        mirror_split_rows: int = 0,
    ) -> None:
        super().__init__(root, storage_options, allow_unsafe_commits=allow_unsafe_commits)
        MirrorMerges.__init__(
            self,
            self.root,
            max_commit_retries=max_commit_retries,
            retry_backoff=retry_backoff,
            target_file_size=target_file_size,
            mirror_buckets=mirror_buckets,
            split_rows=mirror_split_rows,
        )
        self.outputs = sink_outputs(mode)  # raises ValueError for an unknown table kind
        if min(mirror_interval_s, mirror_interval_rows, mirror_buckets, mirror_split_rows) < 0:
            raise ValueError(
                "mirror_interval_s, mirror_interval_rows, mirror_buckets and mirror_split_rows must be >= 0"
            )
        self.mirror_interval_s, self.mirror_interval_rows = mirror_interval_s, mirror_interval_rows
        self.merge_runner: MergeRunner | None = None  # None: MERGEs run in this process
        self.append_runner: AppendRunner | None = None  # None: spooled rows are appended from here
        self.history_runner: HistoryRunner | None = None  # None: histories are MERGEd from here
        # by `id` of the batch (held, so the id is not reused): the files `write_ahead` wrote for it, and
        # the changelog's location and version they were written for
        self._written: dict[int, tuple[SpooledChanges, str, int, AppendResult]] = {}
        self.lazy_mirrors = False
        self._lazy(bool(mirror_interval_s or mirror_interval_rows))
        if "mirror" in self.outputs:  # one cadence per lake, recorded by its first writer
            require_mirror_cadence(self.root, MirrorCadence(mirror_interval_s, mirror_interval_rows))
        self._lagging: dict[str, _Lagging] = {}  # lazy mirrors by location: what awaits their next MERGE
        self._merged_ts: dict[str, int] = {}  # lazy mirrors by location: a TSO they hold every change up to
        self._caught_up = False  # lazy mirrors: MERGEd what a run before this sink left in the changelog
        # by location, the mirrors it committed to since its last record, and what the version its commit
        # made holds where a MERGE elsewhere said (None: read from the mirror's log)
        self._committed_mirrors: dict[str, MirrorVersion | None] = {}
        self._unordered = False  # the last progress recorded had no watermark: no consistent point
        self._warned_keyless: set[tuple[str, str]] = set()
        self.writer = f"{process_name()}:{uuid.uuid4().hex[:8]}"  # names its changelog commits
        self._rows_committed: dict[str, int] = {}  # by changelog location: the rows this sink committed

    def run_merges_with(self, runner: MergeRunner) -> None:
        """Run the mirrors' MERGEs through `runner` (e.g. one Spark task per table: `consumer.spark`), each
        from the changelog rows the mirror lacks: the mirrors become lazy, MERGEd when due or, without a
        cadence (`mirror_interval_s`, `mirror_interval_rows`), whenever progress is recorded. No mirror row
        passes through this process then. Call before the first write."""
        self._lazy(True)
        self.merge_runner = runner

    def append_with(self, runner: AppendRunner) -> None:
        """Have `runner` write the changelog files of batches whose rows are spooled (`SpooledChanges`,
        the Spark engine: a task per table on the executors, on any root: the tasks reach an object store
        with the sink's storage options); this process commits them, with the same app transactions and
        metadata as its own appends."""
        self.append_runner = runner

    def history_with(self, runner: HistoryRunner) -> None:
        """Have `runner` MERGE the histories of batches whose rows are spooled (the Spark engine: a task per
        table, on the executors), each from the rows where they are: no history row passes through this
        process."""
        self.history_runner = runner

    def _lazy(self, lazy: bool) -> None:
        self.lazy_mirrors = "mirror" in self.outputs and lazy
        if self.lazy_mirrors and "changelog" not in self.outputs:
            raise ValueError(
                "a mirror MERGEd on its own cadence (mirror_interval_s, mirror_interval_rows) or elsewhere "
                "(Spark's executors) is MERGEd from the changelog: the sink mode must keep the changelog too"
            )

    # -- Sink ------------------------------------------------------------------------------------------
    def write(self, changes: TableChanges, context: CommitContext) -> Written:
        """Rows go to the table holding their name at their commit ts (the catalog knows RENAMEs and
        DROPs another member applied already). Copies of changes the table holds (TiCDC re-sent them) are
        recognised once, by the first of its tables (`_authority`), and kept from every table."""
        if changes.row_count == 0:
            return Written(0)
        parts = [self._write_to(entry, part, context) for entry, part in self._located(changes)]
        return Written.of(parts)

    def _write_to(self, entry: CatalogEntry, changes: TableChanges, context: CommitContext) -> Written:
        authority = self.root.join(entry.location, self._authority())
        frontiers = delta_frontiers(self.root.open(authority), context.group, _partitions(changes))
        elsewhere = isinstance(changes, SpooledChanges) and self._appends_elsewhere()
        # rows spooled for an executor's append are judged there, not read here
        fresh = None if elsewhere else self._fresh(authority, changes, frontiers)
        if fresh is not None:
            changes = TableChanges(changes.schema, fresh.rows) if fresh.skipped else changes
        lazy = self.lazy_mirrors and bool(changes.key_columns)
        if lazy:  # before the changelog: a restart finds the key of the rows it must still MERGE
            self._lazy_mirror(entry, changes)
        written = None
        if "changelog" in self.outputs:
            written = self._append(self.root.join(entry.location, "changelog"), changes, context, frontiers)
            if fresh is not None:
                written = Written(written.rows, self._skipped(fresh.resent), self._letters(fresh, changes))
        if not changes.key_columns:
            self._warn_keyless(changes)
        if lazy:
            lagging = self._lagging[entry.location]  # MERGEd when due, after progress is recorded
            lagging.entry, lagging.rows = (
                entry,
                lagging.rows + (written.rows if written else changes.row_count),
            )
        elif "mirror" in self.outputs and changes.key_columns:
            kill_point("mirror-merge")  # tests: the changelog committed, the mirror not MERGEd
            self._catch_up(context)
            self._merge_mirror(entry, changes, context)
        if "history" in self.outputs and changes.key_columns:
            if fresh is None and self.history_runner is None:  # judged where the changelog's were: alike
                fresh = self._fresh(authority, changes, frontiers)
                changes = TableChanges(changes.schema, fresh.rows)
            self._merge_history(entry, changes, context, frontiers)
        self._wrote(entry)
        return written or self._written_without_changelog(changes, frontiers, fresh)

    def _authority(self) -> str:
        """The table whose records say which changes the lake holds: the changelog, which every change
        enters first, else the mirror, else the history."""
        return next(kind for kind in KINDS if kind in self.outputs)

    def _appends_elsewhere(self) -> bool:
        return self.append_runner is not None and "changelog" in self.outputs

    def _fresh(
        self, authority: str, changes: TableChanges, frontiers: Mapping[TopicPartition, Frontier]
    ) -> Fresh:
        return fresh_changes(changes.changelog, frontiers, changes.key_columns, held_in(self.root, authority))

    @staticmethod
    def _letters(fresh: Fresh, changes: TableChanges) -> tuple[DeadLetter, ...]:
        return conflict_letters(fresh.conflicts, _name(changes))

    def _written_without_changelog(
        self, changes: TableChanges, frontiers: Mapping[TopicPartition, Frontier], fresh: Fresh | None
    ) -> Written:
        """What a lake without a changelog took of a batch: the rows its first table lacked."""
        offsets = {tp: frontier.next_offset for tp, frontier in frontiers.items()}
        rows = unapplied(changes.changelog, offsets).num_rows
        if fresh is None:
            return Written(rows)
        return Written(rows, self._skipped(fresh.resent), self._letters(fresh, changes))

    def committed_rows(self) -> int | None:
        """The changelog rows this sink committed, read back from the changelogs' logs (the commits it
        named `WRITER_META`); a count that disagrees with what it committed is a `SinkError`. None
        without a changelog."""
        if "changelog" not in self.outputs:
            return None
        total = 0
        for uri, counted in sorted(self._rows_committed.items()):
            table = self.root.existing(uri)
            logged = sum(
                int(commit.get(ROWS_META) or 0)
                for commit in table.history()
                if commit.get(WRITER_META) == self.writer
            )
            if logged != counted:
                raise SinkError(f"{uri}: its log holds {logged} rows of this run's commits, not {counted}")
            total += logged
        return total

    def _warn_keyless(self, changes: TableChanges) -> None:
        name = (changes.database, changes.table)
        if self.outputs <= {"changelog"} or name in self._warned_keyless:
            return
        self._warned_keyless.add(name)
        log.warning(
            "%s.%s has no primary key or NOT NULL unique index: no mirror or history, changelog only", *name
        )

    def recorded_watermarks(self, group: str) -> dict[TopicPartition, int]:
        """Also reads the root's consistent point (partitions were assigned: before this member writes), so
        its first mirror commits already claim what the lake holds (`_learn_point`)."""
        self._learn_point(group)
        return super().recorded_watermarks(group)

    def record_progress(self, context: CommitContext) -> None:
        """Also re-reads the root's consistent point, which later mirror commits claim to hold; then MERGEs
        the lazy mirrors that are due (all of them as the run stops or partitions go, and, first, every
        mirror a run before this sink left behind its changelog), and records in the catalog what the
        mirrors it committed to hold."""
        super().record_progress(context)
        point = self._learn_point(context.group)
        # without watermarks (`ordering = "arrival"`) the lake has no consistent point: a lazy MERGE takes
        # every change the changelog holds, as a MERGE of each batch would, and claims no TSO
        self._unordered = point is None and context.resolved_ts == 0
        self._catch_up(context)
        if self.lazy_mirrors:
            self._merge_due(context)
        self._record_mirrors()

    def _merge_due(self, context: CommitContext) -> None:
        due = [
            lagging
            for lagging in self._lagging.values()
            if (context.stopped is not None and lagging.rows != 0) or self._due(lagging)
        ]
        if due:
            self._merge_lagging(due, context)

    def _record_mirrors(self) -> None:
        """Record in the catalog what the mirrors this sink committed to since its last progress record hold
        now, by their commits' claims: one catalog commit at most per progress record, not one per MERGE
        (and none when no mirror moved to a later version). A mirror MERGEd every batch also holds every
        change up to the consistent point just read (every member MERGEd its changes up to it before it
        recorded progress), which its commits, made before, could not claim: so it is exact at the end of
        a run, and whenever its newest change is no later than that point."""
        recorded = {entry.location: entry.mirror for entry in self.catalog.entries()}
        point = 0 if self.lazy_mirrors else self._complete_ts  # a lazy mirror lags the point by design
        versions = {}
        for location, merged in sorted(self._committed_mirrors.items()):
            known = recorded.get(location)
            latest = merged if merged is not None else self._latest_mirror_version(location, known)
            if latest is not None and (known is None or latest.version > known.version):
                versions[location] = dataclasses.replace(latest, complete_ts=max(latest.complete_ts, point))
        self._committed_mirrors.clear()
        if versions:
            self.catalog.record_mirrors(versions)

    def _latest_mirror_version(self, location: str, known: MirrorVersion | None) -> MirrorVersion | None:
        mirror = self.root.open(self.root.join(location, "mirror"))  # opened after the point was read
        return None if mirror is None else latest_mirror_version(mirror, known)

    # -- lazy mirrors ----------------------------------------------------------------------------------
    def _catch_up(self, context: CommitContext) -> None:
        """Once, before this sink's first mirror MERGE: MERGE what the changelogs hold and the mirrors lack,
        left by a run before this sink (either engine's) that stopped between its changelog commit and its
        MERGE. A lazy sink MERGEs it with its first due MERGEs; an eager one (the loop engine without a
        cadence), which otherwise MERGEs only its own batches, MERGEs all of it now. Which mirrors lag is
        read from the tables' app transactions alone (no history, no rows), so a start costs little."""
        if self._caught_up or "mirror" not in self.outputs:
            return
        self._caught_up = True
        if not self._point_read:
            self._learn_point(context.group)
        partitions = list(self.progress.partitions(context.group))
        behind = [
            _Lagging(entry, rows=-1)
            for entry in self.catalog.refresh()
            if entry.dropped_ts is None
            and entry.location not in self._lagging
            and self._mirror_lags(entry, context.group, partitions)
        ]
        if self.lazy_mirrors:
            self._lagging.update((lagging.entry.location, lagging) for lagging in behind)
        elif behind:
            self._merge_lagging(behind, context, upto=UNBOUNDED_TS)

    def _mirror_lags(self, entry: CatalogEntry, group: str, partitions: list[TopicPartition]) -> bool:
        """Whether the table's changelog holds offsets of the group its mirror's app transactions lack."""
        mirror = self.root.open(self.root.join(entry.location, "mirror"))
        changelog = self.root.open(self.root.join(entry.location, "changelog"))
        if mirror is None or changelog is None:
            return False
        merged, held = delta_applied(mirror, group, partitions), delta_applied(changelog, group, partitions)
        return any(merged.get(tp, 0) < offset for tp, offset in held.items())

    def merge_due(self) -> bool:
        """Whether a lazy mirror's MERGE is due (`MergesWhenDue`): the pipeline then records progress at
        once, which MERGEs it, on an idle stream too. Only reads (another thread may be writing)."""
        return self.lazy_mirrors and any(
            self._due(lagging) and (lagging.rows != lagging.left or self._interval_passed(lagging))
            for lagging in list(self._lagging.values())  # left rows alone: again once new ones come
        )

    def _due(self, lagging: _Lagging) -> bool:
        """Whether a lazy mirror's next MERGE is due: rows of unknown count await it (a run before this
        sink's), `mirror_interval_rows` do, or `mirror_interval_s` passed since its last MERGE."""
        if lagging.rows < 0:
            return True
        rows = self.mirror_interval_rows
        if not (rows or self.mirror_interval_s):  # MERGEd elsewhere without a cadence: whenever rows await it
            return lagging.rows > 0
        return lagging.rows > 0 and ((rows > 0 and lagging.rows >= rows) or self._interval_passed(lagging))

    def _interval_passed(self, lagging: _Lagging) -> bool:
        seconds = self.mirror_interval_s
        return seconds > 0 and time.monotonic() - lagging.merged_at >= seconds

    def _lazy_mirror(self, entry: CatalogEntry, changes: TableChanges) -> None:
        """A lazy mirror exists, its key recorded, before its first changelog rows."""
        if entry.location in self._lagging:
            return
        uri = self.root.join(entry.location, "mirror")
        described = changes.changelog_schema
        columns = [*(n for n in described.names if n not in META_COLUMNS), *MIRROR_META]
        schema = pa.schema([described.field(name) for name in columns])

        def create() -> None:
            self._mirror(uri, schema, changes.key_columns, entry.floor)

        self._commit(f"mirror {uri}", create)
        self._lagging[entry.location] = _Lagging(entry)

    def _merge_lagging(
        self, laggings: Sequence[_Lagging], context: CommitContext, upto: int | None = None
    ) -> None:
        """MERGE into lazy mirrors the changes their changelogs hold and they lack, up to the consistent
        point read before (`upto`, later for a DDL barrier): one `MergeJob` per table, run here or by the
        merge runner (`run_merges_with`), which gets only the job (a table's location, what to MERGE) and
        gives back only small results. A DROPped table leaves the lazy mirrors (a TRUNCATEd one goes on,
        above its floor)."""
        jobs = [
            MergeJob(
                root=self.root.uri,
                storage_options=dict(self.root.storage_options),
                entry=lagging.entry,
                group=context.group,
                resolved_ts=context.resolved_ts,
                point=self._complete_ts,  # read before the changelog is: every change up to it is there
                upto=UNBOUNDED_TS if upto is None and self._unordered else upto,
                since=self._merged_ts.get(lagging.entry.location),
                max_commit_retries=self.max_commit_retries,
                retry_backoff=self.retry_backoff,
                target_file_size=self.target_file_size,
                mirror_buckets=self.mirror_buckets,
                split_rows=self.split_rows,
            )
            for lagging in laggings
        ]
        if self.merge_runner is None:
            results = [self.merge_pending(job) for job in jobs]
        else:
            results = list(self.merge_runner(jobs))
            for elsewhere in results:
                for name, value in elsewhere.metrics.items():
                    self._metrics[name] = self._metrics.get(name, 0) + value
        by_location = {result.location: result for result in results}
        for lagging in laggings:
            location = lagging.entry.location
            found = by_location.get(location)
            if found is None:
                raise SinkError(f"the MERGE of {location}'s mirror gave no result")
            if found.gone:
                self._lagging.pop(location, None)
                continue
            if found.metrics.get("merges"):
                self._committed_mirrors[location] = found.version
            self._merged_ts[location] = found.merged_ts
            lagging.rows, lagging.merged_at, lagging.left = found.left, time.monotonic(), found.left

    def _apply_to_table(self, ddl: DDL, name: Name, context: CommitContext) -> CatalogEntry | None:
        """The catalog's part (`LakehouseSink`), and the tables':

        - ALTER: columns new in the DDL's schema are added (earlier rows null); columns it no longer has stay
          in Delta (the changelog keeps their history) and are set null in the mirror; a changed type
          (MODIFY COLUMN) keeps the Delta type, since delta-rs cannot widen a column: later values are cast
          to it and a value that does not fit exactly raises SinkError. A type with no cast at all raises now.
        - TRUNCATE, ERASE (DROP TABLE): the mirror loses every row older than the DDL, and its floor
          (`ticdc.truncated_at`) keeps a lagging member's older changes out; the changelog keeps the history,
          and the history's open versions end at the DDL (`ticdc.history.closed_at` ends later ones too).
        - CREATE, RENAME: the catalog only. CINDEX, DINDEX, QUERY: only logged. An ALTER whose schema has no
          columns (TiCDC Avro's DDL record names its table only) alters nothing: its rows bring their columns.
        Every step is idempotent, so members applying one DDL at once both succeed.
        """
        if self.lazy_mirrors and ddl.type is DDLType.ALTER:  # the DDL is a barrier for a lazy mirror too
            before = self.catalog.find(name, ddl.commit_ts - 1)
            if before is not None:
                lagging = self._lagging.get(before.location) or _Lagging(before)
                self._merge_lagging([lagging], context, upto=ddl.commit_ts - 1)
        emptied = super()._apply_to_table(ddl, name, context)
        if emptied is not None:
            self._lagging.pop(emptied.location, None)  # nothing older than the DDL belongs in it any more
            self._empty_mirror(emptied, ddl, context)
            self._close_history(emptied, ddl.commit_ts, context)
        elif ddl.type is DDLType.ALTER and ddl.table_schema is not None and ddl.table_schema.columns:
            entry = self.catalog.find(name, ddl.commit_ts - 1)
            if entry is None:
                self.catalog.refresh()
                entry = self.catalog.find(name, ddl.commit_ts - 1)
            if entry is not None:
                self._alter(entry, stored_schema(TableCodec(ddl.table_schema)), context, ddl.commit_ts)
        return emptied

    def operation_metrics(self) -> dict[str, int]:
        """The mirror MERGEs' delta-rs metrics, summed since this sink was made."""
        return dict(self._metrics)

    # -- rows ------------------------------------------------------------------------------------------
    def _append(
        self,
        uri: str,
        changes: TableChanges,
        context: CommitContext,
        frontiers: Mapping[TopicPartition, Frontier],
    ) -> Written:
        if isinstance(changes, SpooledChanges) and self.append_runner is not None:
            return self._append_elsewhere(uri, changes, self.append_runner, context, frontiers)
        return Written(self._append_changelog(uri, changes.changelog, context))

    def write_ahead(self, batches: Sequence[SpooledChanges], context: CommitContext) -> None:
        """Have the runner write the changelog files of `batches` (about to be written one by one) at once:
        one Spark job for every table; `write` commits each batch's file when nothing changed in between."""
        runner = self.append_runner
        if runner is None or "changelog" not in self.outputs:
            return
        jobs: list[tuple[SpooledChanges, int, AppendJob]] = []
        for changes in batches:
            if changes.row_count:
                entry = self.catalog.locate((changes.database, changes.table), changes.newest_commit_ts)
                table, job = self._append_job(self.root.join(entry.location, "changelog"), changes, context)
                jobs.append((changes, table.version(), job))
        results = runner([job for _, _, job in jobs]) if jobs else []
        for (changes, version, job), result in zip(jobs, results, strict=True):
            self._written[id(changes)] = (changes, job.uri, version, result)

    def _append_elsewhere(
        self,
        uri: str,
        changes: SpooledChanges,
        runner: AppendRunner,
        context: CommitContext,
        frontiers: Mapping[TopicPartition, Frontier],
    ) -> Written:
        """Have `runner` write the files of the rows the changelog lacks (or take those `write_ahead` had
        written for the same table state), then commit them here with their app transactions; a conflict
        writes them again (the files of the attempt are orphans)."""

        def attempt() -> AppendResult:
            ahead = self._written.pop(id(changes), None)
            table = self.root.open(uri)
            if ahead is not None and table is not None and ahead[1:3] == (uri, table.version()):
                result = ahead[3]  # written for this very version of the table
            else:
                table, job = self._append_job(uri, changes, context)
                [result] = runner([job])
            if not result.files:
                return result
            kill_point("changelog-files-written")  # tests: files written, not committed
            offsets = frontier_transactions(context.group, result.next_offsets, result.newest_ts)
            table.create_write_transaction(
                result.actions(),
                mode="append",
                schema=table.schema(),
                commit_properties=self._append_properties(context, offsets, result.rows),
            )
            return result

        result = self._commit(f"changelog {uri}", attempt)
        kill_point("changelog-files-committed")  # tests: committed, nothing after
        self._rows_committed[uri] = self._rows_committed.get(uri, 0) + result.rows
        letters = conflict_letters(result.conflicts, _name(changes))
        return Written(result.rows, self._skipped(result.resent), letters)

    def _append_job(
        self, uri: str, changes: SpooledChanges, context: CommitContext
    ) -> tuple[DeltaTable, AppendJob]:
        """The changelog at `uri` (created or grown for the batch's columns) and the job writing the batch's
        rows it lacks."""
        table = self._changelog_with(uri, changes.changelog_schema, context)
        frontiers = delta_frontiers(table, context.group, changes.partitions())
        job = AppendJob(
            self.root.uri,
            dict(self.root.storage_options),
            uri,
            tuple(changes.pieces),
            changes.changelog_schema,
            _schema(table),
            frontiers,
            changes.key_columns,
        )
        return table, job

    def _changelog_with(self, uri: str, schema: pa.Schema, context: CommitContext) -> DeltaTable:
        """The changelog at `uri`, created or grown (an empty commit) until it has every column of
        `schema`: files written elsewhere are committed in the table's own schema."""
        table = self.root.open(uri)
        target = _arrow_schema(table)
        if table is not None and target is not None and set(schema.names) <= set(target.names):
            return table
        write_deltalake(
            table if table is not None else uri,
            _conform(schema.empty_table(), target),
            mode="append",
            schema_mode="merge",
            storage_options=self.root.options(),
            commit_properties=_properties(context),
        )
        created = self.root.open(uri)
        assert created is not None
        return created

    def _append_changelog(self, uri: str, changelog: pa.Table, context: CommitContext) -> int:
        """Append the rows the changelog lacks; returns how many."""

        def attempt() -> int:
            table = self.root.open(uri)
            fresh = unapplied(changelog, delta_applied(table, context.group, next_offsets(changelog)))
            if fresh.num_rows == 0:
                return 0
            write_deltalake(
                table if table is not None else uri,
                _conform(fresh, _arrow_schema(table)),
                mode="append",
                schema_mode="merge",
                storage_options=self.root.options(),
                commit_properties=self._append_properties(
                    context, transactions(fresh, context.group), fresh.num_rows
                ),
            )
            return fresh.num_rows

        rows = self._commit(f"changelog {uri}", attempt)
        self._rows_committed[uri] = self._rows_committed.get(uri, 0) + rows
        return rows

    def _append_properties(
        self, context: CommitContext, offsets: list[Transaction], rows: int
    ) -> CommitProperties:
        """A changelog commit's: the context, its rows and this sink's name, so a run's total can be read
        back from the log (`committed_rows`)."""
        marks = {ROWS_META: str(rows), WRITER_META: self.writer}
        return CommitProperties(custom_metadata=commit_metadata(context) | marks, app_transactions=offsets)

    def _merge_mirror(self, entry: CatalogEntry, changes: TableChanges, context: CommitContext) -> None:
        """Stale changes (older than the mirror's row, or than a later delete of the key) never win; an
        upsert of a key the mirror lacks inserts it (a consumer that joined mid-stream never saw its INSERT);
        a MERGE that changes nothing commits nothing (delta-rs)."""
        self._merge_changes(entry, changes.changelog, changes.key_columns, context)
        self._committed_mirrors[entry.location] = None

    # -- history ---------------------------------------------------------------------------------------
    def _merge_history(
        self,
        entry: CatalogEntry,
        changes: TableChanges,
        context: CommitContext,
        frontiers: Mapping[TopicPartition, Frontier],
    ) -> None:
        """The batch's changes into the table's history (`merge_history`): here, or, for rows spooled by
        Spark tasks with a history runner (`history_with`), in a task that reads them where they are and
        judges re-sent copies as the changelog's task did."""
        keys = changes.key_columns
        uri = self.root.join(entry.location, "history")
        columns = [n for n in changes.changelog_schema.names if n not in META_COLUMNS]
        schema = pa.schema([changes.changelog_schema.field(n) for n in columns])
        floor = self._history(uri, schema, keys, entry)  # created here, where the catalog is
        context = CommitContext(group=context.group, resolved_ts=context.resolved_ts)
        if isinstance(changes, SpooledChanges) and self.history_runner is not None:
            authority = self.root.join(entry.location, self._authority())
            job = HistoryJob(
                self.root.uri,
                dict(self.root.storage_options),
                uri,
                authority,
                tuple(changes.pieces),
                changes.changelog_schema,
                keys,
                dict(frontiers),
                floor,
                context,
                self.max_commit_retries,
                self.retry_backoff,
            )
            self.history_runner([job])
            return
        changelog = changes.changelog

        def attempt() -> None:
            merge_history(self.root, uri, changelog, keys, floor, context)

        self._commit(f"history {uri}", attempt)

    def _history(self, uri: str, schema: pa.Schema, keys: tuple[str, ...], entry: CatalogEntry) -> int:
        """The history at `uri`, created on first use with its key recorded; returns its table's floor (a
        TRUNCATE or DROP: versions end there regardless of later changes, as at the history's own
        `CLOSED_PROPERTY`; its creator re-reads the catalog: a DDL applied before it existed recorded
        nothing in it)."""
        table = self.root.open(uri)
        if table is None:
            stored = pa.schema([*(_storable(field) for field in schema), *HISTORY_FIELDS])
            table = self.root.create(uri, stored, {"delta.targetFileSize": str(self.target_file_size)})
            entry = next(e for e in self.catalog.refresh() if e.location == entry.location)
        if table.metadata().configuration.get(KEY_PROPERTY) != ",".join(keys):
            table.alter.set_table_properties({KEY_PROPERTY: ",".join(keys)}, raise_if_not_exists=False)
        return entry.floor

    def _close_history(self, entry: CatalogEntry, commit_ts: int, context: CommitContext) -> None:
        """End the versions valid at a TRUNCATE or DROP; the property first, so a lagging member's later
        MERGE ends its versions there too (its commit conflicts with this one and re-reads it)."""
        uri = self.root.join(entry.location, "history")

        def attempt() -> None:
            table = self.root.open(uri)
            if table is None:
                return
            cuts = _cuts(table)
            if commit_ts not in cuts:
                table.alter.set_table_properties(
                    {CLOSED_PROPERTY: ",".join(str(ts) for ts in sorted([*cuts, commit_ts]))},
                    raise_if_not_exists=False,
                    commit_properties=_properties(context),
                )
            ts = commit_ts
            table.update(
                updates={"_valid_to_ts": str(ts)},
                predicate=f"_valid_from_ts < {ts} AND (_valid_to_ts IS NULL OR _valid_to_ts > {ts})",
                commit_properties=_properties(context),
            )

        self._commit(f"closing {uri}", attempt)

    # -- DDL -------------------------------------------------------------------------------------------
    def _alter(self, entry: CatalogEntry, schema: pa.Schema, context: CommitContext, commit_ts: int) -> None:
        fields = [_storable(field) for field in schema]
        for kind in KINDS:
            uri = self.root.join(entry.location, kind)
            self._commit(f"ALTER {uri}", partial(self._evolve, uri, fields, context, commit_ts))

    def _evolve(self, uri: str, fields: list[pa.Field], context: CommitContext, commit_ts: int) -> None:
        table = self.root.open(uri)
        if table is None:
            return
        current = _schema(table)
        for field in fields:
            if field.name in current.names and not _castable(field.type, current.field(field.name).type):
                raise SinkError(
                    f"{uri}: column {field.name!r} changed to {field.type}, which cannot be stored in its "
                    f"Delta type {current.field(field.name).type}"
                )
        wanted = {field.name for field in fields}
        kept = (*META_COLUMNS, *MIRROR_META, BUCKET)
        dropped = [n for n in current.names if n not in wanted and n not in kept]
        if dropped and uri.endswith("/mirror"):
            table.update(
                updates={_quote(n): "NULL" for n in dropped},
                predicate=" OR ".join(f"{_quote(n)} IS NOT NULL" for n in dropped),
                commit_properties=self._properties(context, commit_ts),
            )
        added = [Field.from_arrow(field) for field in fields if field.name not in current.names]
        if added:
            table.alter.add_columns(added, commit_properties=_properties(context))

    def _empty_mirror(self, entry: CatalogEntry, ddl: DDL, context: CommitContext) -> None:
        """Raise the mirror's floor to the DDL, then delete the rows older than it: a member still behind the
        DDL must not bring them back. A table with a key gets its mirror now if it has none yet, so the
        floor is there before any older row could create it."""
        uri = self.root.join(entry.location, "mirror")
        schema = ddl.table_schema

        def attempt() -> None:
            table = self.root.open(uri)
            if table is None and schema is not None and schema.handle_key():
                table = self._mirror(uri, _mirror_schema(schema), _key_of(schema), ddl.commit_ts)
            if table is None:
                return
            if _floor(table) < ddl.commit_ts:
                table.alter.set_table_properties(
                    {FLOOR_PROPERTY: str(ddl.commit_ts)},
                    raise_if_not_exists=False,
                    commit_properties=_properties(context),
                )
            table.delete(
                f"_commit_ts < {ddl.commit_ts}", commit_properties=self._properties(context, ddl.commit_ts)
            )

        self._commit(f"emptying {uri}", attempt)
        self._committed_mirrors[entry.location] = None


def _prefix_up_to(rows: pa.Table, upto: int, point: int) -> tuple[pa.Table, int, int]:
    """Of changelog rows a mirror lacks, what one MERGE applies: per partition the rows before its first
    change after `upto` (commit ts 0, unknown, never counts as after). Returns those, a TSO the mirror
    then holds every change up to (`point`, or just before the oldest change left out), and how many are
    left out."""
    if rows.num_rows == 0:
        return rows, point, 0
    ts = rows["_commit_ts"]
    late = rows.filter(pc.greater(ts, upto))
    if late.num_rows == 0:
        return rows, point, 0
    cuts = late.group_by(["_topic", "_partition"], use_threads=False).aggregate([("_offset", "min")])
    left_out = None
    for topic, partition, cut in zip(
        *(cuts[c].to_pylist() for c in ("_topic", "_partition", "_offset_min")), strict=True
    ):
        here = pc.and_(
            pc.and_(pc.equal(rows["_topic"], topic), pc.equal(rows["_partition"], partition)),
            pc.greater_equal(rows["_offset"], cut),
        )
        left_out = here if left_out is None else pc.or_(left_out, here)
    assert left_out is not None
    left = rows.filter(left_out)
    known = left["_commit_ts"].filter(pc.greater(left["_commit_ts"], 0))
    oldest = pc.min(known).as_py() if len(known) else None
    complete = point if oldest is None else min(point, oldest - 1)
    return rows.filter(pc.invert(left_out)), complete, left.num_rows


def _evolved(table: DeltaTable, schema: pa.Schema) -> pa.Schema:
    """The table's schema after adding the batch's columns it lacks (a schema version it was not ALTERed to
    yet, e.g. written by a member ahead of this one)."""
    current = _schema(table)
    added = [Field.from_arrow(_storable(f)) for f in schema if f.name not in current.names]
    if added:
        table.alter.add_columns(added)
        current = _schema(table)
    return current


def _partitions(changes: TableChanges) -> set[TopicPartition]:
    if isinstance(changes, SpooledChanges):
        return changes.partitions()
    return set(next_offsets(changes.changelog))


def _name(changes: TableChanges) -> str:
    return f"{changes.database}.{changes.table}"


def _changes_after(root: LakeRoot, changelog: DeltaTable, since: int) -> pa.Table:
    """The changelog's rows with a commit ts after `since` (or unknown, 0), reading only the files whose
    statistics allow such rows."""
    files = _files_holding(changelog, lambda low, high: high > since or low <= 0)
    ts = pc.field("_commit_ts")
    return root.scan(changelog, files).to_table(filter=(ts > since) | (ts == 0))


def held_in(root: LakeRoot, uri: str) -> Held:
    """What the table at `uri` holds of a partition at some commit ts, for `fresh_changes`: a changelog's
    rows. A mirror or a history holds no changes to compare with, and needs none: taking the same change
    again leaves the same row (a mirror's MERGE) or version (a history's) as taking it once."""

    def held(tp: TopicPartition, commit_ts: Sequence[int], columns: Sequence[str]) -> pa.Table:
        table = root.open(uri) if uri.endswith("/changelog") else None
        return pa.table({}) if table is None else rows_at(root, table, tp, commit_ts, columns)

    return held


def rows_at(
    root: LakeRoot, table: DeltaTable, tp: TopicPartition, commit_ts: Sequence[int], columns: Sequence[str]
) -> pa.Table:
    """A changelog's rows of one partition at the given commit ts (those of `columns` it has), reading only
    the files whose statistics allow such rows: what a re-sent change is compared with (`fresh_changes`)."""
    low, high = min(commit_ts), max(commit_ts)
    files = _files_holding(table, lambda first, last: first <= high and last >= low)
    topic, partition = tp
    where = pc.field("_commit_ts").isin(list(commit_ts)) & (pc.field("_topic") == topic)
    where &= pc.field("_partition") == partition
    have = pa.schema(table.schema().to_arrow())
    wanted = [name for name in columns if name in have.names]
    rows = root.scan(table, files).to_table(columns=wanted, filter=where)
    return as_durations(rows, stored_durations(have))


def _files_holding(table: DeltaTable, holds: Callable[[int, int], bool]) -> list[str]:
    """The table's files whose `_commit_ts` statistics (low, high) may hold wanted rows (`holds`), and every
    file without statistics."""
    actions = pa.table(table.get_add_actions(flatten=True))
    files = table.file_uris()
    if "max._commit_ts" not in actions.column_names or "min._commit_ts" not in actions.column_names:
        return files
    lows, highs = actions["min._commit_ts"].to_pylist(), actions["max._commit_ts"].to_pylist()
    wanted = {  # by file name: unique in a Delta table, and free of the paths' encodings
        path.rsplit("/", 1)[-1]
        for path, low, high in zip(actions["path"].to_pylist(), lows, highs, strict=True)
        if low is None or high is None or holds(low, high)
    }
    return [uri for uri in files if uri.rsplit("/", 1)[-1] in wanted]


# -- MERGE predicates ----------------------------------------------------------------------------------
def _merge_predicate(
    target: DeltaTable,
    source: pa.Table,
    columns: Sequence[str],
    keys: Sequence[str],
    *,
    bucketed: bool = False,
) -> str:
    """Target and source rows match on `columns`, within the ranges of the source's first key column; in
    a bucketed mirror also within the source's buckets, named as literals (delta-rs prunes partitions and
    files on literal target predicates only)."""
    predicate = " AND ".join(f"t.{_quote(c)} = s.{_quote(c)}" for c in columns)
    buckets = None
    if bucketed:
        buckets = sorted(pc.unique(source[BUCKET]).to_pylist())
        predicate += f" AND t.{BUCKET} IN ({', '.join(str(int(b)) for b in buckets)})"
    ranges = _key_ranges(source, keys[0], _file_starts(target, keys[0], buckets))
    return f"{predicate} AND ({ranges})" if ranges else predicate


def _buckets(table: DeltaTable) -> int:
    """A mirror's bucket count (0: not bucketed), from its bucket column's metadata."""
    schema = _schema(table)
    if BUCKET not in schema.names:
        return 0
    value = (schema.field(BUCKET).metadata or {}).get(BUCKETS_PROPERTY.encode())
    return int(value) if value else 0


def _bucketed(source: pa.Table, mirror: DeltaTable, keys: Sequence[str]) -> pa.Table:
    """`source` with each row's bucket, when the mirror has buckets."""
    buckets = _buckets(mirror)
    if not buckets:
        return source
    bucket = bucket_of(source[keys[0]], buckets)
    if BUCKET in source.column_names:
        return source.set_column(source.column_names.index(BUCKET), BUCKET, bucket)
    return source.append_column(BUCKET, bucket)


def _file_starts(table: DeltaTable, key: str, buckets: Sequence[int] | None = None) -> np.ndarray | None:
    """The sorted smallest keys of the table's files (of those in `buckets`, when given) from their
    statistics; None when a file has none."""
    actions = pa.table(table.get_add_actions(flatten=True))
    partition = f"partition.{BUCKET}"
    if buckets is not None and partition in actions.column_names:
        actions = actions.filter(pc.is_in(actions[partition].cast(pa.int64()), pa.array(buckets, pa.int64())))
    column = f"min.{key}"
    if column not in actions.column_names:
        return None if actions.num_rows else np.array([])
    starts = actions[column]
    if starts.null_count:
        return None
    return np.sort(_keys_array(starts))


def _key_ranges(source: pa.Table, key: str, file_starts: np.ndarray | None) -> str | None:
    """A disjunction of ranges of `key` covering every key of `source`, for delta-rs to skip the files
    outside them: the source's keys cut at the gaps where most files start (those would be read in vain),
    at most MAX_KEY_RANGES ranges. None when the key's type or the files' stats do not allow it."""
    kind = source.schema.field(key).type
    if file_starts is None or not (pa.types.is_integer(kind) or pa.types.is_string(kind)):
        return None
    keys = np.unique(_keys_array(source[key]))
    before = np.searchsorted(file_starts, keys, side="right")  # files starting at or before each key
    files_in_gap = np.diff(before)  # files starting between neighbouring keys
    cuts = np.sort(np.argsort(-files_in_gap, kind="stable")[: MAX_KEY_RANGES - 1])
    cuts = cuts[files_in_gap[cuts] > 0]
    firsts = [keys[0], *(keys[cut + 1] for cut in cuts)]
    lasts = [*(keys[cut] for cut in cuts), keys[-1]]
    column = f"t.{_quote(key)}"
    return " OR ".join(
        f"{column} = {_literal(lo)}"
        if lo == hi
        else f"({column} >= {_literal(lo)} AND {column} <= {_literal(hi)})"
        for lo, hi in zip(firsts, lasts, strict=True)
    )


def _keys_array(values: pa.ChunkedArray | pa.Array) -> np.ndarray:
    if pa.types.is_integer(values.type):
        return np.asarray(values.to_numpy())
    return np.array(values.to_pylist(), dtype=object)


def _literal(value: Any) -> str:
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return str(int(value))


# -- small helpers -------------------------------------------------------------------------------------
def _floor(table: DeltaTable) -> int:
    value = table.metadata().configuration.get(FLOOR_PROPERTY)
    return int(value) if value else 0


def _cuts(table: DeltaTable) -> list[int]:
    value = table.metadata().configuration.get(CLOSED_PROPERTY)
    return [int(ts) for ts in value.split(",")] if value else []


def _key_of(schema: TableSchema) -> tuple[str, ...]:
    return tuple(stored_name(name) for name in schema.handle_key())


def _mirror_schema(schema: TableSchema) -> pa.Schema:
    meta = [
        pa.field("_commit_ts", pa.int64(), nullable=False),
        pa.field("_schema_version", pa.int64(), nullable=False),
    ]
    return pa.schema([*stored_schema(TableCodec(schema)), *meta])


def _properties(context: CommitContext, offsets: list[Transaction] | None = None) -> CommitProperties:
    """The `ticdc.*` commit metadata every commit carries, and the offsets it applies."""
    return CommitProperties(custom_metadata=commit_metadata(context), app_transactions=offsets or None)


# -- Arrow <-> Delta -----------------------------------------------------------------------------------
def _arrow_schema(table: DeltaTable | None) -> pa.Schema | None:
    return None if table is None else _schema(table)


def _schema(table: DeltaTable) -> pa.Schema:
    return pa.schema(table.schema().to_arrow())


def _storable(field: pa.Field) -> pa.Field:
    """How a new column is stored: nullable (unless bookkeeping), durations as int64 microseconds marked
    in the field's metadata, so readers can give TIME back as a duration."""
    nullable = field.nullable or field.name not in META_COLUMNS
    if pa.types.is_duration(field.type):
        return pa.field(field.name, pa.int64(), nullable, metadata={STORED_AS: STORED_DURATION})
    return pa.field(field.name, field.type, nullable)


def _conform(data: pa.Table, target: pa.Schema | None) -> pa.Table:
    """`data` in the table's columns and types: absent columns null, new columns appended (for schema
    evolution). Values must fit the table's types exactly (see `_fit`)."""
    arrays: list[pa.ChunkedArray | pa.Array] = []
    fields: list[pa.Field] = []
    for field in target or ():
        present = field.name in data.column_names
        arrays.append(_fit(data[field.name], field) if present else pa.nulls(data.num_rows, field.type))
        fields.append(field)
    for field in data.schema:
        if target is None or field.name not in target.names:
            stored = _storable(field)
            arrays.append(data[field.name].cast(stored.type))
            fields.append(stored)
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _fit(values: pa.ChunkedArray, field: pa.Field) -> pa.ChunkedArray:
    """Cast to the column's Delta type; it must round-trip (delta-rs cannot widen a column after MODIFY)."""
    if values.type == field.type:
        return values
    try:
        fitted = values.cast(field.type)
        fits = fitted.cast(values.type).equals(values)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        fits = False
    if not fits:
        raise SinkError(
            f"column {field.name!r}: {values.type} values do not fit its Delta type {field.type} "
            "(a widening MODIFY COLUMN is kept at the old type while values fit)"
        )
    return fitted


def _castable(source: pa.DataType, target: pa.DataType) -> bool:
    try:
        pa.array([], source).cast(target)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False
    return True


def _quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"
