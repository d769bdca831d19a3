"""The SDK's own words for what a parser refused: which field, which byte, what was wrong.

msgspec, fastavro and Python's codecs word their errors as they please, and reword them between releases
(msgspec 0.23 turned a `UnicodeDecodeError` into "Invalid UTF-8 encoded string"). A decode error's reason is
what a dead letter records and what users match on, so it is made here from what the parser's error tells
(its kind, the path or byte it names) and from the bytes themselves (where the UTF-8 breaks), never quoted.
The parser's own error stays the reason's `__cause__`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

# msgspec: invalid UTF-8 inside a string is a UnicodeDecodeError before 0.23, a DecodeError from it on.
JSON_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError)


@dataclass(frozen=True)
class Problem:
    """What was wrong (`reason`) and where: the dotted JSON path of the value (`path`, "" for none known).
    `field` is the name of a field the reason is about (missing, unknown), the last part of `path`."""

    reason: str
    path: str = ""
    field: str = ""

    def __str__(self) -> str:
        if self.field:
            parent = self.path[: len(self.path) - len(self.field)].rstrip(".")
            return f"{self.reason} `{self.field}`" + (f", in `{parent}`" if parent else "")
        return f"{self.reason}, in `{self.path}`" if self.path else self.reason

    def column(self, images: tuple[str, ...], columns: tuple[str, ...] = ()) -> str | None:
        """The column the path points into under one of the row `images` (e.g. `data.name` -> `name`): the
        longest of `columns` the rest starts with (a name may hold dots), else its first part."""
        image, _, rest = self.path.partition(".")
        if image not in images or not rest:
            return None
        named = [c for c in columns if rest == c or rest.startswith((c + ".", c + "["))]
        return max(named, key=len) if named else re.split(r"[.\[]", rest, maxsplit=1)[0] or None


def utf8_problem(data: bytes, base: int = 0) -> Problem | None:
    """The first invalid UTF-8 sequence of `data` (its offset counted from `base`), or None."""
    found = _first_invalid_utf8(data)
    return None if found is None else Problem(_utf8_reason(base + found[0], found[1]))


def _first_invalid_utf8(data: bytes) -> tuple[int, bytes] | None:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return exc.start, data[exc.start : exc.end]
    return None


def _utf8_reason(offset: int, bad: bytes) -> str:
    return f"invalid UTF-8 at byte {offset} ({' '.join(f'0x{b:02x}' for b in bad[:4])})"


def json_problem(exc: BaseException, document: bytes | str) -> Problem:
    """What made msgspec refuse `document` (one of `JSON_ERRORS`), in the SDK's words."""
    data = document.encode() if isinstance(document, str) else bytes(document)
    text = str(exc)
    if isinstance(exc, UnicodeDecodeError) or "utf-8" in text.lower():
        found = _first_invalid_utf8(data)
        if found is None:
            return Problem("invalid UTF-8 in a string")
        return Problem(_utf8_reason(*found), _path_at(data, found[0]))
    at = _AT.search(text)
    path = _dotted(at.group(1)) if at else ""
    if isinstance(exc, msgspec.ValidationError):
        return _invalid_value(text[: at.start()] if at else text, path)
    offset = _BYTE.search(text)
    if "truncated" in text.lower():
        return Problem(f"the JSON ends early (after {len(data)} bytes)")
    if offset is None:
        return Problem("not valid JSON")
    where = int(offset.group(1))
    if "trailing" in text.lower():
        return Problem(f"bytes after the JSON document, from byte {where}")
    return Problem(f"not valid JSON at byte {where}")


def _invalid_value(text: str, path: str) -> Problem:
    """A ValidationError's kind: msgspec names the expected and found types, a missing or unknown field."""
    field = _FIELD.search(text)
    if field is not None:
        reason = "missing field" if "missing" in text.lower() else "unknown field"
        name = field.group(1)
        return Problem(reason, f"{path}.{name}" if path else name, field=name)
    if "base64" in text.lower():
        return Problem("not valid base64", path)
    types = _EXPECTED.search(text)
    if types is not None and types.group(2):
        return Problem(f"expected {_noun(types.group(1))}, got {_noun(types.group(2))}", path)
    if types is not None:
        return Problem(f"{_noun(types.group(1))} out of range", path)
    if "out of range" in text.lower():
        return Problem("a number out of range", path)
    return Problem("a value of the wrong type or range", path)


_AT = re.compile(r" - at `\$(.*)`$")
_BYTE = re.compile(r"\(byte (\d+)\)")
_FIELD = re.compile(r"field `(.+?)`")
_EXPECTED = re.compile(r"Expected `(.+?)`(?:, got `(.+?)`)?")
_NOUNS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "null": "null",
    "object": "an object",
    "array": "an array",
    "bytes": "base64 text",
}


def _noun(types: str) -> str:
    return " or ".join(_NOUNS.get(t.strip(), f"`{t.strip()}`") for t in types.split("|"))


def _dotted(path: str) -> str:
    """msgspec's `$.data.name` / `$[0].x` / `$.data[...]` -> `data.name` / `[0].x` / `data`."""
    return path.replace("[...]", "").lstrip(".")


_TOKENS = re.compile(rb'["{}\[\],]')
_STRING_END = re.compile(rb'(?:[^"\\]|\\.)*"', re.DOTALL)


def _path_at(data: bytes, offset: int) -> str:
    """The dotted path of the JSON value whose text holds byte `offset` (an object's, for a byte in a key):
    a scan of the document up to that byte, which needs no valid UTF-8 and no end."""
    frames: list[list[object]] = []  # ["{", key, expecting a key] or ["[", index]
    position = 0
    while True:
        token = _TOKENS.search(data, position, offset)
        if token is None:
            break
        kind = token.group()
        position = token.end()
        if kind == b'"':
            end = _STRING_END.match(data, position)
            if end is None or end.end() > offset:
                break  # the byte is in this string
            if frames and frames[-1][0] == "{" and frames[-1][2]:
                frames[-1][1:] = [data[position : end.end() - 1].decode("utf-8", "replace"), False]
            position = end.end()
        elif kind in b"{[":
            frames.append(["{", "", True] if kind == b"{" else ["[", 0])
        elif kind in b"}]":
            if frames:
                frames.pop()
        elif frames:  # a comma
            frame = frames[-1]
            if frame[0] == "{":
                frame[2] = True
            else:
                frame[1] = int(str(frame[1])) + 1
    parts: list[str] = []
    for frame in frames:
        if frame[0] == "[":
            parts.append(f"[{frame[1]}]")
        elif not frame[2]:
            parts.append(f".{frame[1]}")
    return "".join(parts).lstrip(".")


def datum_problem(exc: BaseException, payload: bytes, read_to: int) -> Problem:
    """What made fastavro refuse the datum in `payload`, its reading at byte `read_to` when it failed (byte
    offsets are the payload's): fastavro names neither the field nor the byte."""
    if isinstance(exc, UnicodeDecodeError):  # fastavro had read the string's bytes, then decoded them
        start = read_to - len(exc.object)
        found = _first_invalid_utf8(payload[start:read_to]) if 0 <= start <= read_to else None
        return Problem(_utf8_reason(start + found[0], found[1]) if found else "invalid UTF-8 in a string")
    if isinstance(exc, IndexError):
        return Problem(f"a union branch or enum symbol beyond the schema's, before byte {read_to}")
    if isinstance(exc, EOFError) or read_to >= len(payload):
        return Problem(f"the datum is cut short: its schema reads beyond its last byte ({len(payload) - 1})")
    return Problem(f"bytes that do not fit the schema, before byte {read_to}")
