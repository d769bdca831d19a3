"""Avro encoding (docs/protocols/simple.md §5): a bare datum of the 12-type union in `message.avsc`, always
branch 11 (Message).

`ColumnSchema.default` is read and written as Avro `bytes`: it shares `string`'s binary layout, and TiCDC
puts raw (often invalid UTF-8) literal bytes there for BIT columns, which a strict string read rejects.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator, Sequence
from importlib import resources
from typing import Any, Literal, NamedTuple

import fastavro
import msgspec
import numpy as np

from consumer.errors import MalformedMessageError
from consumer.protocol.avro_container import datum_error
from consumer.protocol.avro_varints import overlong_reason, overlong_varint
from consumer.protocol.checks import MessageChecks
from consumer.protocol.limits import MAX_TSO
from consumer.protocol.model import (
    DDL,
    DML,
    Bootstrap,
    Checksum,
    Column,
    DataType,
    DDLType,
    DecodedMessage,
    DMLType,
    Index,
    KeyOnlyDML,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.parse_errors import utf8_problem
from consumer.protocol.types import fsp_of

AvroVariant = Literal["ticdc", "tiflow"]
NAMESPACE = "com.pingcap.simple.avro"
MESSAGE_BRANCH = 0x16  # zig-zag of union index 11
_DML_KIND = 0x06  # MessageType.DML, zig-zag
_DML_TYPES = tuple(DMLType)
# unsigned/zerofill are set (true or false) only for these types; null for the rest
_FLAGGED_TYPES = frozenset(
    ("tinyint", "smallint", "mediumint", "int", "bigint", "float", "double", "bit", "year", "decimal")
)
_TEMPORAL_WITH_FSP = frozenset(("datetime", "timestamp", "time"))


def writer_schema_json() -> list[dict[str, Any]]:
    """TiCDC's writer schema (`message.json` upstream), as shipped with this package."""
    return json.loads(resources.files("consumer.protocol.simple").joinpath("message.avsc").read_text())


def _wire_schemas() -> tuple[Any, Any, dict[str, Any]]:
    """The whole union, the DML record alone (a DML datum is 3 header bytes, then that record), and their
    named types."""
    schema = writer_schema_json()
    column_schema = next(t for t in schema if t["name"] == "ColumnSchema")
    default = next(f for f in column_schema["fields"] if f["name"] == "default")
    default["type"] = ["null", "bytes"]
    named: dict[str, Any] = {}
    union = fastavro.parse_schema(schema, named)
    return union, fastavro.parse_schema(next(t for t in schema if t["name"] == "DML"), named), named


_SCHEMA, _DML_SCHEMA, _NAMED = _wire_schemas()
DML_PREFIX = bytes((MESSAGE_BRANCH, 0x06, 0x06))  # Message branch, MessageType.DML, payload branch DML


# -- decoding ---------------------------------------------------------------------------------------
_DEFAULT_CHECKS = MessageChecks()


def decode(payload: bytes, checks: MessageChecks = _DEFAULT_CHECKS) -> DecodedMessage:
    """Decode one uncompressed Avro value; DML values stay undecoded in a `RawDML`. The message passes
    `checks` (its commitTs, its schemas)."""
    if len(payload) < 3 or payload[0] != MESSAGE_BRANCH:
        first = f"0x{payload[0]:02x}" if payload else "nothing"
        raise MalformedMessageError(f"not a Simple Avro message: starts with {first}, expected 0x16")
    if payload[1] == _DML_KIND:
        return _dml_header(bytes(payload) if type(payload) is not bytes else payload, checks)  # hashable
    return checks.message(_schema_or_watermark(read_datum(payload)))


def read_datum(payload: bytes) -> dict[str, Any]:
    """The whole Message record; the datum must fill the value exactly."""
    message = _read_exactly(payload, 0, _SCHEMA)
    if not isinstance(message, dict) or "payload" not in message:
        raise MalformedMessageError("Avro datum is not a Message record")
    return message


