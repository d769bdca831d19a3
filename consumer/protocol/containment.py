"""The decoders' containment boundary: whatever a record's bytes hold, only `ConsumerError`s come out."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import NoReturn, Protocol

from consumer.errors import ConsumerError, DependencyError, InternalDecodeError, NestingTooDeepError
from consumer.protocol.model import DecodedMessage, RawDML


class KeyedValue(Protocol):
    """A Kafka record as a decoder reads it (a `SourceRecord` is one)."""

    @property
    def key(self) -> bytes | None: ...

    @property
    def value(self) -> bytes | None: ...


@contextlib.contextmanager
def contained(what: str) -> Iterator[None]:
    """Turn anything unanticipated raised while `what` (e.g. "decoding rows") into an `InternalDecodeError`,
    so the record goes to the error policy instead of stopping the consumer. A native reader's panic
    (pyo3's PanicException) is a BaseException, so it is caught too; interrupts are not."""
    try:
        yield
    except BaseException as exc:
        raise_contained(exc, what)


def raise_contained(exc: BaseException, what: str) -> NoReturn:
    """What `contained` raises for `exc`, for the per-record hot paths, where a generator-based context
    manager costs more than the record's routing (`try: ... except BaseException as exc:
    raise_contained(exc, what)` is free until something is raised)."""
    if isinstance(exc, ConsumerError | KeyboardInterrupt | SystemExit | GeneratorExit):
        raise exc
    if isinstance(exc, RecursionError):
        raise NestingTooDeepError(f"nested deeper than Python's recursion limit while {what}") from exc
    raise InternalDecodeError(f"unexpected {type(exc).__name__} {what}: {exc}") from exc


def decoded_each(
    decode: Callable[[bytes | None, bytes | None], DecodedMessage],
    records: Sequence[KeyedValue],
    known: Sequence[RawDML | None] | None = None,
) -> list[DecodedMessage | ConsumerError]:
    """Each record's message, or the error that sends it to the error policy; `known`: messages
    read before for many records at once (None where `decode` reads the record). A dependency's error (the
    schema registry is down) is no record's fault: it is raised, and stops the batch."""
    decoded: list[DecodedMessage | ConsumerError] = []
    for index, record in enumerate(records):
        read = known[index] if known is not None else None
        if read is not None:
            decoded.append(read)
            continue
        try:
            decoded.append(decode(record.key, record.value))
        except DependencyError:
            raise
        except ConsumerError as exc:
            decoded.append(exc)
    return decoded
