"""A decode error's reason is the SDK's own (`consumer.protocol.parse_errors`): the same words whatever the
parser's release says, naming the field and the byte."""

from __future__ import annotations

import io

import fastavro
import msgspec
import pytest

from consumer.errors import ClaimCheckInvalidError, MalformedMessageError
from consumer.large_messages.claim_check import unwrap
from consumer.protocol.parse_errors import Problem, datum_problem, json_problem, utf8_problem
from consumer.protocol.simple import json_messages


class _Inner(msgspec.Struct):
    a: int
    b: str = ""


class _Outer(msgspec.Struct, forbid_unknown_fields=True):
    s: _Inner
    n: dict[str, int] | None = None


def _problem(document: bytes, decoder: msgspec.json.Decoder) -> str:
    with pytest.raises(Exception) as caught:
        decoder.decode(document)
    return str(json_problem(caught.value, document))


TYPED = msgspec.json.Decoder(_Outer)


@pytest.mark.parametrize(
    ("document", "words"),
    [
        (b'{"s":{"a":1,"b":"x\xffy"}}', "invalid UTF-8 at byte 18 (0xff), in `s.b`"),
        (b'{"s":{"a":1,"b":"\\"x\\\\"},"n":{"k\xfe":2}}', "invalid UTF-8 at byte 32 (0xfe), in `n`"),
        (b'{"s":{"a":1,"b":"x"', "the JSON ends early (after 19 bytes)"),
        (b'{"s":{"a":1}} x', "bytes after the JSON document, from byte 15"),
        (b'{"s" {', "not valid JSON at byte 5"),
        (b'{"s":{"a":"1"}}', "expected an integer, got a string, in `s.a`"),
        (b'{"s":{}}', "missing field `a`, in `s`"),
        (b'{"s":{"a":1},"z":1}', "unknown field `z`"),
        (b'{"s":{"a":1e999}}', "a number out of range, in `s.a`"),
        (b'[{"s":1}]', "expected an object, got an array"),
    ],
    ids=["utf8", "utf8-key", "cut", "trailing", "syntax", "type", "missing", "unknown", "range", "array"],
)
def test_json_problems_say_what_and_where(document: bytes, words: str) -> None:
    assert _problem(document, TYPED) == words


def test_invalid_utf8_reads_the_same_from_either_msgspec_release() -> None:
    """msgspec before 0.23 raised Python's UnicodeDecodeError (offset within the string), 0.23 its own
    DecodeError without one: both give the offset in the document and the field."""
    document = b'{"n":{"k":"ab\xc3("}}'
    older = UnicodeDecodeError("utf-8", b"ab\xc3(", 2, 3, "invalid continuation byte")
    newer = msgspec.DecodeError("Invalid UTF-8 encoded string")
    assert str(json_problem(older, document)) == str(json_problem(newer, document))
    assert str(json_problem(newer, document)) == "invalid UTF-8 at byte 13 (0xc3), in `n.k`"


def test_the_path_survives_escaped_quotes_arrays_and_nesting() -> None:
    document = b'{"a":[1,{"b\\"":"x"},{"c":["ok","\xff"]}]}'
    at = document.index(b"\xff")
    assert _problem(document, msgspec.json.Decoder()) == f"invalid UTF-8 at byte {at} (0xff), in `a[2].c[1]`"


def test_a_problem_names_the_column_under_a_row_image() -> None:
    problem = Problem("expected an integer, got a string", "data.ts.value")
    assert problem.column(("data", "old")) == "ts"
    assert problem.column(("data", "old"), ("ts.value", "ts")) == "ts.value"  # a name may hold dots
    assert problem.column(("before", "after")) is None
    assert Problem("invalid UTF-8 at byte 3 (0xff)", "data").column(("data", "old")) is None


def test_utf8_problems_count_from_the_base() -> None:
    assert str(utf8_problem(b"ok\xe2\x82", 10)) == "invalid UTF-8 at byte 12 (0xe2 0x82)"
    assert utf8_problem("ünïcode".encode()) is None


SCHEMA = fastavro.parse_schema(
    {
        "type": "record",
        "name": "r",
        "fields": [
            {"name": "a", "type": "string"},
            {"name": "b", "type": ["null", "long"]},
            {"name": "c", "type": "double"},
        ],
    }
)


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"\x06a\xff\xfe\x02\x02", "invalid UTF-8 at byte 2 (0xff)"),
        (b"\x04ab\x08", "a union branch or enum symbol beyond the schema's, before byte 4"),
        (b"\x04ab\x00\x00\x00", "the datum is cut short: its schema reads beyond its last byte (5)"),
        (b"\x08ab", "the datum is cut short: its schema reads beyond its last byte (2)"),
    ],
    ids=["utf8", "union-index", "cut-double", "cut-string"],
)
def test_avro_datum_problems_say_what_and_where(payload: bytes, words: str) -> None:
    stream = io.BytesIO(payload)
    with pytest.raises(Exception) as caught:
        fastavro.schemaless_reader(stream, SCHEMA, None)
    assert str(datum_problem(caught.value, payload, stream.tell())) == words


def test_message_and_claim_check_reasons_carry_the_sdks_words() -> None:
    with pytest.raises(MalformedMessageError) as caught:
        json_messages.decode(b'{"type":"WATERMARK","commitTs":"5"}')
    assert str(caught.value) == "invalid JSON message: expected an integer, got a string, in `commitTs`"
    with pytest.raises(ClaimCheckInvalidError) as refused:
        unwrap(b'{"key":null,"value":"*"}', raw_value=False)
    assert str(refused.value).endswith("envelope: not valid base64, in `value`")