def read_dml(payload: bytes) -> dict[str, Any]:
    """The DML record of a DML message, read without the union's per-call overhead."""
    if not payload.startswith(DML_PREFIX):
        raise MalformedMessageError("not an Avro DML message")
    return _read_exactly(payload, len(DML_PREFIX), _DML_SCHEMA)


def _read_exactly(payload: bytes, start: int, schema: Any) -> Any:
    """The datum at `payload[start:]`, which must fill the payload, read strictly: fastavro's reading of
    varints of any length is checked after it."""
    stream = io.BytesIO(payload)
    stream.seek(start)
    try:
        datum = fastavro.schemaless_reader(stream, schema, None)
    except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError... for corrupt input
        raise MalformedMessageError(datum_error(exc, stream)) from exc
    if stream.tell() != len(payload):
        raise MalformedMessageError(f"{len(payload) - stream.tell()} bytes of garbage after the Avro datum")
    overlong = overlong_varint(payload, start, schema, _NAMED)
    if overlong is not None:
        raise MalformedMessageError(overlong_reason(overlong))
    return datum


def _dml_header(payload: bytes, checks: MessageChecks) -> RawDML | KeyOnlyDML:
    """Read only the DML's routing fields (and whether it carries only its handle key); values are decoded
    later, once the schema is known."""
    known = known_header(payload, checks)
    if known is not None:
        return known
    reader = _HeaderReader(payload, 2)
    long = reader.long
    if long() != 3:
        raise MalformedMessageError("Avro Message of type DML does not carry a DML payload")
    long()  # version
    database, table, table_id = reader.string(), reader.string(), long()
    kind = long()
    if not 0 <= kind < len(_DML_TYPES):
        raise MalformedMessageError(f"unknown DMLType index {kind}")
    route = _Route(_DML_TYPES[kind], database, table, table_id)
    prefix = payload[: reader.position]
    raw = _raw_dml(payload, route, long(), long(), long(), checks)
    if len(prefix) <= _MAX_PREFIX:  # longer names take this path each time: the memory stays small
        _ROUTES.add(prefix, route)
    position = reader.position
    if payload[position : position + 2] == b"\x00\x00":  # neither claimCheckLocation nor handleKeyOnly
        return raw
    location = reader.string() if reader.branch() else ""  # claimCheckLocation: [null, string]
    key_only = reader.branch() and reader.boolean()  # handleKeyOnly: [null, boolean]
    return KeyOnlyDML(raw, location) if key_only or location else raw


class _Route(NamedTuple):
    type: DMLType
    database: str
    table: str
    table_id: int


class _Routes:
    """A table's DMLs repeat their first header bytes (up to the payload's version, database, table, tableID
    and type): those bytes, once read, are recognised instead of read again.

    Bounded against a hostile variety of prefixes (then it starts again), and safe for the claim-check
    threads that decode at once: a lookup iterates a tuple of lengths that is replaced, never changed.
    """

    def __init__(self) -> None:
        self.by_bytes: dict[bytes, _Route] = {}
        self.lengths: tuple[int, ...] = ()  # the lengths of the known routing bytes

    def add(self, prefix: bytes, route: _Route) -> None:
        lengths = self.lengths
        if len(self.by_bytes) >= _MAX_REMEMBERED or (
            len(prefix) not in lengths and len(lengths) >= _MAX_LENGTHS
        ):
            self.by_bytes, lengths = {}, ()
        self.by_bytes[prefix] = route
        if len(prefix) not in lengths:
            self.lengths = (*lengths, len(prefix))

    def __len__(self) -> int:
        return len(self.by_bytes)


_MAX_REMEMBERED = 4096
_MAX_PREFIX = 512
_MAX_LENGTHS = 32  # each costs a lookup when a header is not known
_ROUTES = _Routes()
# What follows the routing bytes in a full DML: commitTs, buildTs, schemaVersion, and two null unions (no
# claim check)
_TIMES = re.compile(
    rb"([\x80-\xff]{0,9}[\x00-\x7f])([\x80-\xff]{0,9}[\x00-\x7f])([\x80-\xff]{0,9}[\x00-\x7f])\x00\x00"
)


