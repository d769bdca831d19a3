"""Where a lakehouse lives: a local directory or an object-store URI delta-rs supports, and how to reach it.

`storage_options` go to delta-rs unchanged (its keys: `AWS_ENDPOINT_URL`, `AWS_REGION`, `AZURE_STORAGE_...`,
`GOOGLE_...`; its usual environment variables work the same way) and, for plain files (the Parquet sink,
manifests, dead letters), to a `pyarrow.fs` filesystem built from the same keys.

Concurrent commits are safe only when the store refuses to overwrite an existing log entry: delta-rs writes
each commit with a create-only put (`If-None-Match: *` on S3). `check_atomic_commits` proves it on the
store itself before a writer starts, so a store that ignores the condition is refused instead of silently
losing commits.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.fs as pafs
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import CommitFailedError, DeltaError

from consumer.errors import SinkError
from consumer.lakehouse.handles import Handles

if TYPE_CHECKING:
    import pyarrow.dataset as pads

log = logging.getLogger(__name__)

PROBE_TABLE = "_commit_probe"
T = TypeVar("T")

_S3_KEYS = {  # delta-rs / object_store option names -> pyarrow.fs.S3FileSystem arguments
    "aws_access_key_id": "access_key",
    "access_key_id": "access_key",
    "aws_secret_access_key": "secret_key",
    "secret_access_key": "secret_key",
    "aws_session_token": "session_token",
    "session_token": "session_token",
    "aws_region": "region",
    "region": "region",
}
_S3_ENDPOINT_KEYS = ("aws_endpoint_url", "aws_endpoint", "endpoint_url", "endpoint")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class LakeRoot:
    """A lakehouse root: `uri` is an absolute local path or `scheme://...` without a trailing slash."""

    uri: str
    storage_options: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(
        cls, root: str | os.PathLike[str] | LakeRoot, storage_options: Mapping[str, str] | None = None
    ) -> LakeRoot:
        if isinstance(root, LakeRoot):
            return root
        text = os.fspath(root)
        if text.startswith("file://"):
            text = text.removeprefix("file://")
        if "://" not in text:
            text = str(Path(text).absolute())
        return cls(text.rstrip("/") or "/", dict(storage_options or {}))

    @property
    def is_local(self) -> bool:
        return "://" not in self.uri

    def join(self, *parts: str) -> str:
        """The URI of a path under the root (parts are already safe segments, joined with `/`)."""
        return "/".join([self.uri, *parts])

    def options(self) -> dict[str, str] | None:
        """The storage options as delta-rs takes them."""
        return dict(self.storage_options) or None

    def open(self, uri: str) -> DeltaTable | None:
        """The Delta table at `uri` at its latest version, or None when there is none (yet). Handles are
        kept, by this root and once it is gone by the process (`handles`), and brought up to date
        incrementally: on an object store a fresh load reads every commit since the last checkpoint, an
        update only the new ones. One thread at a time; a handle is this root's while the root lives."""
        return self._handles.open(uri, self.read)

    def existing(self, uri: str) -> DeltaTable:
        """The Delta table at `uri`, which this process just saw or created: gone means someone removed it."""
        table = self.open(uri)
        if table is None:
            raise SinkError(f"{uri}: the Delta table is gone (removed from outside the SDK?)")
        return table

    def create(
        self,
        uri: str,
        schema: pa.Schema,
        configuration: Mapping[str, str | None] | None = None,
        partition_by: list[str] | None = None,
    ) -> DeltaTable:
        """The Delta table at `uri`, created with `schema` (partitioned by `partition_by`) unless another
        writer created it first."""
        DeltaTable.create(
            uri,
            schema,
            mode="ignore",
            partition_by=partition_by,
            configuration=configuration,
            storage_options=self.options(),
        )
        return self.existing(uri)

    @cached_property
    def _handles(self) -> Handles:
        return Handles(self, self.options())

    def read(self, uri: str) -> bytes:
        """The bytes of the file at `uri`, under the root, through `pyarrow.fs`."""
        filesystem, base = self.filesystem()
        if uri != self.uri and not uri.startswith(f"{self.uri}/"):
            raise FileNotFoundError(f"{uri} is not under the lakehouse root {self.uri}")
        with filesystem.open_input_stream(base + uri.removeprefix(self.uri)) as stream:
            return stream.read()

    def scan(self, table: DeltaTable, files: list[str] | None = None) -> pads.Dataset:
        """The table's current rows as an Arrow dataset of exactly the files its log lists (or of `files`,
        some of those), with the table's schema (columns older files lack read as null). Read through
        `pyarrow.fs`: delta-rs's own Arrow readers make short processes abort at exit here (#2184)."""
        import pyarrow.dataset as pads  # with the pandas it imports, 0.1 s a process: only readers pay it

        filesystem, _ = self.filesystem()
        files = [_filesystem_path(uri) for uri in (table.file_uris() if files is None else files)]
        schema = pa.schema(table.schema().to_arrow())
        return pads.dataset(files, schema=schema, format="parquet", filesystem=filesystem)

    def filesystem(self) -> tuple[pafs.FileSystem, str]:
        """A `pyarrow.fs` filesystem reaching the root, and the root's path in it."""
        return self._filesystem

    @cached_property
    def _filesystem(self) -> tuple[pafs.FileSystem, str]:
        if self.is_local:
            return pafs.LocalFileSystem(), self.uri
        scheme = urlparse(self.uri).scheme
        if scheme in ("s3", "s3a"):
            return _s3_filesystem(self.storage_options), self.uri.split("://", 1)[1]
        filesystem, path = pafs.FileSystem.from_uri(self.uri)
        return filesystem, path


