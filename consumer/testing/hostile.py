"""Hostile inputs, to prove a consumer never stops on a bad record: strategies and a seeded mutator.

Everything here produces record values (bytes) or table schemas that a decoder must survive: either they
decode, or they raise a `ConsumerError`. Use them against your own consumer too:

    @given(hostile_records(valid_values))
    def test_never_crashes(value):
        try:
            my_consumer.handle(value)
        except ConsumerError:
            pass

`Mutator` makes the same kinds of damage from a seed, without hypothesis, for long fuzz runs
(`benchmarks/fuzz.py`): bit flips, truncation, splices, deep nesting, invalid UTF-8, huge numbers and
strings, wrong value types per column, hostile schemas and timestamps, compression bombs, Avro varints over
10 bytes, in JSON and Avro.
"""

from __future__ import annotations

import io
import json
import random
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cramjam
import fastavro
import lz4.frame
from hypothesis import strategies as st

from consumer.protocol.model import Column, DataType, Index, TableSchema
from consumer.protocol.simple.avro_messages import NAMESPACE, read_datum, writer_schema_json
from consumer.protocol.types import MYSQL_TYPES

# Bytes that break UTF-8 (stray continuation, overlong, encoded surrogate, truncated sequence) or JSON
# (an escaped lone surrogate).
INVALID_UTF8 = (b"\xff", b"\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xe2\x82", b"\\ud800", b"\\udfff")
HUGE_NUMBERS = (
    "1" * 5000,
    "-" + "9" * 400,
    "18446744073709551616",
    "18446744073709551615",
    "9223372036854775808",
    "-9223372036854775809",
    "-5",
    "0",
    "1e400",
    "-1e-400",
    "1.5e308",
    "NaN",
    "Infinity",
    "-0",
    "0x10",
)
ZONES = ("Europe", "A" * 300, "../../etc/passwd", "/etc/localtime", "", "Local", "UTC+8", "Asia/Shanghai\x00")
NESTING_DEPTHS = (100, 129, 1_000, 5_000, 100_000)
OVERLONG_VARINT = b"\xff" * 11 + b"\x01"  # 12 bytes: no Avro long, -2^63 to a reader of any length
_VARINT_END = re.compile(rb"[\x00-\x7f]")
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_JSON_NUMBER = re.compile(rb"(?<=[:\[,])-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")


# -- hypothesis strategies ----------------------------------------------------------------------------
def hostile_bytes(max_size: int = 512) -> st.SearchStrategy[bytes]:
    """Arbitrary bytes, often behind a first byte that makes a decoder take them for JSON, Avro, LZ4 or
    snappy."""
    prefixes = st.sampled_from(
        [b"", b"{", b"\x16", b"\x16\x06\x06", b"\x04\x22\x4d\x18", b"\xff\xff\xff\xff\x0f"]
    )
    return st.builds(lambda prefix, body: prefix + body, prefixes, st.binary(max_size=max_size))


def hostile_json_values() -> st.SearchStrategy[Any]:
    """A JSON value where a column value belongs: wrong types, huge numbers, deep nesting, odd text."""
    deep = st.sampled_from(NESTING_DEPTHS[:3]).map(lambda depth: json.loads("[" * depth + "]" * depth))
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.sampled_from(HUGE_NUMBERS),
        st.text(max_size=50),
        st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        st.lists(st.integers(), max_size=3),
        st.builds(lambda zone: {"location": zone, "value": "2020-01-01 00:00:00"}, st.sampled_from(ZONES)),
        deep,
    )