def known_header(payload: bytes, checks: MessageChecks) -> RawDML | None:
    """The header of a full DML whose routing bytes were read before, or None (then `decode` reads it in
    full, and names what is wrong). The hot path of Avro decoding: one flat function, no calls per field."""
    by_bytes = _ROUTES.by_bytes
    for length in _ROUTES.lengths:
        route = by_bytes.get(payload[:length])
        if route is not None:
            break
    else:
        return None
    times = _TIMES.match(payload, length)
    if times is None:
        return None
    commit_group, build_group, version_group = times.groups()
    # commitTs differs in nearly every DML: its high groups (TSO bits 20 and up) are remembered by their
    # bytes, its three low groups computed. Anything unusual (negative, beyond 64 bits) takes the full reading
    high = _HIGH_GROUPS.get(commit_group[3:])
    if high is None:
        high = _remember_high_groups(commit_group)
    if high < 0:
        return None
    low = int.from_bytes(commit_group[:3], "little")
    low = low & 0x7F | (low >> 1) & 0x3F80 | (low >> 2) & 0x1FC000
    build_ts, schema_version = _LONGS.get(build_group), _LONGS.get(version_group)
    if build_ts is None or schema_version is None:  # remembered whole: a stream repeats them
        build_ts, schema_version = _varint(build_group), _varint(version_group)
    if low & 1:  # a negative commitTs
        return None
    return _raw_dml(payload, route, high | low >> 1, build_ts, schema_version, checks)  # the value halved


def known_headers(values: Sequence[bytes | None], checks: MessageChecks) -> list[RawDML | None]:
    """`known_header` of many record values at once: None where it might not give a RawDML (no plain Avro
    DML, an unknown route, longs laid out unlike the rest, a commitTs out of range), and `decode` reads those.
    The longs after the routing bytes are read as columns: a stream's headers share the sizes of their
    longs, so a poll's are checked against one layout and summed at once (numpy)."""
    picked, routes, starts = _routed(values)
    ceiling = checks.clock_ceiling() if picked else 0
    known: list[RawDML | None] = [None] * len(values)
    for first in range(0, len(picked), _HEADER_MATRIX_ROWS):
        indexes = picked[first : first + _HEADER_MATRIX_ROWS]
        payloads: list[bytes] = [values[index] for index in indexes]  # type: ignore[misc]  # routed: bytes
        longs = _HeaderLongs(payloads, starts[first : first + _HEADER_MATRIX_ROWS])
        for row, commit_ts, build_ts, version in longs.rows(ceiling):
            route = routes[first + row]
            known[indexes[row]] = _raw_dml(payloads[row], route, commit_ts, build_ts, version, checks)
    return known


def _routed(values: Sequence[bytes | None]) -> tuple[list[int], list[_Route], list[int]]:
    """The values that start with known routing bytes: their indexes, routes, and the routing bytes' sizes
    (a value is matched as `known_header` matches it: the sizes in order, the first known prefix wins)."""
    by_bytes, lengths = _ROUTES.by_bytes, _ROUTES.lengths
    picked: list[int] = []
    routes: list[_Route] = []
    starts: list[int] = []
    for index, value in enumerate(values):
        if type(value) is bytes:  # as `decode` takes the known-header path; other values are read by it
            for length in lengths:
                route = by_bytes.get(value[:length])
                if route is not None:
                    picked.append(index)
                    routes.append(route)
                    starts.append(length)
                    break
    return picked, routes, starts


