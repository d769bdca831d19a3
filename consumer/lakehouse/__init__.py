"""The lakehouse the sinks keep, on a local disk or any object store delta-rs reaches: where each upstream
table lives (`Catalog`, `tables`, `table_uri`), reading it (`read_mirror`, `read_changelog`,
`read_history`), how far it is consistent (`consistent_ts`) and keeping it fast (`maintain`).
Layout under a root:

    _catalog        Delta: one row per upstream table: location, current name, history
    _ddl            Delta: every DDL applied, once
    _progress       Delta: per consumer group and partition, resume offset and applied commit ts
    _schemas        Delta: the schema-cache snapshots group members recorded
    _settings       Delta, no rows: what every writer must share, as table properties (the mirror cadence)
    <location>/     a table's `changelog`, `mirror`, `history`, `deletes` (Delta), or Parquet changelog files
"""

from consumer.lakehouse.catalog import Catalog, CatalogEntry, NamePeriod
from consumer.lakehouse.maintenance import MaintenanceReport, maintain
from consumer.lakehouse.progress import consistent_ts
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import (
    AsOfRetentionError,
    TsoOutOfRangeError,
    read_changelog,
    read_history,
    read_mirror,
    retained_range,
    table_uri,
    tables,
)

__all__ = [
    "AsOfRetentionError",
    "Catalog",
    "CatalogEntry",
    "LakeRoot",
    "MaintenanceReport",
    "NamePeriod",
    "TsoOutOfRangeError",
    "consistent_ts",
    "maintain",
    "read_changelog",
    "read_history",
    "read_mirror",
    "retained_range",
    "table_uri",
    "tables",
]
