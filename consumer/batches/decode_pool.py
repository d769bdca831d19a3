"""Typed decoding of resolved batches in worker processes, beside the consumer loop.

Turning row values into typed Arrow columns is most of a record's CPU time, and it holds the GIL, so a
thread cannot overlap it with fetching, ordering and writing: a process can. A batch travels as msgpack
(1-2 µs a row each way), its changelog comes back as Arrow buffers.

Workers start from a `forkserver`: the consumer process runs librdkafka and JVM threads, and a plain fork
would copy their locks mid-use. Nothing here can lose a batch: a value that does not decode, or a worker
that died, makes `result` return None and the caller decodes the batch itself, under its error policy.

A worker ends when the consumer process does, however it ended (even SIGKILL): it holds the forkserver's
"alive" pipe and the resource tracker's, so a worker outliving the consumer would keep both running too.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import select
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import pyarrow as pa
from cachetools import LRUCache

from consumer.batches.changes import TableChanges, table_changes
from consumer.errors import ConsumerError, RecordLocation
from consumer.protocol.model import RawDML, TableSchema
from consumer.protocol.table import TableCodec
from consumer.protocol.types import DecodeStats, ValuePolicy

if TYPE_CHECKING:
    from consumer.protocol.base import Protocol

log = logging.getLogger(__name__)

Rows = tuple[tuple[RawDML, RecordLocation], ...]
_ENCODER = msgspec.msgpack.Encoder()
_ROWS = msgspec.msgpack.Decoder(Rows)
_SCHEMA = msgspec.msgpack.Decoder(TableSchema)
_CODECS_PER_WORKER = 64  # table versions whose generated decoders a worker keeps
# A batch decodes in pieces of this many rows: a wide table's batch spreads over every worker, and the loop,
# once it has nothing else to do, waits for the last piece rather than the last batch.
PIECE_ROWS = 10_000
# A batch decodes into many small objects at once: with Python's default thresholds (700, 10, 10) the
# collector re-scans them over and over, a third of the decoding time.
DECODE_GC_THRESHOLDS = (100_000, 50, 100)


_Decoded = tuple[pa.Table, int, int] | None  # changelog, values nulled by the policy, images verified


@dataclass(frozen=True, slots=True)
class Decoding:
    """A batch being decoded, piece by piece."""

    pieces: list[Future[_Decoded]]

    def done(self) -> bool:
        return all(piece.done() for piece in self.pieces)


class DecodePool:
    """`workers` processes decoding `RowBatch` rows into changelog tables under `policy` (TiCDC Avro rows
    decode as `protocol` gives: TiCDC Avro rows read their writer schemas from its registry).

    Values the policy nulls and images verified are counted into `stats`, as when decoding in the loop.
    """

    def __init__(
        self,
        workers: int,
        policy: ValuePolicy,
        protocol: Protocol | None = None,
        stats: DecodeStats | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError(f"a decode pool needs at least one worker, not {workers}")
        context = multiprocessing.get_context("forkserver")
        # workers fork with pyarrow and msgspec imported, and pandas, which pyarrow imports (when installed)
        # with its first array built from Python objects: else each worker would import it for itself
        context.set_forkserver_preload([__name__, "pandas"])
        self.policy = policy
        self.stats = DecodeStats() if stats is None else stats
        self._executor = ProcessPoolExecutor(
            workers,
            mp_context=context,
            initializer=_start_worker,
            initargs=(policy, protocol, os.getpid()),  # a registry travels as its settings
        )
        self._broken = False
        self._start_all(workers)

    def _start_all(self, workers: int) -> None:
        """Start every worker now: the executor would start them on demand, so the first batches would
        wait for process start-up and imports, and a busy loop would keep running on fewer workers."""
        try:
            wait([self._executor.submit(_started) for _ in range(workers)])
        except (BrokenProcessPool, RuntimeError) as exc:
            self._give_up(exc)

    def submit(self, schema: TableSchema, rows: Rows) -> Decoding | None:
        """Start decoding; None when the pool is unusable (the caller decodes in the loop)."""
        if self._broken:
            return None
        encoded = _ENCODER.encode(schema)
        try:
            return Decoding(
                [
                    self._executor.submit(_decode, encoded, _ENCODER.encode(rows[start : start + PIECE_ROWS]))
                    for start in range(0, len(rows), PIECE_ROWS)
                ]
            )
        except (BrokenProcessPool, RuntimeError) as exc:  # RuntimeError: cannot start processes (any more)
            self._give_up(exc)
            return None

    def result(self, decoding: Decoding, schema: TableSchema) -> TableChanges | None:
        """The batch's changes; None when a value did not decode or a row failed verification (the caller's
        error policy then names the rows) or a worker died."""
        try:
            pieces = [piece.result() for piece in decoding.pieces]
        except BrokenProcessPool as exc:
            self._give_up(exc)
            return None
        except Exception as exc:  # a worker's unexpected failure: the loop decodes the batch itself
            log.warning(
                "a decode worker failed (%s: %s): decoding the batch in the loop", type(exc).__name__, exc
            )
            return None
        decoded = [piece for piece in pieces if piece is not None]
        if len(decoded) < len(pieces):
            return None
        self.stats.unrepresentable += sum(nulled for _, nulled, _ in decoded)
        self.stats.verified += sum(verified for _, _, verified in decoded)
        changelogs = [changelog for changelog, _, _ in decoded]
        return TableChanges(schema, changelogs[0] if len(changelogs) == 1 else pa.concat_tables(changelogs))

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _give_up(self, exc: BaseException) -> None:
        if not self._broken:
            log.warning("decode workers unusable (%s): decoding in the consumer loop from now on", exc)
        self._broken = True


_policy = ValuePolicy()
_stats = DecodeStats()  # counts since the worker started; `_decode` reports the increase
_protocol: Protocol | None = None
_codecs: LRUCache[bytes, TableCodec] = LRUCache(_CODECS_PER_WORKER)


def _start_worker(policy: ValuePolicy, protocol: Protocol | None, consumer: int) -> None:
    """A worker ignores Ctrl-C (a terminal sends it to the whole process group): the consumer decides when
    its workers stop, and ends them itself. A registry arrives as its settings: each worker has a client."""
    global _policy, _protocol
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.set_threshold(*DECODE_GC_THRESHOLDS)
    _policy = policy
    _protocol = protocol
    threading.Thread(target=_exit_with, args=(consumer,), name="exit-with-consumer", daemon=True).start()


def _exit_with(pid: int) -> None:
    """Wait for process `pid` to end (a pidfd becomes readable then; polling where pidfds are missing),
    then end this worker."""
    try:
        watched = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(0)  # gone already
    except (AttributeError, OSError):
        while _alive(pid):
            time.sleep(1.0)
    else:
        select.select([watched], [], [])
    os._exit(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, under another user
        pass
    return True


def _started() -> None:
    return None


def _decode(schema: bytes, rows: bytes) -> _Decoded:
    codec = _codecs.get(schema)
    if codec is None:
        try:
            codec = _codecs[schema] = TableCodec(
                _SCHEMA.decode(schema), _policy, protocol=_protocol, stats=_stats
            )
        except ConsumerError:
            return None
    nulled, verified = _stats.unrepresentable, _stats.verified
    try:
        changes = table_changes(codec, _ROWS.decode(rows))
    except ConsumerError:  # the loop decodes the batch again, to apply the error policy to the bad row
        return None
    return changes.changelog, _stats.unrepresentable - nulled, _stats.verified - verified
