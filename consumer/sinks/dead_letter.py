"""Where records the error policy sets aside go: a JSON-lines file or a Kafka topic. Never dropped.

Each letter carries its origin (topic, partition, offset), the reason, the machine-readable `reason_code`
(the `code` of the error that set it aside), and the bytes a replay decodes again: the value and, where the
record itself was set aside, its key (TiCDC Avro routes rows by their key's schema; a tombstone is only a
key). `read_letters` gives them back from any destination (`consumer.redrive` replays them).
"""

from __future__ import annotations

import base64
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Protocol

import msgspec
import pyarrow.fs as pafs
from confluent_kafka import KafkaError, KafkaException, Producer

from consumer.errors import DeadLetter, RecordLocation, SinkError
from consumer.kafka_config import create_client, scrubbed, secret_values
from consumer.lakehouse.layout import segment


class DeadLetterQueue(Protocol):
    """Where the error policy puts records it sets aside (a file, object-store objects or a Kafka topic).
    Not a `Sink`: it takes whole records, never typed rows, and has no schema or offset bookkeeping."""

    def write(self, letter: DeadLetter) -> None:
        """Durable when it returns: only then is the record's offset committable."""

    def close(self) -> None: ...


class _Letter(msgspec.Struct):
    topic: str
    partition: int
    offset: int
    reason: str
    value: str | None  # standard base64 of the raw record value
    reason_code: str = ""  # letters written before reason codes have none
    key: str | None = None  # standard base64 of the record's key; letters written before keys have none

    @classmethod
    def of(cls, letter: DeadLetter) -> _Letter:
        where = letter.location
        return cls(
            where.topic,
            where.partition,
            where.offset,
            letter.reason,
            _text(letter.value),
            letter.reason_code,
            _text(letter.key),
        )


class StoredLetter(msgspec.Struct, frozen=True):
    """A letter as a destination holds it: the record's origin, why it was set aside, and its bytes."""

    topic: str
    partition: int
    offset: int
    reason: str
    reason_code: str
    key: bytes | None
    value: bytes | None

    @property
    def location(self) -> RecordLocation:
        return RecordLocation(self.topic, self.partition, self.offset)


def _text(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text, validate=True)


class _Origin(msgspec.Struct):
    """The part of a letter that says which record it is."""

    topic: str
    partition: int
    offset: int


class _Coded(_Origin):
    reason_code: str = ""


def read_letters(target: str, storage_options: Mapping[str, str] | None = None) -> list[StoredLetter]:
    """The letters in a dead-letter file (a path) or under an object-store prefix or directory (a URI), in
    origin order, each record once (the copy written last: a replay before the commit covering it writes
    it again). A torn line (a crash mid-write) or one that is no letter is skipped."""
    decoder = msgspec.json.Decoder(_Letter)
    letters: dict[tuple[str, int, int], StoredLetter] = {}
    for line in _lines(target, storage_options):
        try:
            letter = decoder.decode(line)
            stored = StoredLetter(
                letter.topic,
                letter.partition,
                letter.offset,
                letter.reason,
                letter.reason_code,
                _bytes(letter.key),
                _bytes(letter.value),
            )
        except (msgspec.DecodeError, ValueError):  # binascii.Error is a ValueError
            continue
        letters[stored.topic, stored.partition, stored.offset] = stored
    return [letters[origin] for origin in sorted(letters)]


def letter_of_record(
    key: bytes | None, value: bytes | None, headers: Mapping[str, bytes | None]
) -> StoredLetter:
    """A letter `DeadLetterTopic` produced, from the record read back; raises ValueError when the headers
    do not say where it came from (not a letter). Letters produced before the origin headers existed
    name it in `ticdc.source` only (`topic[partition]@offset`)."""
    reason = (headers.get("ticdc.reason") or b"").decode(errors="replace")
    code = (headers.get("ticdc.reason_code") or b"").decode(errors="replace")
    topic, partition, offset = (
        headers.get("ticdc.topic"),
        headers.get("ticdc.partition"),
        headers.get("ticdc.offset"),
    )
    if topic is not None and partition is not None and offset is not None:
        return StoredLetter(topic.decode(), int(partition), int(offset), reason, code, key, value)
    source = (headers.get("ticdc.source") or b"").decode()
    rest, _, offset_text = source.rpartition("@")
    topic_text, _, partition_text = rest.rpartition("[")
    if not topic_text or not partition_text.endswith("]"):
        raise ValueError(f"not a dead letter: no origin headers ({source!r})")
    return StoredLetter(topic_text, int(partition_text[:-1]), int(offset_text), reason, code, key, value)


def count_letters(target: str, storage_options: Mapping[str, str] | None = None) -> dict[str, int]:
    """Letters per `reason_code` in a dead-letter file (a path) or under an object-store prefix or directory
    (a URI); a record set aside twice (a replay before the commit covering it) counts once."""
    lines = _lines(target, storage_options)
    decoder = msgspec.json.Decoder(_Coded)
    codes: dict[tuple[str, int, int], str] = {}
    for line in lines:
        try:
            letter = decoder.decode(line)
        except msgspec.DecodeError:  # a torn last line, from a crash mid-write
            continue
        codes[letter.topic, letter.partition, letter.offset] = letter.reason_code
    return dict(Counter(codes.values()))


