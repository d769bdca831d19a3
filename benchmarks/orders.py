"""The `shop.orders` table the MERGE and as-of benchmarks (`merge.py`, `asof.py`) build and change: its
schema, the TSO its mirror is built at, the mirror's stored columns, its random values and change batches.

Not run on its own; the scripts import it as `orders` (run from anywhere: Python puts a script's folder
first on `sys.path`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import CommitProperties

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from consumer.batches.changes import TableChanges, changelog_schema, stored_schema
from consumer.lakehouse.tables import COMPLETE_TS, NEWEST_TS
from consumer.protocol.model import TSO_PHYSICAL_SHIFT, Column, DataType, Index, TableSchema
from consumer.protocol.table import TableCodec

SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=1,
    version=1,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("name", DataType("varchar", "utf8mb4", "utf8mb4_bin", length=32)),
        Column("qty", DataType("bigint", length=20)),
        Column("price", DataType("double", length=22)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
BASE_TS = 1_700_000_000_000 << TSO_PHYSICAL_SHIFT  # the TSO the benchmarks' mirrors are built at


def mirror_schema() -> pa.Schema:
    """The mirror's columns as the Delta sink stores them: the key not null, the other user columns
    nullable, then `_commit_ts` and `_schema_version`."""
    user = stored_schema(TableCodec(SCHEMA))
    fields = [f.with_nullable(True) if f.name != "id" else f for f in user]
    meta = [pa.field("_commit_ts", pa.int64(), False), pa.field("_schema_version", pa.int64(), False)]
    return pa.schema([*fields, *meta])


def base_marks() -> CommitProperties:
    """A built mirror's commit metadata, as a mirror commit says which changes it holds: every change up to
    BASE_TS and none after (the as-of and fresh reads use it)."""
    return CommitProperties(custom_metadata={COMPLETE_TS: str(BASE_TS), NEWEST_TS: str(BASE_TS)})


def base_columns(rng: np.random.Generator, keys: np.ndarray) -> list[pa.Array | np.ndarray]:
    """The mirror's rows of `keys` as of BASE_TS, in `mirror_schema()`'s columns."""
    return [*values(rng, keys), np.full(len(keys), BASE_TS), np.full(len(keys), 1)]


def values(rng: np.random.Generator, keys: np.ndarray) -> list[pa.Array]:
    """The user columns of rows with `keys`: a name from the key, a random quantity and price."""
    return [
        pa.array(keys, pa.int64()),
        pa.array([f"order-{k}" for k in keys.tolist()], pa.string()),
        pa.array(rng.integers(0, 1000, len(keys)), pa.int64()),
        pa.array(rng.random(len(keys)), pa.float64()),
    ]


def random_changes(
    rng: np.random.Generator, low: int, top: int, changes: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """`changes` changes in random order: 90% updates and 5% deletes of keys in [low, top), 5% inserts of
    new keys from `top` on. Returns their keys, their change types and the new top."""
    inserts = changes // 20
    existing = rng.integers(low, top, changes - inserts)
    new = np.arange(top, top + inserts)
    keys = np.concatenate([existing, new])
    kinds = np.array(["update_postimage"] * len(existing) + ["insert"] * inserts, dtype=object)
    kinds[: len(existing)][rng.random(len(existing)) < 0.05 / 0.95] = "delete"
    order = rng.permutation(len(keys))
    return keys[order], kinds[order], top + inserts


def change_batch(
    rng: np.random.Generator,
    keys: np.ndarray,
    kinds: np.ndarray,
    topic: str,
    offsets: np.ndarray,
    commit_ts: np.ndarray,
) -> TableChanges:
    """The changes as the sink gets them: one commit ts each, in offset order on partition 0 of `topic`."""
    count = len(keys)
    meta = [
        pa.array(kinds.tolist(), pa.string()),
        pa.array(commit_ts, pa.int64()),
        pa.array((commit_ts >> TSO_PHYSICAL_SHIFT) * 1000, pa.timestamp("us", tz="UTC")),
        pa.array(np.full(count, 1), pa.int64()),
        pa.array([topic] * count, pa.string()),
        pa.array(np.zeros(count), pa.int32()),
        pa.array(offsets, pa.int64()),
    ]
    schema = changelog_schema(TableCodec(SCHEMA))
    return TableChanges(SCHEMA, pa.Table.from_arrays([*values(rng, keys), *meta], schema=schema))