class _HeaderLongs:
    """The bytes after each payload's routing bytes (from `starts`) as rows of a matrix: commitTs, buildTs
    and schemaVersion, then the two null unions of a DML that is no claim-check."""

    def __init__(self, payloads: list[bytes], starts: list[int]) -> None:
        # Only each header's bytes are copied (a large row's values are not): a head shorter than its start
        # plus the tail is the whole payload, so the room a header has is read from the heads alone
        heads = [payload[: start + _HEADER_TAIL] for payload, start in zip(payloads, starts, strict=True)]
        sizes = np.fromiter(map(len, heads), np.int64, len(heads))
        self.room = sizes - np.asarray(starts, np.int64)  # the bytes each header may take
        buffer = np.frombuffer(b"".join([*heads, bytes(_HEADER_TAIL)]), np.uint8)
        origins = np.cumsum(sizes) - sizes + np.asarray(starts, np.int64)
        self.tails = buffer[origins[:, None] + np.arange(_HEADER_TAIL)]

    def rows(self, ceiling: int) -> Iterator[tuple[int, int, int, int]]:
        """(row, commitTs, buildTs, schemaVersion) of each row `known_header` certainly reads alike: its longs
        laid out like the first row's (or the first left over's, up to `_LAYOUTS_TRIED` layouts), commitTs in
        (0, ceiling], a schemaVersion that is a TSO."""
        left = np.arange(len(self.tails))
        for _ in range(_LAYOUTS_TRIED):
            if not len(left):
                return
            sizes = _long_sizes(self.tails[left[0]].tobytes())
            fits = np.zeros(len(left), bool)
            if sizes is not None:
                fits, longs = self._read(left, sizes)
                commit_ts, build_ts, version = longs.T
                valid = fits & (commit_ts > 0) & (commit_ts <= ceiling) & (version >= 0)  # else: `decode`
                yield from zip(
                    left[valid].tolist(),
                    commit_ts[valid].tolist(),
                    build_ts[valid].tolist(),
                    version[valid].tolist(),
                    strict=True,
                )
            fits[0] = True  # the first row set the layout: left to `decode` if it did not fit it either
            left = left[~fits]

    def _read(self, rows: np.ndarray, sizes: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray]:
        """Which rows have longs of these sizes, then the null unions, and the three longs of each."""
        end = sum(sizes)
        tails = self.tails[rows, : end + 2]
        final = np.zeros(end + 2, bool)  # where a long's last byte (high bit clear) must be, and the nulls
        final[np.cumsum(sizes) - 1] = True
        fits = (
            ((tails[:, :end] < 0x80) == final[:end]).all(axis=1)
            & (tails[:, end:] == 0).all(axis=1)
            & (self.room[rows] >= end + 2)
        )
        shifts = np.concatenate([7 * np.arange(size, dtype=np.uint64) for size in sizes])
        groups = (tails[:, :end] & 0x7F).astype(np.uint64) << shifts
        zigzag = np.add.reduceat(groups, [0, sizes[0], sizes[0] + sizes[1]], axis=1)  # at most 63 bits
        return fits, (zigzag >> 1).astype(np.int64) ^ -(zigzag & 1).astype(np.int64)


def _long_sizes(tail: bytes) -> tuple[int, int, int] | None:
    """The sizes of the three longs `tail` starts with (None: one is longer than 9 bytes)."""
    sizes = []
    at = 0
    for _ in range(3):
        end = next((j for j in range(at, at + 9) if tail[j] < 0x80), None)
        if end is None:
            return None
        sizes.append(end + 1 - at)
        at = end + 1
    return sizes[0], sizes[1], sizes[2]


_HEADER_MATRIX_ROWS = 4096  # bounds the matrix of a poll's headers
_LAYOUTS_TRIED = 8  # rows laid out unlike these are read one by one
_HEADER_TAIL = 3 * 9 + 2  # three longs of at most 9 bytes, two null unions


def _remember_high_groups(group: bytes) -> int:
    """Half the value of a varint's groups after its third (-1: no such long), remembered by their bytes."""
    high = sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(group[3:])) << 20
    if high >> 63:  # beyond 64 bits
        high = -1
    if len(_HIGH_GROUPS) >= _MAX_REMEMBERED:
        _HIGH_GROUPS.clear()
    _HIGH_GROUPS[group[3:]] = high
    return high


_HIGH_GROUPS: dict[bytes, int] = {}


