"""Claim-check storage: objects are read only under configured roots, through one filesystem layer.

A claim-check location comes from a Kafka message, i.e. from whoever can produce to the topic, so it is
treated as hostile: it is read only when, after normalisation, it lies under one of `claim_check_roots`
(same scheme family, same bucket, a segment-wise path prefix, no `.`/`..` segment, and for local files no
symlink leading out of the root). Anything else is refused before any filesystem call. The filesystem of
a root is built from the root's own URI (`pyarrow.fs`: local files, S3, GCS, Azure; options such as
`?endpoint_override=` in the URI, credentials from the usual environment), never from the message, so a
message cannot make the consumer connect anywhere.
"""

from __future__ import annotations

import os
import re
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from consumer.errors import (
    ClaimCheckMissingError,
    ClaimCheckNotAllowedError,
    ClaimCheckTooLargeError,
    ClaimCheckUnavailableError,
)

MiB = 1 << 20
DEFAULT_MAX_OBJECT_BYTES = 128 * MiB
DEFAULT_RETRIES = 4
_BACKOFF_S = 0.1  # doubled after each failed attempt
_BACKOFF_MAX_S = 2.0
# TiDB's external-storage schemes and pyarrow's, by the storage they name.
_FAMILIES = {
    "file": "file",
    "local": "file",
    "s3": "s3",
    "gs": "gs",
    "gcs": "gs",
    "abfs": "azure",
    "abfss": "azure",
    "azure": "azure",
    "azblob": "azure",
}
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")  # TiCDC writes `<uuid4>.json`
_MAX_LOCATION = 1024  # S3's own limit for a key


@dataclass(frozen=True, slots=True)
class StoragePath:
    """A normalised storage location: scheme family, bucket ("" for local files) and path segments."""

    family: str
    bucket: str
    segments: tuple[str, ...]

    def under(self, root: StoragePath) -> bool:
        return (
            self.family == root.family
            and self.bucket == root.bucket
            and len(self.segments) > len(root.segments)
            and self.segments[: len(root.segments)] == root.segments
        )


def parse_location(uri: str) -> StoragePath:
    """Split a storage URI; anything that is not a plain location in a known storage is refused."""
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        raise ClaimCheckNotAllowedError(f"claim-check location not allowed: {uri!r} is not a URI") from exc
    family = _FAMILIES.get(parts.scheme.lower())
    problem = _problem(uri, parts.query, parts.fragment, family)
    if problem is None and family is not None:
        bucket = _bucket(family, parts.netloc)
        segments = tuple(segment for segment in parts.path.split("/") if segment)
        if any(segment in (".", "..") for segment in segments):
            problem = "it has `.` or `..` segments"
        elif family == "file" and bucket not in ("", "localhost"):
            problem = "a file URI names no host"
        elif family != "file" and not bucket:
            problem = "it names no bucket"
        else:
            return StoragePath(family, "" if family == "file" else bucket, segments)
    raise ClaimCheckNotAllowedError(f"claim-check location not allowed: {uri!r}: {problem}")


def _problem(uri: str, query: str, fragment: str, family: str | None) -> str | None:
    if family is None:
        return "not a storage scheme this consumer reads"
    if query or fragment or "\x00" in uri:
        return "a location carries no query, fragment or NUL"
    return None


def _bucket(family: str, netloc: str) -> str:
    """The bucket (container for Azure: `container@account...` or `azure://container/`)."""
    return netloc.partition("@")[0] if family == "azure" else netloc


@dataclass
class StorageStats:
    """What the store did: fetched objects and bytes, time spent reading, retried attempts, refusals."""

    fetches: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    refused: int = 0


class ClaimCheckRoot:
    """One allowed prefix and the filesystem that reads under it."""

    def __init__(self, uri: str, filesystem: pafs.FileSystem | None = None) -> None:
        self.uri = uri
        self.path = parse_location(uri.split("?", 1)[0])
        if filesystem is None:
            filesystem = pafs.LocalFileSystem() if self._local else pafs.FileSystem.from_uri(uri)[0]
        self.filesystem = filesystem
        self._real_root = os.path.realpath("/" + "/".join(self.path.segments)) if self._local else ""

    @property
    def _local(self) -> bool:
        return self.path.family == "file"

    def filesystem_path(self, location: StoragePath, max_bytes: int) -> str:
        """Where `location` (under this root) is in the root's filesystem. A local path is resolved, and
        refused when a symlink leads out of the root, it is not a regular file (a FIFO would block), or it
        is larger than `max_bytes`."""
        if not self._local:
            return "/".join((location.bucket, *location.segments))
        real = os.path.realpath("/" + "/".join(location.segments))
        if os.path.commonpath((real, self._real_root)) != self._real_root:
            raise ClaimCheckNotAllowedError(
                f"claim-check location not allowed: a symlink leads out of {self.uri!r}"
            )
        try:
            found = os.stat(real)
        except FileNotFoundError:
            raise ClaimCheckMissingError(f"claim-check object {real!r} does not exist") from None
        if not stat.S_ISREG(found.st_mode):
            raise ClaimCheckMissingError(f"claim-check object {real!r} is not a regular file")
        if found.st_size > max_bytes:
            raise ClaimCheckTooLargeError(
                f"claim-check object {real!r} is larger than max_object_bytes ({max_bytes})"
            )
        return real

    def relocated(self, name: str) -> StoragePath:
        return StoragePath(self.path.family, self.path.bucket, (*self.path.segments, name))


