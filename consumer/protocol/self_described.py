"""What the protocols whose records describe their own tables (TiCDC Avro, Debezium) share: a table id
(they send none), ENUM/SET element lists, and label checks of ENUM/SET values sent as text."""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence
from typing import TypedDict

import pyarrow as pa
import pyarrow.compute as pc


class TextCollation(TypedDict):
    charset: str
    collate: str


# The collation a text column of a protocol that does not send one is given (as TiDB's default).
TEXT: TextCollation = {"charset": "utf8mb4", "collate": "utf8mb4_bin"}


def stable_table_id(database: str, table: str) -> int:
    """A table id derived from the names, the same in every process (the protocol has none)."""
    return zlib.crc32(f"{database}\0{table}".encode())


def split_allowed(text: str) -> tuple[str, ...]:
    """ENUM `allowed`: split on unescaped commas, `\\,` meaning a comma inside an element. TiCDC does not
    escape `\\`, so an element ending in one, followed by another, reads as the two joined by a comma: the
    wire cannot carry it (README, "ENUM elements ending in `\\`")."""
    return tuple(part.replace("\\,", ",") for part in re.split(r"(?<!\\),", text)) if text else ()


def joined_allowed(elements: Sequence[str]) -> str:
    return ",".join(e.replace(",", "\\,") for e in elements)


def enum_labels(values: pa.Array, elements: Sequence[str]) -> pa.Array:
    """ENUM values sent as their labels: each must be one of the elements (or NULL)."""
    known = pc.is_in(values, value_set=pa.array(list(elements), pa.string()))
    if not pc.all(pc.or_(known, pc.is_null(values))).as_py():
        raise ValueError(f"not one of the enum's elements {list(elements)}")
    return values


def set_labels(values: pa.Array, elements: Sequence[str]) -> pa.Array:
    """SET values sent as labels joined by `,` (`""` the empty set): each label must be an element."""
    allowed = set(elements)
    for value in pc.unique(values).to_pylist():
        if value and not set(value.split(",")) <= allowed:
            raise ValueError(f"{value!r} holds labels outside the set's elements {list(elements)}")
    return values