_derived: dict[tuple[str, str], tuple[tuple[str, int], Any]] = {}
REMEMBERED = 512  # lookups `by_version` keeps, the oldest dropped first: a process may read many roots
# a forked child computes its own lookups: it keeps nothing its parent found
os.register_at_fork(after_in_child=_derived.clear)


def by_version(table: DeltaTable, what: str, compute: Callable[[DeltaTable], T]) -> T:
    """`compute(table)` (named `what`) for the table's loaded version, computed once per version in the
    process: a committed Delta version never changes, so the small tables every as-of read consults (the
    catalog, the DDL log, the progress records) are read again only once they changed, for the cost of
    loading the table's log. The table's id tells a table created again at the same place from the one
    before. The value is shared: callers must not change it."""
    key, identity = (table.table_uri, what), (str(table.metadata().id), table.version())
    found = _derived.get(key)
    if found is not None and found[0] == identity:
        return cast(T, found[1])
    value = compute(table)
    if len(_derived) >= REMEMBERED:
        _derived.pop(next(iter(_derived)), None)
    _derived[key] = (identity, value)
    return value


def _filesystem_path(uri: str) -> str:
    """A file URI delta-rs gives (percent-encoded), as a path in the root's `pyarrow.fs` filesystem."""
    if uri.startswith("file://"):
        uri = uri.removeprefix("file://")
    return unquote(uri.split("://", 1)[1] if "://" in uri else uri)