@dataclass
class ClaimCheckStore:
    """Reads claim-check objects under `roots` (or, with `override`, an object's base name under that one
    root: TiCDC's own consumer reads claim-checks so, for users who moved the files).

    Objects above `max_object_bytes` are refused unread. Failed reads are retried `retries` times with
    exponential backoff; an object that does not exist is not retried (TiCDC writes it before the message).
    """

    roots: Sequence[ClaimCheckRoot]
    override: ClaimCheckRoot | None = None
    max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES
    retries: int = DEFAULT_RETRIES
    stats: StorageStats = field(default_factory=StorageStats)
    _counting: threading.Lock = field(default_factory=threading.Lock, repr=False)  # reads run in threads

    @classmethod
    def from_uris(
        cls,
        roots: Sequence[str],
        override: str = "",
        *,
        filesystems: Mapping[str, pafs.FileSystem] | None = None,
        max_object_bytes: int = DEFAULT_MAX_OBJECT_BYTES,
        retries: int = DEFAULT_RETRIES,
    ) -> ClaimCheckStore:
        """Build from root URIs; `filesystems` may supply a root's filesystem by its URI."""
        given = filesystems or {}
        return cls(
            [ClaimCheckRoot(uri, given.get(uri)) for uri in roots],
            ClaimCheckRoot(override, given.get(override)) if override else None,
            max_object_bytes,
            retries,
        )

    def read(self, uri: str) -> bytes:
        """The object's bytes; raises a `LargeMessageError` saying why it was not read."""
        try:
            root, location = self._allowed(uri)
        except ClaimCheckNotAllowedError:
            with self._counting:
                self.stats.refused += 1
            raise
        started = time.monotonic()
        for attempt in range(self.retries + 1):
            try:
                value = self._read_once(root, location, uri)
                break
            except FileNotFoundError:
                raise ClaimCheckMissingError(f"claim-check object {uri!r} does not exist") from None
            except pa.ArrowInvalid as exc:  # the storage refuses the path itself: retrying cannot help
                raise ClaimCheckNotAllowedError(f"claim-check location not allowed: {uri!r}: {exc}") from exc
            except (OSError, pa.ArrowException) as exc:
                if attempt == self.retries:
                    raise ClaimCheckUnavailableError(
                        f"claim-check storage failed {attempt + 1} times reading {uri!r}: {exc}"
                    ) from exc
                with self._counting:
                    self.stats.retries += 1
                time.sleep(min(_BACKOFF_S * 2**attempt, _BACKOFF_MAX_S))
        with self._counting:
            self.stats.fetches += 1
            self.stats.bytes += len(value)
            self.stats.seconds += time.monotonic() - started
        return value

    def _allowed(self, uri: str) -> tuple[ClaimCheckRoot, StoragePath]:
        location = parse_location(uri)
        if self.override is not None:
            name = location.segments[-1] if location.segments else ""
            if not _FILE_NAME.fullmatch(name):
                raise ClaimCheckNotAllowedError(
                    f"claim-check location not allowed: {uri!r} has no plain file name to read from "
                    f"{self.override.uri!r}"
                )
            return self.override, self.override.relocated(name)
        for root in self.roots:
            if not location.under(root.path):
                continue
            below = location.segments[len(root.path.segments) :]
            if len(uri) > _MAX_LOCATION or not all(_FILE_NAME.fullmatch(name) for name in below):
                raise ClaimCheckNotAllowedError(
                    f"claim-check location not allowed: {uri[:200]!r}: below the root, only plain names "
                    f"([A-Za-z0-9._-]) and at most {_MAX_LOCATION} characters"
                )
            return root, location
        configured = ", ".join(repr(root.uri) for root in self.roots) or "none configured"
        raise ClaimCheckNotAllowedError(
            f"claim-check location not allowed: {uri!r} is under no claim_check_roots ({configured})"
        )

    def _read_once(self, root: ClaimCheckRoot, location: StoragePath, uri: str) -> bytes:
        try:
            path = root.filesystem_path(location, self.max_object_bytes)
        except ClaimCheckNotAllowedError:
            with self._counting:
                self.stats.refused += 1
            raise
        # A random-access file knows its size before any byte is read (S3: the HEAD pyarrow sends anyway),
        # so an oversized object is refused unread; and it never decompresses by file extension (`x.gz`).
        with root.filesystem.open_input_file(path) as file:
            size = file.size()
            if size > self.max_object_bytes:
                raise ClaimCheckTooLargeError(
                    f"claim-check object {uri!r} is larger than max_object_bytes ({self.max_object_bytes})"
                )
            value = file.read(size)
        if len(value) != size:
            raise OSError(f"claim-check object {uri!r}: read {len(value)} of its {size} bytes")
        return bytes(value)
