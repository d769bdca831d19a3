"""Keeping a lakehouse fast: compaction (or clustering by key), the deletes side tables purged below the
consistent point, VACUUM with a safe retention, checkpoints and log cleanup (`ticdc-consumer maintain`).

Safe beside running consumers: every step is a Delta commit or a deletion of files no snapshot within the
retention references; a step that collides with a writer's commit is retried (the writer retries too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from deltalake import DeltaTable
from deltalake.exceptions import DeltaError

from consumer.errors import SinkError
from consumer.lakehouse.catalog import CATALOG
from consumer.lakehouse.ddl import DDL_LOG
from consumer.lakehouse.progress import PROGRESS, SCHEMAS, consistent_ts
from consumer.lakehouse.storage import LakeRoot, retry_commits
from consumer.lakehouse.tables import KEY_PROPERTY, KINDS, RootLike, entry_uri, tables

log = logging.getLogger(__name__)

DEFAULT_RETENTION_HOURS = 168  # Delta's default: readers and writers of older snapshots keep their files
DEFAULT_TARGET_FILE_SIZE = 128 * 1024 * 1024  # compaction target where the table sets none


@dataclass
class TableMaintenance:
    """What maintenance did to one Delta table."""

    uri: str
    files_before: int
    files_after: int = 0
    files_rewritten: int = 0
    clustered: bool = False
    deletes_purged: int = 0
    files_vacuumed: int = 0
    error: str | None = None


@dataclass
class MaintenanceReport:
    consistent_ts: int | None
    tables: list[TableMaintenance] = field(default_factory=list)
    seconds: float = 0.0


def maintain(
    root: RootLike,
    storage_options: Mapping[str, str] | None = None,
    *,
    cluster: bool = False,
    retention_hours: int = DEFAULT_RETENTION_HOURS,
    vacuum: bool = True,
) -> MaintenanceReport:
    """Maintain every Delta table under `root`: the catalog's tables and the lakehouse's own.

    - mirrors are compacted to their target file size, or with `cluster` rewritten sorted by their key
      (Z-order on it): each file then holds one key range, so a MERGE reads and rewrites only the few
      files of the keys it changes; changelogs and the root tables are compacted;
    - a `deletes` side table loses the keys deleted before the consistent point (every change older than
      it is applied everywhere: no lagging member can still bring them back);
    - VACUUM deletes files removed more than `retention_hours` ago (never less than Delta's own
      `delta.deletedFileRetentionDuration`), then a checkpoint is written and expired log entries go.
    A table another process keeps changing is skipped with its error, not failed.
    """
    started = time.monotonic()
    lake = LakeRoot.of(root, storage_options)
    report = MaintenanceReport(consistent_ts(lake))
    uris = [entry_uri(lake, entry, kind) for entry in tables(lake) for kind in KINDS]
    uris += [lake.join(name) for name in (CATALOG, DDL_LOG, PROGRESS, SCHEMAS)]
    for uri in uris:
        table = lake.open(uri)
        if table is None:
            continue
        done = TableMaintenance(uri, len(table.file_uris()))
        try:
            _maintain(lake, table, done, report.consistent_ts, cluster, retention_hours, vacuum)
        except (DeltaError, OSError, SinkError) as exc:
            done.error = str(exc)
            log.warning("maintenance of %s stopped: %s", uri, exc)
        report.tables.append(done)
    report.seconds = time.monotonic() - started
    return report


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
    if vacuum:
        done.files_vacuumed = len(table.vacuum(retention_hours=retention_hours, dry_run=False))
    table.create_checkpoint()
    table.cleanup_metadata()
    current = lake.open(done.uri)
    done.files_after = len(current.file_uris()) if current is not None else 0


def _purged(lake: LakeRoot, uri: str, point: int) -> int:
    def purge() -> int:
        table = lake.existing(uri)
        return int(table.delete(f"_commit_ts < {point}").get("num_deleted_rows") or 0)

    return retry_commits(f"purging {uri}", purge)
