"""What the Delta and Parquet sinks share: a lakehouse root with its catalog, DDL log and progress records.

Both find a table's directory through the catalog (`consumer.lakehouse.catalog`), apply CREATE, RENAME,
TRUNCATE and DROP as catalog commits, skip a DDL the `_ddl` log already holds, and keep the pipeline's
progress in `_progress` / `_schemas`; they differ in how rows are stored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import pyarrow as pa

from consumer.batches.changes import SpooledChanges, TableChanges, stored_name, stored_schema
from consumer.lakehouse.catalog import Catalog, CatalogEntry, Name
from consumer.lakehouse.ddl import DDLLog, renamed_from
from consumer.lakehouse.progress import ProgressLog
from consumer.lakehouse.storage import LakeRoot, check_atomic_commits
from consumer.lakehouse.tables import KEY_PROPERTY
from consumer.protocol.model import DDL, DDLType
from consumer.protocol.table import TableCodec
from consumer.sinks.base import CommitContext, DDLEvent
from consumer.sources.record import TopicPartition


class LakehouseSink:
    """The shared half of a lakehouse sink; subclasses store rows and may add DDL effects
    (`_apply_to_table`)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        storage_options: Mapping[str, str] | None = None,
        *,
        allow_unsafe_commits: bool = False,
    ) -> None:
        self.root = LakeRoot.of(root, storage_options)
        check_atomic_commits(self.root, allow_unsafe=allow_unsafe_commits)
        self.catalog = Catalog(self.root)
        self.ddl_log = DDLLog(self.root)
        self.progress = ProgressLog(self.root)
        self._resent: dict[TopicPartition, int] = {}  # records skipped as re-sent since this sink was made
        self._resent_before: dict[str, dict[TopicPartition, int]] = {}  # per group: what the lake counted

    def apply_ddl(self, event: DDLEvent, context: CommitContext) -> None:
        """Apply the DDL's effect, then append it to `<root>/_ddl`; a DDL already there is skipped whole
        (a replay, or another member applied it)."""
        ddl, database, table = event.ddl, event.database, event.table
        if self.ddl_log.applied(ddl, database, table):
            self.catalog.refresh()  # another member applied it: its catalog changes are news here
            return
        if database is not None and table is not None:
            self._apply_to_table(ddl, (database, table), context)
        self.ddl_log.record(ddl, database, table, commit_metadata(context), _columns(ddl))

    def _apply_to_table(self, ddl: DDL, name: Name, context: CommitContext) -> CatalogEntry | None:
        """The catalog's part of a DDL on a table; returns the table a TRUNCATE or DROP emptied.

        - CREATE: a new table (a new location when a dropped table had the name).
        - RENAME: the table holds the new name from the DDL's commit ts; nothing moves, and rows of the old
          name older than the RENAME (a lagging member's) still find the table.
        - TRUNCATE / ERASE (DROP TABLE): `truncated_ts` / `dropped_ts`; later rows of the name go to a new
          table, older ones to this one.
        """
        if ddl.type is DDLType.CREATE:
            self.catalog.create(name, ddl.commit_ts)
        elif ddl.type is DDLType.RENAME:
            self.catalog.rename(renamed_from(ddl, *name), name, ddl.commit_ts)
        elif ddl.type is DDLType.TRUNCATE:
            return self.catalog.truncate(name, ddl.commit_ts)
        elif ddl.type is DDLType.ERASE:
            return self.catalog.drop(name, ddl.commit_ts)
        return None

    def _located(self, changes: TableChanges) -> list[tuple[CatalogEntry, TableChanges]]:
        """The batch's rows by the table that held their name at their commit ts: one table, but for changes
        TiCDC sent again after a DROP, TRUNCATE or RENAME (rows of a table the name no longer names). A row
        whose commit ts no table held the name at goes with the newest."""
        name = (changes.database, changes.table)
        entry = self.catalog.locate(name, changes.newest_commit_ts)
        stamps = _commit_ts(changes)
        known = stamps[stamps != 0]  # 0: unknown (an Avro tombstone), after the rows before it: the newest's
        oldest = self.catalog.find(name, int(known.min())) if len(known) else None
        if oldest is None or oldest.location == entry.location:
            return [(entry, changes)]
        rows = changes.changelog  # spooled rows are read here: a rare batch
        ts = rows["_commit_ts"].to_numpy()
        places: dict[str, tuple[CatalogEntry, list[int]]] = {}
        for stamp in np.unique(ts).tolist():
            found = (self.catalog.find(name, stamp) if stamp else None) or entry
            places.setdefault(found.location, (found, []))[1].append(stamp)
        return [
            (found, TableChanges(changes.schema, rows.filter(pa.array(np.isin(ts, stamps)))))
            for found, stamps in places.values()
        ]

    def _skipped(self, resent: Mapping[TopicPartition, int]) -> int:
        """Count records skipped as re-sent (for the progress records); returns how many."""
        for tp, count in resent.items():
            self._resent[tp] = self._resent.get(tp, 0) + count
        return sum(resent.values())

    def _wrote(self, entry: CatalogEntry) -> None:
        """After a write to the table's location: its first makes it ready in the catalog."""
        if not entry.ready:
            self.catalog.mark_ready(entry)

    def recorded_offsets(self, group: str) -> dict[TopicPartition, int]:
        """Per partition, the furthest resume offset any member of the group recorded (`record_progress`).
        Called when partitions are assigned: the catalog is re-read too, since other members may have
        changed it past this member's position."""
        self.catalog.refresh()
        return {tp: p.resume_offset for tp, p in self.progress.partitions(group).items()}

    def recorded_watermarks(self, group: str) -> dict[TopicPartition, int]:
        """Per partition, a commit ts every change of it up to which is applied."""
        return {tp: p.applied_ts for tp, p in self.progress.partitions(group).items() if p.applied_ts}

    def recorded_schema_snapshot(self) -> bytes | None:
        return self.progress.schema_snapshot()

    def record_progress(self, context: CommitContext) -> None:
        """Append the pipeline's progress to `_progress` (and its schema snapshot to `_schemas` when the
        context carries one)."""
        before = self._resent_before.get(context.group)
        if before is None:  # what earlier runs counted: this sink's counts go on from there
            recorded = self.progress.partitions(context.group)
            before = self._resent_before[context.group] = {tp: p.resent for tp, p in recorded.items()}
        resent = {tp: before.get(tp, 0) + self._resent.get(tp, 0) for tp in context.resume_offsets}
        self.progress.record(
            context.group,
            context.resume_offsets,
            context.applied_ts,
            context.schema_snapshot or None,
            context.stopped,
            context.topic_partitions,
            resent,
        )

    def close(self) -> None:
        return None


def _commit_ts(changes: TableChanges) -> np.ndarray:
    """The batch's rows' commit ts (of a spooled batch, from its index: no rows read)."""
    if isinstance(changes, SpooledChanges):
        return np.concatenate([block.commit_ts for block in changes.blocks])
    return changes.changelog["_commit_ts"].to_numpy()


def _columns(ddl: DDL) -> pa.Schema | None:
    """The stored columns the DDL leaves its table with, its key in the metadata (readers of a table
    whose mirror has no commit yet need it); None when the DDL names no columns (TiCDC Avro's DDLs)."""
    schema = ddl.table_schema
    if schema is None or not schema.columns:
        return None
    key = ",".join(stored_name(name) for name in schema.handle_key())
    return stored_schema(TableCodec(schema)).with_metadata({KEY_PROPERTY: key} if key else {})


def commit_metadata(context: CommitContext) -> dict[str, str]:
    """The `ticdc.*` commit metadata every commit of a lakehouse sink carries."""
    return {"ticdc.group": context.group, "ticdc.resolved_ts": str(context.resolved_ts)}