def _lines(target: str, storage_options: Mapping[str, str] | None) -> Iterator[bytes]:
    return _object_lines(target, storage_options) if "://" in target else _file_lines(Path(target))


def _file_lines(path: Path) -> Iterator[bytes]:
    if path.exists():
        with path.open("rb") as file:
            yield from file


def _object_lines(uri: str, storage_options: Mapping[str, str] | None) -> Iterator[bytes]:
    from consumer.lakehouse.storage import LakeRoot  # delta-rs loads only for object-store letters

    filesystem, prefix = LakeRoot.of(uri, storage_options).filesystem()
    selector = pafs.FileSelector(prefix, recursive=True, allow_not_found=True)
    for info in filesystem.get_file_info(selector):
        if info.type == pafs.FileType.File and info.path.endswith(".json"):
            with filesystem.open_input_stream(info.path) as stream:
                yield stream.read()


class DeadLetterFile:
    """Appends one JSON line per letter and fsyncs it. A record already in the file (replayed after a
    restart, before the commit that covered it) is not written twice: the origins in the file are read
    once, when it is opened."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._written = _origins(self.path)
        self._file = self.path.open("ab")
        self._encoder = msgspec.json.Encoder()

    def write(self, letter: DeadLetter) -> None:
        where = letter.location
        origin = (where.topic, where.partition, where.offset)
        if origin in self._written:
            return
        self._file.write(self._encoder.encode(_Letter.of(letter)) + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._written.add(origin)

    def close(self) -> None:
        self._file.close()


class DeadLetterObjects:
    """One object per letter under an object-store prefix (or a directory):
    `<prefix>/<topic>/<partition>/<offset>.json`, holding the letter's JSON line. Object stores cannot
    append; a letter written again (a replay) replaces its own object, so there are no duplicates."""

    def __init__(self, uri: str, storage_options: Mapping[str, str] | None = None) -> None:
        from consumer.lakehouse.storage import LakeRoot  # delta-rs loads only for object-store letters

        self._filesystem, self._prefix = LakeRoot.of(uri, storage_options).filesystem()
        self._encoder = msgspec.json.Encoder()

    def write(self, letter: DeadLetter) -> None:
        where = letter.location
        directory = f"{self._prefix}/{segment(where.topic)}/{where.partition}"
        self._filesystem.create_dir(directory, recursive=True)
        with self._filesystem.open_output_stream(f"{directory}/{where.offset:020d}.json") as out:
            out.write(self._encoder.encode(_Letter.of(letter)) + b"\n")

    def close(self) -> None:
        return None


class DeadLetterTopic:
    """Produces the raw key and value to a Kafka topic with the reason and origin in headers (`ticdc.topic`,
    `ticdc.partition`, `ticdc.offset`; `ticdc.source` says all three as text); waits for the ack.

    `config`: the producer's own librdkafka settings (`[errors.kafka]`: TLS, SASL...), not the consumer's:
    the dead-letter topic may live on other brokers, with other credentials. Its secrets never reach an error.
    """

    def __init__(
        self, bootstrap_servers: str, topic: str, config: Mapping[str, object] | None = None
    ) -> None:
        self.topic = topic
        settings = {**(config or {}), "bootstrap.servers": bootstrap_servers, "acks": "all"}
        self._secrets = secret_values(settings)
        producer = create_client(Producer, settings)
        if isinstance(producer, KafkaError):
            raise self._error(f"cannot create the dead-letter producer for {topic!r}", producer)
        self._producer = producer

    def write(self, letter: DeadLetter) -> None:
        errors: list[str] = []
        where = letter.location
        headers: dict[str, str | bytes | None] = {
            "ticdc.reason": letter.reason.encode(),
            "ticdc.reason_code": letter.reason_code.encode(),
            "ticdc.source": str(where).encode(),
            "ticdc.topic": where.topic.encode(),
            "ticdc.partition": str(where.partition).encode(),
            "ticdc.offset": str(where.offset).encode(),
        }
        try:
            self._producer.produce(
                self.topic,
                key=letter.key,
                value=letter.value,
                headers=headers,
                on_delivery=lambda err, _msg: errors.append(err.str()) if err else None,
            )
        except KafkaException as exc:
            raise self._error(f"dead letter for {where} not produced", exc.args[0]) from None
        if self._producer.flush(30) or errors:
            failure = scrubbed("; ".join(errors) or "timeout", self._secrets)
            raise SinkError(f"dead letter for {where} not acknowledged: {failure}")

    def close(self) -> None:
        self._producer.flush(30)

    def _error(self, context: str, error: KafkaError) -> SinkError:
        return SinkError(scrubbed(f"{context}: {error.str()}", self._secrets))


def _origins(path: Path) -> set[tuple[str, int, int]]:
    """Origins of the letters a file holds (a torn last line, from a crash mid-write, is skipped)."""
    if not path.exists():
        return set()
    decoder = msgspec.json.Decoder(_Origin)
    origins = set()
    with path.open("rb") as file:
        for line in file:
            try:
                letter = decoder.decode(line)
            except msgspec.DecodeError:
                continue
            origins.add((letter.topic, letter.partition, letter.offset))
    return origins
