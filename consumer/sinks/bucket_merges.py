"""A bucketed mirror's MERGE split in groups of buckets, each group MERGEd on its own (a thread, or a Spark
task) and all of them committed as ONE Delta commit, so a reader never sees some buckets newer than others.

A group's part reads the mirror files of its buckets that may hold its keys (by their key statistics), as of
the version the MERGE read, applies the source with the MERGE's own rules (`NEWER`: a change older than the
row never wins; a delete removes; an insert only when not matched), writes the rewritten files' rows and its
new rows as Parquet files in the buckets' partition directories, and returns their add actions and the
rewritten files' remove actions. `commit_split` commits every part's actions with the whole MERGE's commit
properties, only if no other commit changed the files of the touched buckets (nor the schema) since the
version read, and without delta-rs rebasing it over a later commit (it does not know what the parts read):
otherwise it raises `CommitFailedError`, and the MERGE is retried from the start, like a conflicting MERGE.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction, RemoveAction

from consumer.batches.spool import read_spool_file, write_spool_file
from consumer.lakehouse.tables import BUCKET, SPLIT_PARTS

MAX_BUCKET_GROUPS = 8  # parts of one MERGE: more would cost more reads and tasks than they save
GROUPS_META = "ticdc.bucket_groups"  # a split MERGE's commit metadata: how many parts made it
SPLIT_METRICS = (  # the delta-rs MERGE metrics a split MERGE counts the same way
    "num_target_files_scanned",
    "num_target_files_removed",
    "num_target_files_added",
    "num_target_rows_copied",
    "num_target_rows_updated",
    "num_target_rows_inserted",
    "num_target_rows_deleted",
)


@dataclass(frozen=True)
class BucketPart:
    """One group of buckets' share of a MERGE: the mirror's directory (local), its files there that may hold
    the group's keys (path in the table, size, bucket), the group's source rows (a table, or an Arrow IPC
    spool file's path when the part runs elsewhere), the mirror's columns, its key and file size."""

    mirror: str
    files: tuple[tuple[str, int, int], ...]
    source: pa.Table | str
    schema: pa.Schema
    keys: tuple[str, ...]
    target_file_size: int


@dataclass(frozen=True)
class BucketOutcome:
    """What a part wrote, not committed: new files (path, size, modified ms, stats JSON, bucket), the files
    it rewrote (path, size, bucket), and its counts (`SPLIT_METRICS`)."""

    added: tuple[tuple[str, int, int, str, int], ...]
    removed: tuple[tuple[str, int, int], ...]
    metrics: dict[str, int]


@dataclass(frozen=True)
class Split:
    """A MERGE split in parts, prepared and not committed: the version it read, the touched buckets' files
    then and the schema (a commit changing either conflicts), the parts, and the commit's metadata and app
    transactions (app id, version: delta-rs's `Transaction` does not pickle)."""

    mirror: str
    version: int
    buckets: tuple[int, ...]
    files: frozenset[str]
    schema: str
    parts: tuple[BucketPart, ...]
    metadata: dict[str, str]
    transactions: tuple[tuple[str, int], ...]


def split_merge(
    mirror: DeltaTable,
    uri: str,
    source: pa.Table,
    keys: tuple[str, ...],
    properties: CommitProperties,
    target_file_size: int,
) -> Split:
    """`source` (one row per key, bucketed, with `_change_type`) in up to MAX_BUCKET_GROUPS parts of
    whole buckets, balanced by rows; each part names only the files its keys may be in."""
    actions = pa.table(mirror.get_add_actions(flatten=True))
    file_buckets = actions[f"partition.{BUCKET}"].cast(pa.int64())
    counts = source.group_by([BUCKET], use_threads=False).aggregate([([], "count_all")])
    order = np.argsort(-counts["count_all"].to_numpy(), kind="stable")
    buckets = counts[BUCKET].to_numpy()[order]
    groups: list[list[int]] = [[] for _ in range(min(len(buckets), MAX_BUCKET_GROUPS))]
    loads = np.zeros(len(groups), dtype=np.int64)
    for bucket, rows in zip(buckets, counts["count_all"].to_numpy()[order], strict=True):
        lightest = int(np.argmin(loads))
        groups[lightest].append(int(bucket))
        loads[lightest] += rows
    schema = pa.schema([f for f in source.schema if f.name not in (BUCKET, "_change_type")])
    parts = []
    for group in groups:
        rows = source.filter(pc.is_in(source[BUCKET], pa.array(group, pa.int64())))
        files = _files_for(actions.filter(pc.is_in(file_buckets, pa.array(group, pa.int64()))), rows, keys[0])
        parts.append(BucketPart(uri, files, rows, schema, keys, target_file_size))
    touched = pc.is_in(file_buckets, counts[BUCKET])
    offsets = tuple((t.app_id, t.version) for t in properties.app_transactions or ())
    metadata = dict(properties.custom_metadata or {}) | {GROUPS_META: str(len(parts))}
    return Split(
        uri,
        mirror.version(),
        tuple(sorted(int(b) for b in buckets)),
        frozenset(actions["path"].filter(touched).to_pylist()),
        mirror.schema().to_json(),
        tuple(parts),
        metadata,
        offsets,
    )


def _files_for(actions: pa.Table, source: pa.Table, key: str) -> tuple[tuple[str, int, int], ...]:
    """The files (of the source's buckets) whose key statistics allow one of the source's keys; all of
    them when the statistics do not tell."""
    low, high = f"min.{key}", f"max.{key}"
    wanted = np.ones(actions.num_rows, dtype=bool)
    kind = source.schema.field(key).type
    if {low, high} <= set(actions.column_names) and (pa.types.is_integer(kind) or pa.types.is_string(kind)):
        keys = np.sort(np.asarray(source[key].to_pylist(), dtype=object))
        for row, (lo, hi) in enumerate(zip(actions[low].to_pylist(), actions[high].to_pylist(), strict=True)):
            if lo is not None and hi is not None:
                wanted[row] = np.searchsorted(keys, hi, side="right") > np.searchsorted(keys, lo, side="left")
    picked = actions.filter(pa.array(wanted))
    return tuple(
        zip(
            picked["path"].to_pylist(),
            picked["size_bytes"].to_pylist(),
            picked[f"partition.{BUCKET}"].cast(pa.int64()).to_pylist(),
            strict=True,
        )
    )


def spooled(split: Split) -> Split:
    """`split` with each part's rows in an Arrow IPC file under the mirror's directory (`SPLIT_PARTS`,
    ignored by Delta readers), so a part sent to another process carries a path, not rows."""
    parts = []
    for part in split.parts:
        assert isinstance(part.source, pa.Table)
        path = f"{part.mirror}/{SPLIT_PARTS}/{uuid.uuid4()}.arrow"
        write_spool_file(path, part.source)
        parts.append(BucketPart(part.mirror, part.files, path, part.schema, part.keys, part.target_file_size))
    return dataclasses.replace(split, parts=tuple(parts))


def remove_spooled(split: Split) -> None:
    """Delete the parts' spool files (`spooled`), once their outcomes are committed or abandoned."""
    for part in split.parts:
        if isinstance(part.source, str):
            filesystem, path = pafs.FileSystem.from_uri(part.source)
            filesystem.delete_file(path)


def merge_bucket_part(part: BucketPart) -> BucketOutcome:
    """MERGE a part's source rows into its files' rows, with the MERGE's rules; write the changed buckets'
    rows (the rewritten files' and the new ones) as new files, returning their actions uncommitted."""
    source = part.source if isinstance(part.source, pa.Table) else read_spool_file(part.source)
    filesystem, directory = pafs.FileSystem.from_uri(part.mirror)
    target = _read_files(filesystem, directory, part.files, part.schema)
    keys = list(part.keys)
    probe = target.select([*keys, "_commit_ts"]).append_column("_t", _row_numbers(target))
    changes = source.select([*keys, "_commit_ts", "_change_type"]).rename_columns([*keys, "_s_ts", "_type"])
    matched = probe.join(changes.append_column("_s", _row_numbers(source)), keys, use_threads=False)
    newer = pc.or_(pc.greater_equal(matched["_s_ts"], matched["_commit_ts"]), pc.equal(matched["_s_ts"], 0))
    applied = matched.filter(newer)
    updated = applied["_s"].filter(pc.not_equal(applied["_type"], "delete"))
    unmatched = pc.invert(pc.is_in(_row_numbers(source), matched["_s"]))
    inserted = pc.and_(unmatched, pc.not_equal(source["_change_type"], "delete"))
    replaced = np.zeros(target.num_rows, dtype=bool)
    replaced[applied["_t"].to_numpy()] = True
    rewritten = pc.unique(target["_file"].filter(pa.array(replaced)))
    kept = target.filter(pc.and_(pc.is_in(target["_file"], rewritten), pa.array(~replaced)))
    columns = [*part.schema.names, BUCKET]
    written = pa.concat_tables([kept.select(columns), source.take(updated).select(columns)])
    added = _write(
        filesystem, directory, pa.concat_tables([written, source.filter(inserted).select(columns)]), part
    )
    removed = tuple(part.files[index] for index in rewritten.to_pylist())
    metrics = {
        "num_target_files_scanned": len(part.files),
        "num_target_files_removed": len(removed),
        "num_target_files_added": len(added),
        "num_target_rows_copied": kept.num_rows,
        "num_target_rows_updated": len(updated),
        "num_target_rows_inserted": pc.sum(inserted).as_py() or 0,
        "num_target_rows_deleted": len(applied) - len(updated),
    }
    return BucketOutcome(tuple(added), removed, metrics)


def _row_numbers(table: pa.Table) -> pa.Array:
    return pa.array(np.arange(table.num_rows, dtype=np.int64))


def _read_files(
    filesystem: pafs.FileSystem, directory: str, files: Sequence[tuple[str, int, int]], schema: pa.Schema
) -> pa.Table:
    """The files' rows in the mirror's columns (those older files lack: null), their bucket, and which
    file each came from (`_file`: its index in `files`)."""
    import pyarrow.dataset as pads  # with the pandas it imports, 0.1 s a process: only MERGEs pay it

    tables = []
    for index, (path, _, bucket) in enumerate(files):
        rows = pads.dataset(f"{directory}/{path}", schema=schema, format="parquet", filesystem=filesystem)
        data = rows.to_table()
        data = data.append_column(BUCKET, pa.array(np.full(data.num_rows, bucket), pa.int64()))
        tables.append(data.append_column("_file", pa.array(np.full(data.num_rows, index), pa.int64())))
    if tables:
        return pa.concat_tables(tables)
    empty = schema.append(pa.field(BUCKET, pa.int64())).append(pa.field("_file", pa.int64()))
    return empty.empty_table()


def _write(
    filesystem: pafs.FileSystem, directory: str, rows: pa.Table, part: BucketPart
) -> list[tuple[str, int, int, str, int]]:
    """`rows` per bucket, sorted by the first key (tight key statistics for later MERGEs' pruning), in files
    of about the mirror's target size."""
    added = []
    for bucket in pc.unique(rows[BUCKET]).to_pylist():
        data = rows.filter(pc.equal(rows[BUCKET], bucket)).drop_columns([BUCKET])
        data = data.sort_by(part.keys[0])
        per_file = max(1, part.target_file_size * data.num_rows // max(data.nbytes, 1))
        for start in range(0, data.num_rows, per_file):
            chunk = data.slice(start, per_file)
            name = f"{BUCKET}={bucket}/part-00000-{uuid.uuid4()}-c000.snappy.parquet"
            path = f"{directory}/{name}"
            filesystem.create_dir(path.rpartition("/")[0], recursive=True)
            pq.write_table(chunk, path, filesystem=filesystem, compression="snappy")
            size = filesystem.get_file_info(path).size
            stats = file_stats(chunk, [*part.keys, "_commit_ts", "_schema_version"])
            added.append((name, size, int(time.time() * 1000), stats, bucket))
    return added


def file_stats(data: pa.Table, columns: Sequence[str]) -> str:
    """A new file's Delta stats: its rows, and the bounds of `columns` (those of integer or string type;
    others have none, which readers take as unknown)."""
    low, high, nulls = {}, {}, {}
    for name in columns:
        kind = data.schema.field(name).type
        if not (pa.types.is_integer(kind) or pa.types.is_string(kind)):
            continue
        bounds = pc.min_max(data[name])
        low[name], high[name] = bounds["min"].as_py(), bounds["max"].as_py()
        nulls[name] = data[name].null_count
    return json.dumps({"numRecords": data.num_rows, "minValues": low, "maxValues": high, "nullCount": nulls})


def commit_split(mirror: DeltaTable, split: Split, outcomes: Sequence[BucketOutcome]) -> None:
    """Commit every part's files at once with the MERGE's properties (`mirror`: the table's latest version).
    Raises CommitFailedError when another commit changed the touched buckets' files or the schema since
    the split's version, or lands before this one (delta-rs would rebase over it unchecked). Commits
    nothing when no part changed a file, as a delta-rs MERGE does."""
    actions = pa.table(mirror.get_add_actions(flatten=True))
    touched = pc.is_in(actions[f"partition.{BUCKET}"].cast(pa.int64()), pa.array(split.buckets, pa.int64()))
    if frozenset(actions["path"].filter(touched).to_pylist()) != split.files or (
        mirror.schema().to_json() != split.schema
    ):
        raise CommitFailedError(f"{split.mirror}: a commit after version {split.version} changed its buckets")
    now = int(time.time() * 1000)
    changes: list[AddAction | RemoveAction] = []
    for outcome in outcomes:
        changes += [AddAction(p, s, {BUCKET: str(b)}, m, True, st) for p, s, m, st, b in outcome.added]
        changes += [RemoveAction(p, True, now, s, {BUCKET: str(b)}) for p, s, b in outcome.removed]
    if not changes:  # as delta-rs commits no MERGE that changed nothing (its app transactions neither)
        return
    properties = CommitProperties(
        custom_metadata=split.metadata,
        app_transactions=[Transaction(app, version) for app, version in split.transactions] or None,
        max_commit_retries=0,
    )
    mirror.create_write_transaction(
        changes, mode="append", schema=mirror.schema(), partition_by=[BUCKET], commit_properties=properties
    )


def split_metrics(outcomes: Sequence[BucketOutcome]) -> dict[str, int]:
    """The parts' counts summed, as one delta-rs MERGE's metrics."""
    return {name: sum(outcome.metrics[name] for outcome in outcomes) for name in SPLIT_METRICS}