def _raw_dml(
    payload: bytes, route: _Route, commit_ts: int, build_ts: int, schema_version: int, checks: MessageChecks
) -> RawDML:
    if not 0 < commit_ts <= checks.ceiling:
        checks.commit_ts(commit_ts, "DML")
    if not 0 <= schema_version <= MAX_TSO:  # a TSO beyond 2^63 reads back negative from an Avro long
        raise MalformedMessageError(f"DML schemaVersion {schema_version} is no TSO")
    return RawDML(
        type=route.type,
        database=route.database,
        table=route.table,
        table_id=route.table_id,
        commit_ts=commit_ts,
        build_ts=build_ts,
        schema_version=schema_version,
        payload=payload,
        encoding="avro",
    )


class _HeaderReader:
    def __init__(self, buffer: bytes, position: int) -> None:
        self.buffer = buffer
        self.position = position

    def long(self) -> int:
        position = self.position
        buffer = self.buffer
        if position < len(buffer) and buffer[position] < 0x80:  # one-byte varint: most fields
            self.position = position + 1
            byte = buffer[position]
            return (byte >> 1) ^ -(byte & 1)
        # Several bytes (commitTs, schemaVersion...): at most 10
        window = int.from_bytes(buffer[position : position + 10], "little")
        stops = ~window & _STOP_BITS[min(10, len(buffer) - position)]
        if not stops:  # no final byte within 10 bytes (or the buffer)
            if len(buffer) - position >= 10:
                raise MalformedMessageError(f"{overlong_reason(position)}, in the DML header")
            raise MalformedMessageError("truncated or corrupt Avro DML header")
        last = stops & -stops
        self.position = position + last.bit_length() // 8
        return _varint_value(window & ((last << 1) - 1))

    def branch(self) -> int:
        """The index of a [null, T] union: 0 or 1."""
        index = self.long()
        if index not in (0, 1):
            raise MalformedMessageError(f"Avro union index {index} outside [null, T]")
        return index

    def boolean(self) -> bool:
        if self.position >= len(self.buffer) or self.buffer[self.position] > 1:
            raise MalformedMessageError("truncated or corrupt Avro DML header boolean")
        self.position += 1
        return self.buffer[self.position - 1] == 1

    def string(self) -> str:
        size = self.long()
        end = self.position + size
        if size < 0 or end > len(self.buffer):
            raise MalformedMessageError("truncated Avro DML header string")
        try:
            text = self.buffer[self.position : end].decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = utf8_problem(self.buffer[self.position : end], self.position)
            raise MalformedMessageError(f"Avro DML header: {problem}") from exc
        self.position = end
        return text


def _varint(group: bytes) -> int:
    """The long whose whole varint is `group` (at most 10 bytes). A stream repeats its schema versions, build
    times and a transaction's commitTs: values are remembered by their bytes."""
    value = _LONGS.get(group)
    if value is None:
        value = _varint_value(int.from_bytes(group, "little"))
        if len(_LONGS) >= _MAX_REMEMBERED:
            _LONGS.clear()
        _LONGS[group] = value
    return value


_LONGS: dict[bytes, int] = {}


def _varint_value(window: int) -> int:
    """The long of a varint's bytes read as one little-endian int: its 7-bit groups compacted at once."""
    result = window & _LOW_7
    result = (result & _LANES_16) | ((result >> 8) & _LANES_16) << 7
    result = (result & _LANES_32) | ((result >> 16) & _LANES_32) << 14
    result = (result & _LANES_64) | ((result >> 32) & _LANES_64) << 28
    result = (result & _LANE_128) | ((result >> 64) & _LANE_128) << 56
    if result >> 64:  # a tenth byte carrying more than the 64th bit: no Avro long
        raise MalformedMessageError("Avro long beyond 64 bits in the DML header")
    return (result >> 1) ^ -(result & 1)


def _repeated(lane: int, width: int, count: int) -> int:
    return sum(lane << (width * i) for i in range(count))


