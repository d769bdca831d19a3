"""Settings every writer of a lake must share, recorded in the lake: `<root>/_settings`, an empty Delta table
whose table properties hold them (any Delta reader sees them: `DeltaTable(...).metadata().configuration`).

    ticdc.mirror.cadence   how the lake's mirrors are MERGEd: `interval_s=<s>;interval_rows=<n>` (both 0:
                           every batch), the Delta sink's `mirror_interval_s` / `mirror_interval_rows`

The first writer records its value; later ones compare theirs with it (`record_mirror_cadence`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import DeltaError

from consumer.errors import ConfigError
from consumer.lakehouse.storage import LakeRoot, retry_commits

SETTINGS = "_settings"
CADENCE_PROPERTY = "ticdc.mirror.cadence"
SETTINGS_APP = "ticdc-settings"  # app transaction every change of the settings sets: concurrent ones conflict
_SCHEMA = pa.schema([pa.field("setting", pa.string())])  # never holds rows: the properties are the point


@dataclass(frozen=True)
class MirrorCadence:
    """When mirrors are MERGEd: every batch (both 0), or lazily (`consumer.sinks.delta`)."""

    interval_s: float = 0.0
    interval_rows: int = 0

    @property
    def lazy(self) -> bool:
        return bool(self.interval_s or self.interval_rows)

    def encoded(self) -> str:
        return f"interval_s={self.interval_s:g};interval_rows={self.interval_rows}"

    @classmethod
    def parse(cls, text: str) -> MirrorCadence:
        fields = dict(part.split("=", 1) for part in text.split(";") if "=" in part)
        return cls(float(fields.get("interval_s", 0)), int(fields.get("interval_rows", 0)))

    def __str__(self) -> str:
        values = f"mirror_interval_s = {self.interval_s:g}, mirror_interval_rows = {self.interval_rows}"
        return f"{values} ({'lazy MERGEs' if self.lazy else 'a MERGE every batch'})"


def recorded_mirror_cadence(root: LakeRoot) -> MirrorCadence | None:
    """The cadence the lake's mirrors are MERGEd on, None when no writer recorded one yet."""
    table = root.open(root.join(SETTINGS))
    value = None if table is None else table.metadata().configuration.get(CADENCE_PROPERTY)
    return None if value is None else MirrorCadence.parse(value)


def record_mirror_cadence(root: LakeRoot, cadence: MirrorCadence, *, replace: bool = False) -> MirrorCadence:
    """Record `cadence` unless the lake has one already; returns the lake's cadence afterwards (another
    writer's, when it recorded first: compare). `replace`: record it whatever the lake had, e.g. a
    benchmark switching cadence between phases; only with every writer of the lake stopped, and never from
    lazy MERGEs to every batch while a mirror still lacks changes its changelog holds."""
    uri = root.join(SETTINGS)
    wanted = cadence.encoded()

    def attempt() -> MirrorCadence:
        table = root.open(uri)
        if table is None:
            try:  # with no properties (delta-rs validates those given at creation): set below
                DeltaTable.create(uri, _SCHEMA, mode="ignore", storage_options=root.options())
            except DeltaError:  # another writer created it at once
                if root.open(uri) is None:
                    raise
            table = root.existing(uri)
        value = table.metadata().configuration.get(CADENCE_PROPERTY)
        if value is None or (replace and value != wanted):
            # the app transaction makes writers setting it at once conflict: the loser reads the winner's
            token = Transaction(SETTINGS_APP, (table.transaction_version(SETTINGS_APP) or 0) + 1)
            table.alter.set_table_properties(
                {CADENCE_PROPERTY: wanted},
                raise_if_not_exists=False,
                commit_properties=CommitProperties(app_transactions=[token]),
            )
            return cadence
        return MirrorCadence.parse(value)

    return retry_commits(f"recording the mirror cadence in {uri}", attempt)


def require_mirror_cadence(root: LakeRoot, cadence: MirrorCadence) -> None:
    """A writer of the lake's mirrors starts only with the lake's cadence (recording it when the lake has
    none): ConfigError naming both values otherwise.

    Why one cadence: a mirror commit claims the mirror holds every change up to the consistent point. A
    member MERGEing every batch claims it for changes a lazy member has put only in the changelog so far
    (overstating what the mirror holds, for plain Delta readers and as-of reads alike), and a lake leaving
    lazy MERGEs may still have changes no MERGE took.

    Why refuse rather than adopt the recorded cadence: the configuration is what the user decided for
    freshness (what a plain Delta reader sees) and MERGE cost; a member silently running on another
    cadence would make the configuration lie, and the mismatch usually means one member's configuration is
    stale. A refusal at start costs nothing (nothing is written yet) and says exactly what to change.
    """
    recorded = record_mirror_cadence(root, cadence)
    if recorded != cadence:
        raise ConfigError(
            f"sink.mirror_interval_s / mirror_interval_rows: this member's mirror cadence is {cadence}, but "
            f"the lake {root.uri} records {recorded} (table property {CADENCE_PROPERTY} of "
            f"{root.join(SETTINGS)}): every member writing a lake's mirrors must MERGE them on one cadence "
            "(one MERGEing every batch would claim changes a lazy one has only in its changelog); start "
            "this member with the recorded values"
        )
