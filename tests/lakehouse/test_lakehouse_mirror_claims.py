"""What mirror commits claim and when lazy MERGEs run: every writer of a lake MERGEs on the cadence the lake
records (or refuses to start)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from deltalake import DeltaTable

from consumer.config import ConfigError, load_config
from consumer.configured import build_sinks
from consumer.lakehouse.settings import CADENCE_PROPERTY, SETTINGS
from consumer.lakehouse.tables import table_uri
from consumer.sinks.delta import DeltaSink


def _mirror_commits(root: Path, table: str) -> list[dict[str, object]]:
    uri = table_uri(root, "shop", table)
    assert uri is not None
    return sorted(DeltaTable(uri).history(), key=lambda commit: int(str(commit["version"])))


# -- one cadence per lake --------------------------------------------------------------------------------
def test_every_writer_of_a_lakes_mirrors_uses_the_cadence_it_records(tmp_path: Path) -> None:
    """The first sink records its cadence in the lake; one with the same starts, one with another is refused
    at start naming both values; a sink keeping no mirror has no cadence."""
    DeltaSink(tmp_path, mirror_interval_rows=40)
    settings = DeltaTable(str(tmp_path / SETTINGS)).metadata().configuration
    assert settings[CADENCE_PROPERTY] == "interval_s=0;interval_rows=40"  # any Delta reader sees it
    DeltaSink(tmp_path, mirror_interval_rows=40)
    with pytest.raises(ConfigError) as refused:
        DeltaSink(tmp_path)  # MERGE every batch
    message = str(refused.value)
    assert "cadence is mirror_interval_s = 0, mirror_interval_rows = 0 (a MERGE every batch), but" in message
    assert f"{tmp_path} records mirror_interval_s = 0, mirror_interval_rows = 40 (lazy MERGEs)" in message
    with pytest.raises(ConfigError, match=r"cadence is mirror_interval_s = 30, mirror_interval_rows = 40 \("):
        DeltaSink(tmp_path, mirror_interval_s=30, mirror_interval_rows=40)
    assert DeltaSink(tmp_path, mode="changelog").lazy_mirrors is False  # no mirror, no cadence
    overrides = {"source": {"url": "file:capture.jsonl"}, "sink": {"url": f"delta:{tmp_path}"}}
    with pytest.raises(ConfigError, match="mirror_interval_rows = 40"):  # as `run` builds it: exit 2
        build_sinks(load_config(overrides=overrides, environ={}))
    assert DeltaTable(str(tmp_path / SETTINGS)).metadata().configuration == settings  # nothing changed


def test_members_starting_at_once_agree_on_the_first_recorded_cadence(tmp_path: Path) -> None:
    """Two members of a new lake start together with different cadences: one records its own, the other
    is refused, whichever came first."""
    together = threading.Barrier(2)

    def start(interval_rows: int) -> ConfigError | None:
        together.wait()
        try:
            DeltaSink(tmp_path, mirror_interval_rows=interval_rows)
        except ConfigError as exc:
            return exc
        return None

    with ThreadPoolExecutor(2) as pool:
        outcomes = list(pool.map(start, [0, 50]))
    assert sorted(outcome is None for outcome in outcomes) == [False, True]
    recorded = DeltaTable(str(tmp_path / SETTINGS)).metadata().configuration[CADENCE_PROPERTY]
    winner = 0 if outcomes[0] is None else 50
    assert recorded == f"interval_s=0;interval_rows={winner}"
