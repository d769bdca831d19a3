"""Reading a pipeline's JSON-lines output back as changelogs, to check against the simulator's truth."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def delivered_rows(*roots: Path) -> dict[str, list[dict[str, Any]]]:
    """Changelog rows per table from JSON-lines outputs (several roots: the union, in file order)."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for root in roots:
        for path in sorted(root.glob("*/*.jsonl")):
            name = f"{path.parent.name}.{path.stem}"
            rows.setdefault(name, []).extend(json.loads(line) for line in path.read_text().splitlines())
    return rows


def delivered_ddls(*roots: Path) -> list[dict[str, Any]]:
    seen = {}
    for root in roots:
        log = root / "_ddl.jsonl"
        for line in log.read_text().splitlines() if log.exists() else []:
            ddl = json.loads(line)
            seen[(ddl["commit_ts"], ddl["sql"])] = ddl
    return list(seen.values())


def unique_images(rows: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Drop legitimate redeliveries: the same image of the same (topic, partition, offset)."""
    unique: dict[str, list[dict[str, Any]]] = {}
    for table, images in rows.items():
        seen: dict[tuple[Any, ...], dict[str, Any]] = {}
        for image in images:
            seen.setdefault(
                (image["_topic"], image["_partition"], image["_offset"], image["_change_type"]), image
            )
        unique[table] = list(seen.values())
    return unique