@st.composite
def hostile_schemas(draw: st.DrawFn) -> TableSchema:
    """A table schema outside what TiDB allows, or at its edges: DECIMAL precision/scale beyond 65/30, BIT
    wider than 64, ENUM/SET too large or empty, duplicate or overlong names, unknown types, indexes naming
    missing columns, versions that are no TSO."""
    columns = [Column("id", DataType("bigint", length=20), nullable=False)]
    for _ in range(draw(st.integers(1, 4))):
        columns.append(draw(_hostile_columns()))
    if draw(st.booleans()):
        columns.append(draw(st.sampled_from(columns)))  # a duplicate name (maybe in another case)
    index_columns = draw(st.sampled_from([("id",), ("missing",), (), tuple(f"c{i}" for i in range(17))]))
    return TableSchema(
        database=draw(st.sampled_from(["d", "", "x" * 65, "ok "])),
        table=draw(st.sampled_from(["t", "../../x", "/abs", "t" * 65, "_ddl"])),
        table_id=draw(st.integers(-(2**63), 2**63 - 1)),
        version=draw(st.sampled_from([1, 0, -1, 2**63, 2**64 - 1, 449_811_223_446_634_498])),
        columns=tuple(columns),
        indexes=(Index("primary", True, True, False, index_columns),),
    )


@st.composite
def _hostile_columns(draw: st.DrawFn) -> Column:
    kind = draw(st.sampled_from([*MYSQL_TYPES, "geometry", "", "DECIMAL", "int unsigned"]))
    length = draw(st.sampled_from([-5, -1, 0, 1, 64, 65, 66, 255, 2**31 - 1, 2**32, 2**63 - 1]))
    decimal = draw(st.sampled_from([-1, 0, 6, 7, 30, 31, 65, 2**31 - 1]))
    elements = draw(st.sampled_from([(), ("a",), ("a", "a"), ("a,b",), tuple(map(str, range(65)))]))
    name = draw(st.sampled_from(["c", "C", "_offset", "_DELETED", "a b", 'q"uote', "b`tick", "", "n" * 65]))
    return Column(name, DataType(kind, length=length, decimal=decimal, elements=elements), nullable=True)


def hostile_records(valid: Sequence[bytes], max_size: int = 1 << 16) -> st.SearchStrategy[bytes]:
    """Valid record values damaged by a `Mutator` (the draw picks the value and the damage)."""
    return st.builds(
        lambda value, seed: Mutator(seed, max_bytes=max_size).mutate(value),
        st.sampled_from(list(valid)),
        st.integers(0, 2**32 - 1),
    )


