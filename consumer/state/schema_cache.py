"""Table schemas by (database, table, version), shared by every partition and topic.

The reference consumer keeps one memo per partition, so with `send-bootstrap-to-all-partition=false`
partitions other than 0 never learn a schema (its weakness 7), and the memo grows without bound (12).
Here one bounded cache serves all partitions; versions still needed by buffered or unconfirmed rows are
pinned, so eviction can never strand a row whose schema was already announced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import msgspec
from cachetools import LRUCache

from consumer.protocol.model import TableSchema
from consumer.state.units import SchemaKey

DEFAULT_MAXSIZE = 10_000
_VersionId = tuple[int, int]  # (table_id, version)


class _EvictionNotifyingLRU(LRUCache):
    """cachetools' documented hook: `popitem` is what evicts, so the secondary index follows it here."""

    def __init__(self, maxsize: int, on_evict: Callable[[SchemaKey, TableSchema], None]) -> None:
        super().__init__(maxsize)
        self._on_evict = on_evict

    def popitem(self) -> tuple[SchemaKey, TableSchema]:
        key, schema = super().popitem()
        self._on_evict(key, schema)
        return key, schema


class SchemaCache:
    """Bounded LRU of unpinned schemas plus an unbounded set of pinned ones.

    `maxsize` bounds the unpinned entries; a pinned entry lives outside the LRU until its last pin goes,
    so it cannot be evicted. Pins are reference counts by key and may precede the schema itself (a row
    waiting for its schema pins the key it waits for).
    """

    def __init__(self, maxsize: int = DEFAULT_MAXSIZE) -> None:
        self._lru = _EvictionNotifyingLRU(maxsize, self._forget_version_id)
        self._pinned: dict[SchemaKey, TableSchema] = {}
        self._pins: Counter[SchemaKey] = Counter()
        self._by_version_id: dict[_VersionId, set[SchemaKey]] = {}
        self.learned = 0  # schemas ever added: tells a caller keeping snapshots whether one is due

    def __len__(self) -> int:
        return len(self._lru) + len(self._pinned)

    def __contains__(self, key: SchemaKey) -> bool:
        return key in self._pinned or key in self._lru

    def add(self, schema: TableSchema) -> bool:
        """Learn `schema`; False if its key was known (DDLs and BOOTSTRAPs arrive once per partition)."""
        key = schema.key
        if key in self:
            self.get(key)  # a re-announced version is a live one: keep it recent
            return False
        if self._pins[key]:
            self._pinned[key] = schema
        else:
            self._lru[key] = schema
        self._by_version_id.setdefault((schema.table_id, schema.version), set()).add(key)
        self.learned += 1
        return True

    def get(self, key: SchemaKey) -> TableSchema | None:
        schema = self._pinned.get(key)
        return schema if schema is not None else self._lru.get(key)

    def lookup(self, key: SchemaKey, table_id: int) -> TableSchema | None:
        """The exact key, else the same table id and version known under another name.

        RENAME keeps the version, so a version learned under one name also serves the other; the match is
        then registered under the asked-for name so later rows hit it directly.
        """
        schema = self.get(key)
        if schema is not None:
            return schema
        other = next(iter(self._by_version_id.get((table_id, key[2]), ())), None)
        found = self.get(other) if other is not None else None
        return self.alias(found, key) if found is not None else None

    def alias(self, schema: TableSchema, key: SchemaKey) -> TableSchema:
        """`schema` under the name in `key` (same table id and version), registered in the cache."""
        if schema.key == key:
            return schema
        renamed = msgspec.structs.replace(schema, database=key[0], table=key[1])
        self.add(renamed)
        return renamed

    def pin(self, key: SchemaKey, count: int = 1) -> None:
        self._pins[key] += count
        if key not in self._pinned and key in self._lru:
            self._pinned[key] = self._lru.pop(key)

    def pins(self, key: SchemaKey) -> int:
        """How many unapplied rows hold `key` in the cache."""
        return self._pins[key]

    def unpin(self, key: SchemaKey, count: int = 1) -> None:
        left = self._pins[key] - count
        if left > 0:
            self._pins[key] = left
            return
        self._pins.pop(key, None)
        schema = self._pinned.pop(key, None)
        if schema is not None:
            self._lru[key] = schema

    def snapshot(self) -> bytes:
        """Every known schema, msgpack-encoded, so a sink can persist it next to its committed offsets."""
        return msgspec.msgpack.encode([*self._lru.values(), *self._pinned.values()])

    @classmethod
    def restore(cls, data: bytes, maxsize: int = DEFAULT_MAXSIZE) -> SchemaCache:
        cache = cls(maxsize)
        for schema in snapshot_schemas(data):
            cache.add(schema)
        return cache

    def _forget_version_id(self, key: SchemaKey, schema: TableSchema) -> None:
        version_id = (schema.table_id, schema.version)
        keys = self._by_version_id.get(version_id)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._by_version_id[version_id]


def snapshot_schemas(data: bytes) -> list[TableSchema]:
    """The schemas in a `SchemaCache.snapshot()`."""
    return msgspec.msgpack.decode(data, type=list[TableSchema])
