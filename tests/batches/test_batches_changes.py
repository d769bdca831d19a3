"""Resolved rows -> changelog rows in the change-data-feed convention, and the per-key reduction."""

from __future__ import annotations

import datetime as dt

from hypothesis import given
from hypothesis import strategies as st

from consumer.batches.changes import METADATA_NAMES, stored_name, table_changes
from consumer.errors import RecordLocation, ValueDecodeError
from consumer.lakehouse.tables import latest_per_key
from consumer.protocol.model import DML, Column, DataType, DMLType, Index, RawDML, TableSchema
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.testing.messages import raw_dml

SCHEMA = TableSchema(
    database="shop",
    table="orders",
    table_id=1,
    version=5,
    columns=(
        Column("id", DataType("bigint", length=20), nullable=False),
        Column("qty", DataType("int", length=11)),
    ),
    indexes=(Index("primary", True, True, False, ("id",)),),
)
TS = 449512873440575500  # physical part: 1714751473 s


def _raw(kind: DMLType, commit_ts: int, data: dict | None = None, old: dict | None = None) -> RawDML:
    dml = DML(
        type=kind,
        database="shop",
        table="orders",
        table_id=1,
        commit_ts=commit_ts,
        build_ts=0,
        schema_version=5,
        data=data,
        old=old,
    )
    raw = MessageDecoder().decode(MessageEncoder().encode(dml, SCHEMA))
    assert isinstance(raw, RawDML)
    return raw


def _rows(*raws: RawDML) -> list[tuple[RawDML, RecordLocation]]:
    return [(raw, RecordLocation("t", 1, 10 + i)) for i, raw in enumerate(raws)]


def test_changelog_has_one_row_per_image_with_metadata() -> None:
    rows = _rows(
        _raw(DMLType.INSERT, TS, data={"id": 1, "qty": 2}),
        _raw(DMLType.UPDATE, TS + 1, data={"id": 1, "qty": 3}, old={"id": 1, "qty": 2}),
        _raw(DMLType.DELETE, TS + 2, old={"id": 1, "qty": 3}),
    )
    changes = table_changes(TableCodec(SCHEMA), rows)
    got = changes.changelog.to_pylist()
    assert [(r["_change_type"], r["id"], r["qty"], r["_offset"]) for r in got] == [
        ("insert", 1, 2, 10),
        ("update_preimage", 1, 2, 11),
        ("update_postimage", 1, 3, 11),
        ("delete", 1, 3, 12),
    ]
    assert got[0]["_commit_ts"] == TS and got[0]["_schema_version"] == 5 and got[0]["_topic"] == "t"
    assert got[0]["_commit_time"] == dt.datetime.fromtimestamp((TS >> 18) / 1000, dt.UTC)
    assert changes.key_columns == ("id",)
    assert changes.changelog.schema.field("id").nullable is False


def test_latest_per_key_keeps_the_last_change_and_never_a_preimage() -> None:
    rows = _rows(
        _raw(DMLType.INSERT, TS, data={"id": 1, "qty": 1}),
        _raw(DMLType.INSERT, TS, data={"id": 2, "qty": 1}),
        _raw(DMLType.UPDATE, TS + 5, data={"id": 1, "qty": 9}, old={"id": 1, "qty": 1}),
        _raw(DMLType.DELETE, TS + 6, old={"id": 2, "qty": 1}),  # then re-inserted by a PK change:
        _raw(DMLType.INSERT, TS + 6, data={"id": 2, "qty": 7}),
    )
    latest = latest_per_key(table_changes(TableCodec(SCHEMA), rows).changelog, ["id"])
    got = sorted((r["id"], r["qty"], r["_change_type"]) for r in latest.to_pylist())
    assert got == [(1, 9, "update_postimage"), (2, 7, "insert")]


def test_bad_value_is_reported_with_the_records_location() -> None:
    good = _raw(DMLType.INSERT, TS, data={"id": 1, "qty": 2})
    bad = RawDML(
        **{
            **{f: getattr(good, f) for f in good.__struct_fields__},
            "payload": good.payload.replace(b'"qty":"2"', b'"qty":"two"'),
        }
    )
    try:
        table_changes(TableCodec(SCHEMA), _rows(good, bad))
    except ValueDecodeError as exc:
        assert exc.location == RecordLocation("t", 1, 11) and exc.column == "qty"
    else:
        raise AssertionError("expected a ValueDecodeError")


def test_bad_value_after_an_update_names_its_record_not_its_image() -> None:
    """The UPDATE before it has two images: the bad value is the third image but the second record."""
    update = _raw(DMLType.UPDATE, TS, data={"id": 1, "qty": 3}, old={"id": 1, "qty": 2})
    good = _raw(DMLType.INSERT, TS + 1, data={"id": 2, "qty": 2})
    bad = RawDML(
        **{
            **{f: getattr(good, f) for f in good.__struct_fields__},
            "payload": good.payload.replace(b'"qty":"2"', b'"qty":"9999999999"'),  # beyond int
        }
    )
    try:
        table_changes(TableCodec(SCHEMA), _rows(update, bad))
    except ValueDecodeError as exc:
        assert exc.location == RecordLocation("t", 1, 11) and exc.column == "qty"
        assert "9999999999" in str(exc)
    else:
        raise AssertionError("expected a ValueDecodeError")


# -- user columns named like metadata -------------------------------------------------------------------
_FOLDED_METADATA = {name.lower() for name in METADATA_NAMES}


@given(
    st.text(alphabet="_abAB", max_size=12)
    | st.sampled_from(sorted(METADATA_NAMES)).map(lambda n: "__" + n)
    | st.sampled_from(sorted(METADATA_NAMES)).map(str.upper)
)
def test_stored_names_never_collide_with_metadata_or_each_other(name: str) -> None:
    """Case-insensitively, as Delta and Spark compare names (MySQL column names are case-insensitive too)."""
    stored = stored_name(name)
    assert stored.lower() not in _FOLDED_METADATA
    assert stored == name or stored == "_" + name
    for other in (name.lstrip("_"), "_" + name, name[1:]):
        if other.lower() != name.lower():
            assert stored_name(other).lower() != stored.lower()


def test_a_table_with_every_metadata_name_as_a_column_keeps_each_value() -> None:
    names = ["id", *sorted(METADATA_NAMES), "__offset"]
    schema = TableSchema(
        database="shop",
        table="odd",
        table_id=2,
        version=1,
        columns=tuple(Column(n, DataType("bigint", length=20), nullable=n != "_offset") for n in names),
        indexes=(Index("primary", True, True, False, ("_offset",)),),
    )
    row = {name: index for index, name in enumerate(names)}
    raw = raw_dml(schema, DMLType.INSERT, row, commit_ts=TS)
    changes = table_changes(TableCodec(schema), [(raw, RecordLocation("t", 3, 77))])

    stored = changes.changelog.to_pylist()[0]
    assert {stored_name(n): stored[stored_name(n)] for n in names} == {stored_name(n): row[n] for n in names}
    assert (stored["_offset"], stored["__offset"], stored["___offset"]) == (
        77,
        row["_offset"],
        row["__offset"],
    )
    assert stored["_partition"] == 3 and stored["_change_type"] == "insert"
    assert changes.key_columns == ("__offset",)
    assert len(set(changes.changelog.column_names)) == len(changes.changelog.column_names)
