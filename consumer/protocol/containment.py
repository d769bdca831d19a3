"""The decoders' containment boundary: whatever a record's bytes hold, only `ConsumerError`s come out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from consumer.errors import ConsumerError, InternalDecodeError, NestingTooDeepError


@contextlib.contextmanager
def contained(what: str) -> Iterator[None]:
    """Turn anything unanticipated raised while `what` (e.g. "decoding rows") into an `InternalDecodeError`,
    so the record goes to the error policy instead of stopping the consumer. A native reader's panic
    (pyo3's PanicException) is a BaseException, so it is caught too; interrupts are not."""
    try:
        yield
    except (ConsumerError, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except RecursionError as exc:
        raise NestingTooDeepError(f"nested deeper than Python's recursion limit while {what}") from exc
    except BaseException as exc:
        raise InternalDecodeError(f"unexpected {type(exc).__name__} {what}: {exc}") from exc
