"""The suite's Spark driver archive (`tests/jvm_archive.py`): where it lives and when it is built."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.jvm_archive import archive_path, build_in_background


def test_one_archive_per_environment_and_jvm_options() -> None:
    serial, parallel = archive_path("-XX:+UseSerialGC"), archive_path("-XX:+UseParallelGC")
    assert serial != parallel
    assert serial == archive_path("-XX:+UseSerialGC")
    assert serial.parent == Path(sys.prefix) / "ticdc-consumer-tests"  # removed with the environment
    assert serial.name.startswith("spark-driver-") and serial.suffix == ".jsa"


def test_an_existing_archive_or_an_unwritable_place_builds_nothing(tmp_path: Path) -> None:
    existing = tmp_path / "spark-driver-0.jsa"
    existing.write_bytes(b"")
    assert build_in_background(existing, "") is None
    blocked = tmp_path / "a-file"
    blocked.write_bytes(b"")
    assert build_in_background(blocked / "archives" / "spark-driver-1.jsa", "") is None  # not a directory
    assert not list(tmp_path.rglob("*.partial"))
