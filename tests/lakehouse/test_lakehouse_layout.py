"""Names from messages become path segments that never leave a sink's root."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from consumer.lakehouse import Catalog, LakeRoot
from consumer.lakehouse.layout import segment

# Any text a message could carry, lone surrogates included (msgspec can decode `\ud800`).
NAMES = st.text(st.characters(codec=None), max_size=300)


def test_plain_names_are_kept_and_the_rest_escaped(tmp_path: Path) -> None:
    catalog = Catalog(LakeRoot.of(tmp_path))
    assert catalog.locate(("shop_1", "orders.v2"), 1).location == "shop_1/orders.v2"
    assert catalog.locate(("_ddl", "../a b"), 1).location == "~5Fddl/~2E.~2Fa~20b"
    assert segment("/abs/path") == "~2Fabs~2Fpath"
    assert segment("..") == "~2E."
    assert segment("") == "~"
    assert segment("~") == "~7E"


@given(NAMES)
def test_a_segment_is_one_harmless_path_component(name: str) -> None:
    part = segment(name)
    assert "/" not in part and "\x00" not in part
    assert not part.startswith((".", "_"))  # no `.`/`..`, and never a sink's own `_...` entry
    assert 0 < len(part.encode()) <= 200
    assert Path(part).name == part


@given(NAMES, NAMES)
def test_different_names_get_different_segments(first: str, second: str) -> None:
    if first != second:
        assert segment(first) != segment(second)


def test_a_table_location_stays_under_its_root(tmp_path: Path) -> None:
    catalog = Catalog(LakeRoot.of(tmp_path))
    for database, table in [
        ("../../x", "/etc"),
        ("..", ".."),
        ("a/../../b", "c\\d"),
        ("x" * 5000, "é" * 300),
    ]:
        path = (tmp_path / catalog.locate((database, table), 1).location).resolve()
        assert (
            path.is_relative_to(tmp_path.resolve()) and len(path.relative_to(tmp_path.resolve()).parts) == 2
        )
