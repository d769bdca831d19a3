"""Errors raised by sources: the broker or client failed, or a capture file is corrupt."""

from __future__ import annotations

from pathlib import Path

from consumer.errors import ConsumerError


class SourceError(ConsumerError):
    """Reading from or committing to the source failed.

    `client_code` is librdkafka's error name (e.g. "UNKNOWN_TOPIC_OR_PART") when the client reported one, so
    a caller can decide on retrying without parsing the message.
    """

    code = "source-error"

    def __init__(self, message: str, *, client_code: str | None = None, retriable: bool = False) -> None:
        super().__init__(message)
        self.client_code = client_code
        self.retriable = retriable


class SourceAuthenticationError(SourceError):
    """The brokers refused this client's credentials or TLS handshake: retrying cannot help."""

    code = "source-authentication"


class SourceUnreachableError(SourceError):
    """No broker could be reached for longer than the source's `unreachable_timeout`."""

    code = "source-unreachable"


class CaptureFormatError(SourceError):
    """A capture file line is not a valid record."""

    code = "capture-format"

    def __init__(self, path: str | Path, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = Path(path)
        self.line = line
