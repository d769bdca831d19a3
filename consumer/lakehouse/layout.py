"""How a sink names an upstream table under its root: one rule for every sink (the lakehouse catalog gives a
table the location `<segment(database)>/<segment(table)>`, the JSONL sink a file of the same names).

Database and table names come from messages, so they are untrusted: each becomes exactly one path segment
that cannot climb out of the root (`..`, `/`, a leading `.`), cannot collide with the sinks' own entries at
the root (they all start with `_`), and stays within file-name length limits.
"""

from __future__ import annotations

import hashlib

DDL_LOG = "_ddl"  # every sink's DDL log lives under this name at its root
_MAX_SEGMENT_BYTES = 200  # below the usual 255-byte file-name limit, with room for suffixes
_HASHED_HEX = 16


def segment(name: str) -> str:
    """An identifier as one safe path segment, unchanged when it already is a plain one (so a reader can build
    the path from the names): characters other than letters, digits, `-`, `_` and `.` become `~XX` per UTF-8
    byte (`~` itself included, so the mapping is injective), and so do a leading `.` or `_`. A segment longer
    than the file-name limit keeps its start and ends in a hash of the whole name."""
    escaped = "".join(c if c.isalnum() or c in "-_." else _escaped(c) for c in name)
    if escaped[:1] in (".", "_"):
        escaped = _escaped(escaped[0]) + escaped[1:]
    if not escaped:
        return "~"  # the empty name: a segment no escaped name can equal
    if len(escaped.encode()) > _MAX_SEGMENT_BYTES:
        digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASHED_HEX]
        head = escaped.encode()[: _MAX_SEGMENT_BYTES - _HASHED_HEX - 2].decode("utf-8", "ignore")
        escaped = f"{head}~~{digest}"
    return escaped


def _escaped(char: str) -> str:
    return "".join(f"~{byte:02X}" for byte in char.encode("utf-8", "surrogatepass"))
