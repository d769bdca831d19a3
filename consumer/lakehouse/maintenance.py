"""Keeping a lakehouse fast: compaction (or clustering by key), the deletes side tables purged below the
consistent point, VACUUM with a safe retention, checkpoints and log cleanup (`ticdc-consumer maintain`).

Safe beside running consumers: every step is a Delta commit or a deletion of files no snapshot within the
retention references; a step that collides with a writer's commit is retried (the writer retries too).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer.errors import SinkError
from consumer.lakehouse.catalog import CATALOG, CatalogEntry
from consumer.lakehouse.ddl import DDL_LOG
from consumer.lakehouse.offsets import app_id
from consumer.lakehouse.progress import PROGRESS, SCHEMAS, ProgressLog, consistent_ts
from consumer.lakehouse.storage import LakeRoot, retry_commits
from consumer.lakehouse.tables import (
    BASES_PROPERTY,
    KEY_PROPERTY,
    KINDS,
    KNOWN_PROPERTY,
    READABLE_FROM,
    RETAINED_AFTER,
    SPLIT_PARTS,
    RootLike,
    entry_uri,
    mirror_versions,
    recorded_bases,
    retained_range,
    tables,
)
from consumer.protocol.model import TSO_PHYSICAL_SHIFT

log = logging.getLogger(__name__)

DEFAULT_RETENTION_HOURS = 168  # Delta's default: readers and writers of older snapshots keep their files
DEFAULT_AS_OF_RETENTION_HOURS = 168.0  # as-of reads answer at least this far back (7 days)
VACUUM_MARGIN_HOURS = 1  # beyond the as-of retention, for a TSO's clock against the store's commit times
DEFAULT_TARGET_FILE_SIZE = 128 * 1024 * 1024  # compaction target where the table sets none
KEEP_BASES = 16  # mirror versions whose holdings maintain found, recorded on the mirror (the newest)


@dataclass
class TableMaintenance:
    """What maintenance did to one Delta table."""

    uri: str
    files_before: int
    files_after: int = 0
    files_rewritten: int = 0
    clustered: bool = False
    deletes_purged: int = 0
    changes_removed: int = 0  # changelog rows older than the as-of retention needs
    files_vacuumed: int = 0
    error: str | None = None


@dataclass
class MaintenanceReport:
    consistent_ts: int | None
    as_of_from: int | None = None  # the oldest TSO the lakehouse answers as of afterwards (`retained_range`)
    tables: list[TableMaintenance] = field(default_factory=list)
    seconds: float = 0.0


def maintain(
    root: RootLike,
    storage_options: Mapping[str, str] | None = None,
    *,
    cluster: bool = False,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    vacuum: bool = True,
    as_of_retention_hours: float | None = DEFAULT_AS_OF_RETENTION_HOURS,
    now: float | None = None,
) -> MaintenanceReport:
    """Maintain every Delta table under `root`: the catalog's tables and the lakehouse's own.

    - mirrors are compacted to their target file size, or with `cluster` rewritten sorted by their key
      (Z-order on it): each file then holds one key range, so a MERGE reads and rewrites only the few
      files of the keys it changes; changelogs and the root tables are compacted;
    - a `deletes` side table loses the keys deleted before the consistent point (every change older than
      it is applied everywhere: no lagging member can still bring them back);
    - VACUUM deletes files removed more than `retention_hours` ago (never less than Delta's own
      `delta.deletedFileRetentionDuration`), then a checkpoint is written and expired log entries go;
    - as-of retention (`as_of_retention_hours`, None: keep everything): as-of reads stay exact for every
      TSO from `now` minus the retention on (or from the consistent point, when older: nothing is
      removed without watermarks). Per table with a mirror and a changelog, the newest mirror
      version holding no change after that horizon (and readable) becomes the base of the oldest reads
      (what it holds: what its commits claim, or where they claim less, e.g. a short run whose commits all
      came before its first progress record, what its app transactions say it applied of the changelog,
      recorded on the mirror as `ticdc.mirror.bases`, `_holds_up_to`):
      the changelog's changes it holds (commit ts <= its `complete_ts`) are deleted, the changelog records
      so (`ticdc.changelog.retained_after`) and the oldest TSO the table answers as of (the version's
      `newest_ts`, `ticdc.asof.readable_from`). VACUUM keeps a mirror's files removed within the retention
      (+1 h), so every version a read within it takes stays readable; the mirror records what it holds
      (`ticdc.mirror.known`) before its log is cleaned. Reads older than that raise `AsOfRetentionError`.
    A table another process keeps changing is skipped with its error, not failed.
    """
    started = time.monotonic()
    lake = LakeRoot.of(root, storage_options)
    report = MaintenanceReport(consistent_ts(lake))
    now = time.time() if now is None else now
    removed: dict[str, int] = {}
    if as_of_retention_hours is not None:
        horizon = int((now - as_of_retention_hours * 3600) * 1000) << TSO_PHYSICAL_SHIFT
        horizon = min(horizon, report.consistent_ts or 0)  # the consistent point stays readable
        for entry in tables(lake):
            try:
                removed[entry_uri(lake, entry, "changelog")] = _retain(lake, entry, horizon)
            except (DeltaError, OSError, SinkError) as exc:
                log.warning("as-of retention of %s stopped: %s", entry.location, exc)
        keep = math.ceil(as_of_retention_hours) + VACUUM_MARGIN_HOURS
    uris = [entry_uri(lake, entry, kind) for entry in tables(lake) for kind in KINDS]
    uris += [lake.join(name) for name in (CATALOG, DDL_LOG, PROGRESS, SCHEMAS)]
    for uri in uris:
        table = lake.open(uri)
        if table is None:
            continue
        done = TableMaintenance(uri, len(table.file_uris()), changes_removed=removed.get(uri, 0))
        hours = retention_hours
        if as_of_retention_hours is not None and uri.endswith("/mirror"):
            hours = max(hours, keep)
        try:
            _maintain(lake, table, done, report.consistent_ts, cluster, hours, vacuum)
            if vacuum and uri.endswith("/mirror"):
                done.files_vacuumed += _stale_parts(lake, uri, now - max(hours, 1) * 3600)
        except (DeltaError, OSError, SinkError) as exc:
            done.error = str(exc)
            log.warning("maintenance of %s stopped: %s", uri, exc)
        report.tables.append(done)
    report.as_of_from = retained_range(lake)[0]
    report.seconds = time.monotonic() - started
    return report


def _retain(lake: LakeRoot, entry: CatalogEntry, horizon: int) -> int:
    """Delete the changelog rows of `entry` that as-of reads from `horizon` on no longer need; how many."""
    mirror = lake.open(entry_uri(lake, entry, "mirror"))
    changelog_uri = entry_uri(lake, entry, "changelog")
    changelog = lake.open(changelog_uri)
    if mirror is None or changelog is None:
        return 0
    versions = mirror_versions(mirror)
    if versions and versions[-1].newest_ts is not None:
        latest = versions[-1]
        known = f"{latest.version}:{latest.complete_ts}:{latest.newest_ts}"
        if mirror.metadata().configuration.get(KNOWN_PROPERTY) != known:
            retry_commits(
                f"recording {mirror.table_uri}",
                lambda: lake.existing(mirror.table_uri).alter.set_table_properties(
                    {KNOWN_PROPERTY: known}, raise_if_not_exists=False
                ),
            )
    older = [v for v in versions if v.newest_ts is not None and v.newest_ts <= horizon]
    if older and older[-1].complete_ts < horizon:  # what the version holds may be more than it claimed
        found = _holds_up_to(lake, mirror, older[-1].version, changelog, horizon)
        if found > older[-1].complete_ts:
            bases_found = {**recorded_bases(mirror), older[-1].version: found}
            newest_found = ",".join(f"{v}:{c}" for v, c in sorted(bases_found.items())[-KEEP_BASES:])
            retry_commits(
                f"recording {mirror.table_uri}",
                lambda: lake.existing(mirror.table_uri).alter.set_table_properties(
                    {BASES_PROPERTY: newest_found}, raise_if_not_exists=False
                ),
            )
            versions = mirror_versions(lake.existing(mirror.table_uri))
    bases = [v for v in versions if v.newest_ts is not None and v.newest_ts <= horizon and v.complete_ts > 0]
    retained = int(changelog.metadata().configuration.get(RETAINED_AFTER, -1))
    if not bases or bases[-1].complete_ts <= retained:
        return 0
    base = bases[-1]
    try:  # the base must be readable: the oldest reads start from it
        kept = DeltaTable(mirror.table_uri, version=base.version, storage_options=lake.options())
        lake.scan(kept).count_rows()  # reads every file's footer: a file vacuumed away fails
    except (DeltaError, OSError):
        return 0
    properties = {RETAINED_AFTER: str(base.complete_ts), READABLE_FROM: str(base.newest_ts)}
    retry_commits(
        f"as-of retention {changelog_uri}",
        lambda: lake.existing(changelog_uri).alter.set_table_properties(
            properties, raise_if_not_exists=False
        ),
    )

    def delete() -> int:
        table = lake.existing(changelog_uri)
        return int(table.delete(f"_commit_ts <= {base.complete_ts}").get("num_deleted_rows") or 0)

    return retry_commits(f"as-of retention {changelog_uri}", delete)


def _holds_up_to(lake: LakeRoot, mirror: DeltaTable, version: int, changelog: DeltaTable, point: int) -> int:
    """A TSO, at most `point` (which every change up to is in the changelog by), that mirror `version`
    holds every change up to: per partition, the version's app transactions say which offsets it applied,
    so it holds every change before the oldest changelog row it lacks. 0 when that row's commit ts is
    unknown, or the version's log entry is gone."""
    columns = ["_topic", "_partition", "_offset", "_commit_ts"]  # rows after `point` cannot lower it
    rows = lake.scan(changelog).to_table(columns=columns, filter=pc.field("_commit_ts") <= point)
    try:
        then = DeltaTable(mirror.table_uri, version=version, storage_options=lake.options())
    except (DeltaError, OSError):  # its log entry cleaned up: nothing to say
        return 0
    groups = ProgressLog(lake).groups()
    complete = point
    starts = rows.group_by(["_topic", "_partition"], use_threads=False).aggregate([])
    for topic, partition in zip(starts["_topic"].to_pylist(), starts["_partition"].to_pylist(), strict=True):
        held = max((then.transaction_version(app_id(g, topic, partition)) or 0 for g in groups), default=0)
        mine = pc.and_(pc.equal(rows["_topic"], topic), pc.equal(rows["_partition"], partition))
        lacking = rows["_commit_ts"].filter(pc.and_(mine, pc.greater_equal(rows["_offset"], held)))
        if len(lacking):
            oldest = pc.min(lacking).as_py()
            if oldest <= 0:
                return 0
            complete = min(complete, oldest - 1)
    return complete


