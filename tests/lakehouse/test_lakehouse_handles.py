"""Delta handles kept across roots (`consumer.lakehouse.handles`): a root of its own reads through the handle
a gone root held, brought up to date, and never through a handle of another table at the same place."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake

from consumer.lakehouse.storage import LakeRoot

WRITE = """
import sys
import pyarrow as pa
from deltalake import write_deltalake
write_deltalake(sys.argv[1], pa.table({"n": [int(v) for v in sys.argv[3:]]}), mode=sys.argv[2])
"""  # another process's write: `python -c WRITE <uri> <mode> <values...>`


def _read(root: Path, uri: str) -> tuple[int, list[int]] | None:
    """The table's version and values, through a root of its own (given back once it returns)."""
    lake = LakeRoot.of(root)
    table = lake.open(uri)
    return None if table is None else (table.version(), sorted(lake.scan(table).to_table()["n"].to_pylist()))


def _write(uri: str, *values: int) -> None:
    write_deltalake(uri, pa.table({"n": list(values)}), mode="append")


def test_a_gone_roots_handle_serves_the_next_root_and_a_live_ones_does_not(tmp_path: Path) -> None:
    uri = str(tmp_path / "facts")
    _write(uri, 1)
    first = LakeRoot.of(tmp_path)
    held = first.open(uri)
    assert held is not None and LakeRoot.of(tmp_path).open(uri) is not held  # `first` still holds it
    del first
    _write(uri, 2)
    second = LakeRoot.of(tmp_path)
    assert second.open(uri) is held and held.version() == 1
    assert sorted(second.scan(held).to_table()["n"].to_pylist()) == [1, 2]


def test_a_table_made_again_in_place_is_read_afresh(tmp_path: Path) -> None:
    """Made again with as many commits (nothing new after the handle's version) or more (commits after
    it that belong to another table), or gone: never read through the old table's handle."""
    uri = str(tmp_path / "facts")
    _write(uri, 1)
    _write(uri, 2)
    assert _read(tmp_path, uri) == (1, [1, 2])
    shutil.rmtree(uri)
    _write(uri, 7)
    _write(uri, 8)
    assert _read(tmp_path, uri) == (1, [7, 8])
    shutil.rmtree(uri)
    for value in (3, 4, 5):
        _write(uri, value)
    assert _read(tmp_path, uri) == (2, [3, 4, 5])
    shutil.rmtree(uri)
    assert _read(tmp_path, uri) is None


def test_a_table_another_process_wrote_is_read_at_its_new_version(tmp_path: Path) -> None:
    uri = str(tmp_path / "facts")
    _write(uri, 1)
    assert _read(tmp_path, uri) == (0, [1])
    subprocess.run([sys.executable, "-c", WRITE, uri, "append", "2", "3"], check=True)
    assert _read(tmp_path, uri) == (1, [1, 2, 3])
    subprocess.run([sys.executable, "-c", WRITE, uri, "overwrite", "9"], check=True)
    assert _read(tmp_path, uri) == (2, [9])