# -- seeded mutations ---------------------------------------------------------------------------------
class Mutator:
    """Damages valid record values, deterministically from `seed`.

    `max_bytes` bounds what a mutation may grow a value to; `bomb_bytes` is how far a compression bomb
    inflates (set it just past the decoder's `max_decompressed_bytes`).
    """

    def __init__(self, seed: int, *, max_bytes: int = 1 << 18, bomb_bytes: int = (1 << 20) + 1) -> None:
        self.random = random.Random(seed)
        self.max_bytes = max_bytes
        self.bomb_bytes = bomb_bytes
        self._operators: list[tuple[Callable[[bytes], bytes], int]] = [
            (self.flip_bits, 8),
            (self.truncate, 3),
            (self.splice, 3),
            (self.nest, 2),
            (self.invalid_utf8, 3),
            (self.huge_number, 3),
            (self.huge_string, 1),
            (self.wrong_type, 6),
            (self.hostile_schema, 4),
            (self.hostile_header, 3),
            (self.compress, 2),
            (self.bomb, 1),
            (self.overlong_varint, 2),
        ]
        self._weights = [weight for _, weight in self._operators]

    def mutate(self, value: bytes) -> bytes:
        """One to three mutations of `value`, chosen by weight."""
        for _ in range(self.random.choice((1, 1, 1, 2, 3))):
            (operator,) = self.random.choices([op for op, _ in self._operators], self._weights)
            value = operator(value)
        return value[: self.max_bytes]

    def _position(self, value: bytes) -> int:
        return self.random.randrange(len(value) + 1)

    def flip_bits(self, value: bytes) -> bytes:
        if not value:
            return b"\xff"
        data = bytearray(value)
        for _ in range(self.random.randint(1, 8)):
            data[self.random.randrange(len(data))] ^= 1 << self.random.randrange(8)
        return bytes(data)

    def truncate(self, value: bytes) -> bytes:
        return value[: self.random.randrange(len(value))] if value else value

    def splice(self, value: bytes) -> bytes:
        """Insert random bytes or a slice of the value itself, or drop a span."""
        at = self._position(value)
        choice = self.random.random()
        if choice < 0.3 and value:
            return value[:at] + value[at + self.random.randint(1, 16) :]
        if choice < 0.6 and value:
            start = self.random.randrange(len(value))
            return value[:at] + value[start : start + self.random.randint(1, 64)] + value[at:]
        return value[:at] + self.random.randbytes(self.random.randint(1, 32)) + value[at:]

    def nest(self, value: bytes) -> bytes:
        """Deep brackets anywhere: as a field of a JSON object, inside a value, or raw."""
        depth = self.random.choice(NESTING_DEPTHS)
        opener = self.random.choice((b"[", b'{"a":'))
        closer = b"]" if opener == b"[" else b"}"
        nested = opener * depth + b"1" + closer * depth
        if value.startswith(b"{") and self.random.random() < 0.6:
            return b'{"zz":' + nested + b"," + value[1:]
        at = self._position(value)
        return value[:at] + nested + value[at:]

    def invalid_utf8(self, value: bytes) -> bytes:
        strings = list(_JSON_STRING.finditer(value))
        bad = self.random.choice(INVALID_UTF8)
        if strings:
            match = self.random.choice(strings)
            at = self.random.randint(match.start() + 1, match.end() - 1)
        else:
            at = self._position(value)
        return value[:at] + bad + value[at:]

    def huge_number(self, value: bytes) -> bytes:
        """A number or numeric string replaced by one no column (or TSO) can hold."""
        number = self.random.choice(HUGE_NUMBERS).encode()
        targets = list(_JSON_NUMBER.finditer(value)) + [
            m for m in _JSON_STRING.finditer(value) if len(m.group()) < 24
        ]
        if not targets:
            return value + number
        match = self.random.choice(targets)
        quoted = match.group().startswith(b'"') or self.random.random() < 0.5
        replacement = b'"' + number + b'"' if quoted else number
        return value[: match.start()] + replacement + value[match.end() :]

    def huge_string(self, value: bytes) -> bytes:
        strings = [m for m in _JSON_STRING.finditer(value) if len(m.group()) > 2]
        size = self.random.choice((1 << 10, 1 << 16, self.max_bytes))
        if not strings:
            return value + b"x" * size
        match = self.random.choice(strings)
        body = match.group()[1:-1] or b"x"
        grown = (body * (size // len(body) + 1))[:size]
        return value[: match.start() + 1] + grown + value[match.end() - 1 :]

    def wrong_type(self, value: bytes) -> bytes:
        """A JSON value (a column value, a header field) of the wrong type; for Avro, a datum re-encoded
        with a different union branch for one map value."""
        document = _json_object(value)
        if document is None:
            return _avro_wrong_branch(value, self.random) or self.flip_bits(value)
        paths = list(_paths(document))
        if not paths:
            return self.flip_bits(value)
        path = self.random.choice(paths)
        _replace(document, path, self._hostile_json())
        return json.dumps(document, separators=(",", ":")).encode()

    def _hostile_json(self) -> Any:
        choice = self.random.random()
        if choice < 0.15:
            return {
                "location": self.random.choice(ZONES),
                "value": self.random.choice(("2020-01-01 00:00:00", "x")),
            }
        if choice < 0.3:
            return self.random.choice(HUGE_NUMBERS)
        return self.random.choice(
            (
                None,
                True,
                0,
                -1,
                1.5,
                2**64,
                "",
                "abc",
                "0000-00-00",
                "[1,2",
                {"a": 1},
                [1, 2],
                [[[]]],
                "\u2028",
                "9" * 30,
            )
        )

    def hostile_schema(self, value: bytes) -> bytes:
        """A BOOTSTRAP/DDL's table schema pushed outside TiDB's limits (or a DML given a schema-ish field)."""
        document = _json_object(value)
        schema = document.get("tableSchema") if isinstance(document, dict) else None
        if (
            not isinstance(schema, dict)
            or not isinstance(schema.get("columns"), list)
            or not schema["columns"]
        ):
            return self.wrong_type(value)
        columns = schema["columns"]
        column = self.random.choice(columns)
        data_type = column.get("dataType") if isinstance(column, dict) else None
        if not isinstance(data_type, dict):
            return self.flip_bits(value)
        edit = self.random.randrange(9)
        if edit == 0:
            data_type["decimal"] = self.random.choice((31, 66, 2**31 - 1, 2**31, -7))
        elif edit == 1:
            data_type["length"] = self.random.choice((-2, 66, 2**31, 2**32, 2**63))
        elif edit == 2:
            data_type["mysqlType"] = self.random.choice(("geometry", "", "DECIMAL", "decimal(10,2)", "point"))
        elif edit == 3:
            data_type["elements"] = self.random.choice((["a"] * 2, [str(i) for i in range(70)], ["a,b"], []))
        elif edit == 4:
            columns.append(dict(column))  # duplicate name
        elif edit == 5:
            column["name"] = self.random.choice(("", "x" * 65, "ID", "_offset", "a ", "\x00"))
        elif edit == 6:
            schema["indexes"] = [
                {"name": "primary", "unique": True, "primary": True, "nullable": False, "columns": ["nope"]}
            ]
        elif edit == 7:
            schema["version"] = self.random.choice((-1, 2**63, 2**64 - 1))
        else:
            data_type["mysqlType"], data_type["length"], data_type["decimal"] = "decimal", 12, 2147483647
        return json.dumps(document, separators=(",", ":")).encode()

    def hostile_header(self, value: bytes) -> bytes:
        """commitTs, schemaVersion, names and timestamp zones a TiDB never sends."""
        document = _json_object(value)
        if not isinstance(document, dict):
            return self.flip_bits(value)
        field = self.random.choice(
            ("commitTs", "schemaVersion", "database", "table", "type", "version", "zone")
        )
        if field in ("commitTs", "schemaVersion", "version"):
            document[field] = self.random.choice((2**64 - 1, 2**64, -5, 0, 2**63, 10**30))
        elif field == "zone":
            for image in (document.get("data"), document.get("old")):
                if isinstance(image, dict):
                    for key, item in image.items():
                        if isinstance(item, dict):
                            image[key] = {"location": self.random.choice(ZONES), "value": item.get("value")}
        elif field == "type":
            document[field] = self.random.choice(("DDL", "INSERT", "BOOTSTRAP", "WATERMARK", "", "DELETE"))
        else:
            document[field] = self.random.choice(("", "../../x", "/abs/path", "x" * 300, "a\x00b", "é"))
        return json.dumps(document, separators=(",", ":")).encode()

    def compress(self, value: bytes) -> bytes:
        """The (possibly damaged) value compressed, then maybe damaged again."""
        packed = (
            lz4.frame.compress(value)
            if self.random.random() < 0.5
            else bytes(cramjam.snappy.compress_raw(value))
        )
        return self.flip_bits(packed) if self.random.random() < 0.3 else packed

    def bomb(self, value: bytes) -> bytes:
        """A value inflating past `bomb_bytes`, or a snappy block declaring a huge length."""
        choice = self.random.random()
        if choice < 0.4:
            return lz4.frame.compress(b"{" + b" " * self.bomb_bytes + b"}")
        if choice < 0.7:
            return b"\xff\xff\xff\xff\x0f" + value  # snappy: 4 GiB declared
        return bytes(cramjam.snappy.compress_raw(b"{" + b" " * self.bomb_bytes))

    def overlong_varint(self, value: bytes) -> bytes:
        """An Avro varint (any byte below 0x80 may end one) made longer than the 10 bytes a long may take:
        padded with zero groups, the same value to a reader of any length (fastavro's), or the `ff` x11
        `01` of issue 26, -2^63 to such a reader."""
        end = _VARINT_END.search(value, self._position(value))
        if end is None:
            return value + OVERLONG_VARINT
        stop = start = end.start()
        while start and value[start - 1] & 0x80:
            start -= 1
        if self.random.random() < 0.3:
            return value[:start] + OVERLONG_VARINT + value[stop + 1 :]
        groups = value[start:stop] + bytes([value[stop] | 0x80])
        size = self.random.choice((11, 12, 20))
        padded = groups + b"\x80" * max(0, size - len(groups) - 1) + b"\x00"
        return value[:start] + padded + value[stop + 1 :]


def mutations(values: Sequence[bytes], seed: int, count: int, **options: Any) -> Iterator[bytes]:
    """`count` hostile values made from `values`, deterministically from `seed`."""
    mutator = Mutator(seed, **options)
    for _ in range(count):
        yield mutator.mutate(mutator.random.choice(values))


def _json_object(value: bytes) -> Any:
    if not value.startswith(b"{"):
        return None
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return None


def _paths(document: Any) -> Iterator[tuple[Any, ...]]:
    """Paths to every value of a JSON document (not the document itself), depth first. Without recursion:
    Python 3.13's `json.loads` parses documents nested deeper than the recursion limit (3.11's refused
    them)."""
    stack: list[tuple[tuple[Any, ...], Iterator[tuple[Any, Any]]]] = [((), _children(document))]
    while stack:
        prefix, children = stack[-1]
        for key, item in children:
            path = (*prefix, key)
            yield path
            stack.append((path, _children(item)))
            break
        else:
            stack.pop()


def _children(value: Any) -> Iterator[tuple[Any, Any]]:
    if isinstance(value, dict):
        return iter(value.items())
    return iter(enumerate(value) if isinstance(value, list) else ())


def _replace(document: Any, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        document = document[key]
    document[path[-1]] = value


_AVRO_BRANCHES = ("null", "long", "float", "double", "string", "bytes", "Timestamp", "UnsignedBigint")
_AVRO_SAMPLES: dict[str, Any] = {
    "null": None,
    "long": -(2**63),
    "float": float("nan"),
    "double": float("inf"),
    "string": "\u00e9" * 3,
    "bytes": b"\xff\x00",
    "Timestamp": {"location": "Europe", "value": "x"},
    "UnsignedBigint": {"value": -1},
}
_AVRO_SCHEMA = fastavro.parse_schema(writer_schema_json())


def _avro_wrong_branch(value: bytes, rng: random.Random) -> bytes | None:
    """An Avro DML whose one map value moved to another union branch (a type its column does not have)."""
    if not value.startswith(b"\x16\x06\x06"):
        return None
    try:
        message = read_datum(value)
    except Exception:  # damaged already: a byte-level mutation will do
        return None
    payload = message["payload"]
    for image_name in ("data", "old"):  # record values tagged with their branch, so they are written back so
        if payload.get(image_name):
            payload[image_name] = {key: _avro_branch_of(item) for key, item in payload[image_name].items()}
    images = [payload[image_name] for image_name in ("data", "old") if payload.get(image_name)]
    if not images:
        return None
    image = rng.choice(images)
    branch = rng.choice(_AVRO_BRANCHES)
    sample = _AVRO_SAMPLES[branch]
    image[rng.choice(sorted(image))] = (
        (f"{NAMESPACE}.{branch}", sample) if isinstance(sample, dict) else sample
    )
    stream = io.BytesIO()
    try:
        fastavro.schemaless_writer(
            stream,
            _AVRO_SCHEMA,
            (f"{NAMESPACE}.Message", {"type": "DML", "payload": (f"{NAMESPACE}.DML", payload)}),
        )
    except Exception:  # fastavro could not write it (a value its branch cannot hold)
        return None
    return stream.getvalue()


def _avro_branch_of(item: Any) -> Any:
    """A value fastavro read back, tagged with its record branch so writing it picks the same one."""
    if isinstance(item, dict):
        return (f"{NAMESPACE}.{'Timestamp' if 'location' in item else 'UnsignedBigint'}", item)
    return item