# Varint compaction masks: the continuation bits of the first n bytes; each byte's 7 payload bits; the payload
# of pairs of bytes (16-bit lanes), of pairs of pairs... (a 10-byte varint has at most 70 payload bits)
_STOP_BITS = tuple(_repeated(0x80, 8, n) for n in range(11))
_LOW_7 = _repeated(0x7F, 8, 16)
_LANES_16 = _repeated(0x7F, 16, 8)
_LANES_32 = _repeated(0x3FFF, 32, 4)
_LANES_64 = _repeated(0xFFFFFFF, 64, 2)
_LANE_128 = (1 << 56) - 1


def _schema_or_watermark(message: dict[str, Any]) -> Watermark | Bootstrap | DDL:
    kind, body = message["type"], message["payload"]
    try:
        if kind == "WATERMARK":
            return Watermark(commit_ts=body["commitTs"], build_ts=body["buildTs"], version=body["version"])
        if kind == "BOOTSTRAP":
            return Bootstrap(
                table_schema=_table_schema(body["tableSchema"]),
                build_ts=body["buildTs"],
                version=body["version"],
            )
        if kind == "DDL":
            return DDL(
                type=DDLType(body["type"]),
                sql=body["sql"],
                commit_ts=body["commitTs"],
                build_ts=body["buildTs"],
                table_schema=_optional_table_schema(body["tableSchema"]),
                pre_table_schema=_optional_table_schema(body["preTableSchema"]),
                version=body["version"],
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise MalformedMessageError(f"Avro {kind} payload does not match its type: {exc!r}") from exc
    raise MalformedMessageError(f"Avro Message type {kind} does not match its payload")


def _optional_table_schema(record: dict[str, Any] | None) -> TableSchema | None:
    return None if record is None else _table_schema(record)


def _table_schema(record: dict[str, Any]) -> TableSchema:
    return TableSchema(
        database=record["database"],
        table=record["table"],
        table_id=record["tableID"],
        version=record["version"],
        columns=tuple(_column(c) for c in record["columns"]),
        indexes=tuple(
            Index(i["name"], i["unique"], i["primary"], i["nullable"], tuple(i["columns"]))
            for i in record["indexes"]
        ),
    )


def _column(record: dict[str, Any]) -> Column:
    data_type = _data_type(record["dataType"])
    return Column(
        name=record["name"],
        data_type=data_type,
        nullable=record["nullable"],
        default=_default_from_avro(record["default"], data_type),
    )


def _data_type(record: dict[str, Any]) -> DataType:
    mysql_type, decimal = record["mysqlType"], record["decimal"]
    data_type = DataType(
        mysql_type=mysql_type,
        charset=record["charset"],
        collate=record["collate"],
        length=record["length"],
        decimal=decimal or 0,
        elements=tuple(record["elements"] or ()),
        unsigned=bool(record["unsigned"]),
        zerofill=bool(record["zerofill"]),
    )
    if decimal is None and mysql_type in _TEMPORAL_WITH_FSP:  # Avro drops it: recover it from `length`
        return msgspec.structs.replace(data_type, decimal=fsp_of(data_type))
    return data_type


def _default_from_avro(raw: bytes | None, data_type: DataType) -> str | int | None:
    """A binary-charset default holds raw bytes: invalid UTF-8 becomes U+FFFD, as in TiCDC's JSON (Go's
    encoding/json), so a schema reads the same in both encodings and stays encodable as text everywhere
    (schema snapshots, Arrow, JSON)."""
    if raw is None:
        return None
    if data_type.mysql_type == "bit":
        return int.from_bytes(raw, "big")
    return raw.decode("utf-8", "replace")


# -- encoding ---------------------------------------------------------------------------------------
def encode(
    message: Watermark | Bootstrap | DDL | DML,
    data: dict[str, Any] | None = None,
    old: dict[str, Any] | None = None,
    variant: AvroVariant = "ticdc",
) -> bytes:
    """Encode a message; for a DML, `data`/`old` hold (branch, value) pairs from the column types."""
    kind, branch, body = _payload(message, data, old, variant)
    stream = io.BytesIO()
    datum = {"type": kind, "payload": (f"{NAMESPACE}.{branch}", body)}
    fastavro.schemaless_writer(stream, _SCHEMA, (f"{NAMESPACE}.Message", datum))
    return stream.getvalue()


def _payload(
    message: Watermark | Bootstrap | DDL | DML, data: Any, old: Any, variant: AvroVariant
) -> tuple[str, str, dict[str, Any]]:
    if isinstance(message, Watermark):
        return (
            "WATERMARK",
            "Watermark",
            {"version": message.version, "commitTs": message.commit_ts, "buildTs": message.build_ts},
        )
    if isinstance(message, Bootstrap):
        return (
            "BOOTSTRAP",
            "Bootstrap",
            {
                "version": message.version,
                "buildTs": message.build_ts,
                "tableSchema": _table_schema_record(message.table_schema, variant),
            },
        )
    if isinstance(message, DDL):
        return (
            "DDL",
            "DDL",
            {
                "version": message.version,
                "type": message.type.value,
                "sql": message.sql,
                "commitTs": message.commit_ts,
                "buildTs": message.build_ts,
                "tableSchema": _optional_record(message.table_schema, variant),
                "preTableSchema": _optional_record(message.pre_table_schema, variant),
            },
        )
    return (
        "DML",
        "DML",
        {
            "version": message.version,
            "database": message.database,
            "table": message.table,
            "tableID": message.table_id,
            "type": message.type.value,
            "commitTs": message.commit_ts,
            "buildTs": message.build_ts,
            "schemaVersion": message.schema_version,
            "claimCheckLocation": message.claim_check_location or None,
            "handleKeyOnly": True if message.handle_key_only else None,
            "checksum": _checksum_record(message.checksum),
            "data": data,
            "old": old,
        },
    )


def _checksum_record(checksum: Checksum | None) -> dict[str, Any] | None:
    if checksum is None:
        return None
    return {
        "version": checksum.version,
        "corrupted": checksum.corrupted,
        "current": checksum.current,
        "previous": checksum.previous,
    }


def _optional_record(schema: TableSchema | None, variant: AvroVariant) -> dict[str, Any] | None:
    return None if schema is None else _table_schema_record(schema, variant)


def _table_schema_record(schema: TableSchema, variant: AvroVariant) -> dict[str, Any]:
    return {
        "database": schema.database,
        "table": schema.table,
        "tableID": schema.table_id,
        "version": schema.version,
        "columns": [_column_record(c, variant) for c in schema.columns],
        "indexes": [
            {
                "name": i.name,
                "unique": i.unique,
                "primary": i.primary,
                "nullable": i.nullable,
                "columns": list(i.columns),
            }
            for i in schema.indexes
        ],
    }


def _column_record(column: Column, variant: AvroVariant) -> dict[str, Any]:
    data_type = column.data_type
    mysql_type = data_type.mysql_type
    flagged = mysql_type in _FLAGGED_TYPES
    keeps_decimal = mysql_type == "decimal" or (mysql_type == "timestamp" and variant == "ticdc")
    return {
        "name": column.name,
        "dataType": {
            "mysqlType": mysql_type,
            "charset": data_type.charset,
            "collate": data_type.collate,
            "length": data_type.length,
            "decimal": data_type.decimal if keeps_decimal else None,
            "elements": list(data_type.elements) if mysql_type in ("enum", "set") else None,
            "unsigned": data_type.unsigned if flagged else None,
            "zerofill": data_type.zerofill if flagged else None,
        },
        "nullable": column.nullable,
        "default": _default_to_avro(column.default, data_type),
    }


def _default_to_avro(default: str | int | None, data_type: DataType) -> bytes | None:
    if default is None:
        return None
    if isinstance(default, int):  # BIT: the literal's raw big-endian bytes
        width = max(1, (max(data_type.length, 1) + 7) // 8)
        return default.to_bytes(width, "big")
    return default.encode("utf-8", "surrogateescape")