def _s3_filesystem(options: Mapping[str, str]) -> pafs.S3FileSystem:
    """An S3 filesystem from delta-rs option names; what they leave out comes from the environment as
    delta-rs takes it (`AWS_ENDPOINT_URL`, `AWS_REGION`, credentials)."""
    lowered = {key.lower(): value for key, value in options.items()}
    arguments: dict[str, str] = {}
    for key, argument in _S3_KEYS.items():
        if key in lowered:
            arguments[argument] = lowered[key]
    endpoint = next(
        (lowered[k] for k in _S3_ENDPOINT_KEYS if k in lowered), os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        parsed = urlparse(endpoint)
        arguments["endpoint_override"] = parsed.netloc or parsed.path
        arguments["scheme"] = parsed.scheme or "https"
    if "region" not in arguments and os.environ.get("AWS_REGION"):
        arguments["region"] = os.environ["AWS_REGION"]
    return pafs.S3FileSystem(**arguments)


def retry_commits(what: str, attempt: Callable[[], T], *, retries: int = 20, backoff: float = 0.05) -> T:
    """Run `attempt` (which reloads what it reads) until its commit is not in conflict with another
    writer's; delta-rs already rebases commits that cannot conflict (blind appends)."""
    retry = 0
    while True:
        try:
            return attempt()
        except CommitFailedError as exc:
            if retry == retries:
                raise SinkError(f"{what}: still conflicting after {retry + 1} attempts: {exc}") from exc
            delay = min(backoff * 2**retry, 2.0)
            retry += 1
            log.info("%s: concurrent commit, retrying (%d)", what, retry)
            time.sleep(random.uniform(delay / 2, delay))


_checked: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
PROBE_WRITERS = 6
PROBE_LOG_RETENTION = "interval 1 day"  # the probe table's log entries older than this go at each probe


def check_atomic_commits(root: LakeRoot, *, allow_unsafe: bool = False) -> None:
    """Refuse an object store that lets two writers commit the same table version (it would silently lose
    one of them): PROBE_WRITERS handles of a probe table, loaded at one version, commit at once, each its
    own app transaction; on a store honouring create-only puts delta-rs retries the losers at later
    versions, elsewhere they overwrite each other and some app transaction is missing afterwards. Local
    roots and roots checked before pass at once.

    `allow_unsafe`: accept such a store with a loud warning, for a root with exactly one writer process.
    """
    key = (root.uri, tuple(sorted(root.storage_options.items())))
    if root.is_local or key in _checked:
        return
    probe = root.join(PROBE_TABLE)
    schema = pa.schema([pa.field("probe", pa.string())])
    retention = {"delta.logRetentionDuration": PROBE_LOG_RETENTION}
    DeltaTable.create(probe, schema, mode="ignore", configuration=retention, storage_options=root.options())
    handles = [DeltaTable(probe, storage_options=root.options()) for _ in range(PROBE_WRITERS)]
    tokens = [f"probe:{uuid.uuid4().hex}" for _ in handles]
    start = threading.Barrier(len(handles))

    def commit(handle: DeltaTable, token: str) -> None:
        properties = CommitProperties(app_transactions=[Transaction(token, 1)], max_commit_retries=50)
        start.wait()
        handle.create_write_transaction([], mode="append", schema=schema, commit_properties=properties)

    with ThreadPoolExecutor(len(handles)) as pool:
        for done in [pool.submit(commit, h, t) for h, t in zip(handles, tokens, strict=True)]:
            done.result()
    committed = DeltaTable(probe, storage_options=root.options())
    lost = sum(committed.transaction_version(token) != 1 for token in tokens)
    if not lost:
        _checked.add(key)
        _checkpointed(committed)
        return
    message = (
        f"{root.uri}: concurrent commits overwrote each other on this object store ({lost} of "
        f"{len(tokens)} probe commits missing from {probe} at version {committed.version()}: the store "
        "ignores create-only puts, `If-None-Match: *`), so group members writing this root would silently "
        "lose commits"
    )
    if not allow_unsafe:
        raise SinkError(
            f"{message}. Use a store with conditional writes (AWS S3, MinIO, Cloudflare R2, Azure, GCS), or "
            "set `sink.allow_unsafe_commits = true` if exactly one process ever writes this root"
        )
    log.warning("%s; continuing because sink.allow_unsafe_commits is set: ONE writer process only", message)
    _checked.add(key)


def _checkpointed(probe: DeltaTable) -> None:
    """Each process's probe adds PROBE_WRITERS commits to the probe table: a checkpoint after it (and the
    older log entries gone) keeps the next probe's loads to a few files however often members start;
    without, every start reads the whole log (after months of restarts, thousands of requests)."""
    try:
        probe.create_checkpoint()
        probe.cleanup_metadata()
    except (DeltaError, OSError) as exc:  # the next probe reads more: nothing else depends on it
        log.info("%s: probe table not checkpointed: %s", probe.table_uri, exc)