def _maintain(
    lake: LakeRoot,
    table: DeltaTable,
    done: TableMaintenance,
    point: int | None,
    cluster: bool,
    retention_hours: int,
    vacuum: bool,
) -> None:
    kind = done.uri.rsplit("/", 1)[-1]
    if kind == "deletes" and point is not None:
        done.deletes_purged = _purged(lake, done.uri, point)
    key = table.metadata().configuration.get(KEY_PROPERTY, "")
    done.clustered = cluster and kind == "mirror" and bool(key)

    def rewrite() -> int:
        current = lake.existing(done.uri)
        configured = current.metadata().configuration.get("delta.targetFileSize")
        target = int(configured or DEFAULT_TARGET_FILE_SIZE)
        if done.clustered:
            metrics = current.optimize.z_order([key.split(",")[0]], target_size=target)
        else:
            metrics = current.optimize.compact(target_size=target)
        return int(metrics.get("numFilesRemoved") or 0)

    done.files_rewritten = retry_commits(f"maintenance {done.uri}", rewrite)
    if vacuum:  # a changelog's in full: files the Spark engine's tasks wrote that no commit added go too
        full = kind == "changelog"
        done.files_vacuumed = len(table.vacuum(retention_hours=retention_hours, dry_run=False, full=full))
    table.create_checkpoint()
    table.cleanup_metadata()
    current = lake.open(done.uri)
    done.files_after = len(current.file_uris()) if current is not None else 0


def _stale_parts(lake: LakeRoot, uri: str, before: float) -> int:
    """Delete the split-MERGE group files (`SPLIT_PARTS`) under a mirror written before `before` (epoch
    seconds): a driver that died between its groups and its commit left them (a live MERGE's are minutes
    old at most). Delta's VACUUM skips them: the directory's name starts with `_`."""
    filesystem, base = lake.filesystem()
    selector = pafs.FileSelector(base + f"{uri}/{SPLIT_PARTS}".removeprefix(lake.uri), allow_not_found=True)
    stale = [
        info.path
        for info in filesystem.get_file_info(selector)
        if info.is_file and info.mtime is not None and info.mtime.timestamp() < before
    ]
    for path in stale:
        filesystem.delete_file(path)
    return len(stale)


def _purged(lake: LakeRoot, uri: str, point: int) -> int:
    def purge() -> int:
        table = lake.existing(uri)
        return int(table.delete(f"_commit_ts < {point}").get("num_deleted_rows") or 0)

    return retry_commits(f"purging {uri}", purge)
