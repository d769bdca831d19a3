"""Key-only DMLs made whole, between the decoder and the state machine (docs/protocols/simple.md §7).

A poll's claim-checks are fetched concurrently (a bounded thread pool: storage reads release the GIL),
handle-key-only rows are looked up upstream when configured. The caller puts each result back at its
record's place in the stream, so order, offsets and exactly-once bookkeeping are those of the original
record. A row that cannot be made whole comes back as the error saying why (for the error policy); an
outage of the storage or of upstream TiDB raises instead, stopping the pipeline before any commit past it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

from consumer.errors import ConsumerError, HandleKeyOnlyError, LargeMessageUnavailableError
from consumer.large_messages.claim_check import RawValueSetting, full_message
from consumer.large_messages.storage import ClaimCheckStore
from consumer.protocol.model import KeyOnlyDML, RawDML, TableSchema
from consumer.protocol.simple.decoder import MessageDecoder
from consumer.watchdog import Watchdog

if TYPE_CHECKING:  # only a run that configures an upstream DSN loads the MySQL client
    from consumer.large_messages.upstream import UpstreamLookup

DEFAULT_CONCURRENCY = 16
SchemaLookup = Callable[[KeyOnlyDML], TableSchema | None]
Resolved = RawDML | ConsumerError


class LargeMessageResolver:
    """`store` reads claim-checks (no roots: every claim-check is refused); `upstream`, when given, looks
    handle-key-only rows up, typed by the schema `schemas` finds for them (a `Pipeline` sets it to its
    state's schema cache); `watchdog` tells of a fetch or a lookup that hangs (a `Pipeline` sets its own)."""

    def __init__(
        self,
        decoder: MessageDecoder,
        store: ClaimCheckStore,
        *,
        raw_value: RawValueSetting = "auto",
        upstream: UpstreamLookup | None = None,
        schemas: SchemaLookup | None = None,
        concurrency: int = DEFAULT_CONCURRENCY,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.decoder = decoder
        self.store = store
        self.raw_value = raw_value
        self.upstream = upstream
        self.schemas = schemas
        self.concurrency = concurrency
        self.watchdog = watchdog
        self._pool: ThreadPoolExecutor | None = None

    def resolve(self, messages: Sequence[KeyOnlyDML]) -> list[Resolved]:
        """Each message's full DML, or why it has none, in the order given."""
        fetches: dict[int, Future[RawDML]] = {
            index: self._fetcher().submit(self._claim_check, message)
            for index, message in enumerate(messages)
            if message.claim_check_location
        }
        results: list[Resolved | None] = [None] * len(messages)
        for index, message in enumerate(messages):
            if index not in fetches:
                results[index] = _outcome(partial(self._looked_up, message))
        try:
            for index, future in fetches.items():
                results[index] = _outcome(future.result)
        except LargeMessageUnavailableError:
            for future in fetches.values():  # an outage: start no more reads
                future.cancel()
            raise
        return [result for result in results if result is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.upstream is not None:
            self.upstream.close()

    def _fetcher(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="claim-check")
        return self._pool

    def _claim_check(self, message: KeyOnlyDML) -> RawDML:
        with self._watching(f"claim-check fetch {message.claim_check_location}"):
            stored = self.store.read(message.claim_check_location)
        return full_message(stored, message, self.decoder, self.raw_value)

    def _looked_up(self, message: KeyOnlyDML) -> RawDML:
        if self.upstream is None:
            raise HandleKeyOnlyError(
                "handle-key-only row needs an upstream lookup (large_messages.upstream_dsn)"
            )
        schema = self.schemas(message) if self.schemas else None
        row = message.row
        if schema is None:
            raise HandleKeyOnlyError(
                f"handle-key-only row of {row.database}.{row.table} arrived before its schema (version "
                f"{row.schema_version}): the upstream row cannot be typed"
            )
        with self._watching(f"upstream lookup of a {row.database}.{row.table} row"):
            return self.upstream.resolve(message, schema)

    def _watching(self, operation: str) -> AbstractContextManager[None]:
        return self.watchdog.watching(operation) if self.watchdog else nullcontext()


def _outcome(produce: Callable[[], RawDML]) -> Resolved:
    """The full DML, or the reason there is none (e.g. the key-only message's key does not decode); an
    outage propagates."""
    try:
        return produce()
    except LargeMessageUnavailableError:
        raise
    except ConsumerError as exc:
        return exc
