"""Kafka source over confluent-kafka with explicit, caller-driven offset commits.

Offsets are never committed or stored behind the caller's back (`enable.auto.commit` and
`enable.auto.offset.store` are forced off): a record counts as consumed only once the pipeline has made its
effects durable and calls `commit`. Extra librdkafka settings (TLS, SASL, ...) pass through unchanged, but
secrets never reach logs or exception messages.

librdkafka retries connections forever and only reports trouble as error events, so a consumer with wrong
credentials or no reachable broker would otherwise wait in silence: a refused authentication ends the next
`poll_batch` with `SourceAuthenticationError`, and brokers that stay unreachable (checked with a metadata
request) with `SourceUnreachableError`.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Final, Literal, cast

from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
)
from confluent_kafka import TopicPartition as KafkaTopicPartition

from consumer.kafka_config import create_client, redact_config, scrubbed, secret_values
from consumer.sources.base import RebalanceListener, Source
from consumer.sources.capture import write_capture
from consumer.sources.commit_metadata import metadata_watermark, watermark_metadata
from consumer.sources.ends import EndOffsets, PartitionEnd
from consumer.sources.errors import SourceAuthenticationError, SourceError, SourceUnreachableError
from consumer.sources.record import SourceRecord, TopicPartition

log = logging.getLogger(__name__)

ALL_PARTITIONS: Final = "all"

_FORCED_CONFIG: dict[str, object] = {
    "enable.auto.commit": False,
    "enable.auto.offset.store": False,
    "auto.offset.reset": "earliest",
}
# Error events that mean the brokers refuse this client: retrying with the same settings cannot help.
_REFUSED = frozenset((KafkaError._AUTHENTICATION, KafkaError._SSL, KafkaError.SASL_AUTHENTICATION_FAILED))
# Errors that pass: a slow cycle cost the group membership (librdkafka rejoins on the next poll), a
# coordinator or leader is moving, a request timed out. librdkafka flags few errors retriable itself.
_TRANSIENT = frozenset(
    (
        KafkaError._MAX_POLL_EXCEEDED,
        KafkaError._ASSIGNMENT_LOST,
        KafkaError._TRANSPORT,
        KafkaError._TIMED_OUT,
        KafkaError._WAIT_COORD,
        KafkaError.REQUEST_TIMED_OUT,
        KafkaError.NETWORK_EXCEPTION,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.NOT_COORDINATOR,
        KafkaError.REBALANCE_IN_PROGRESS,
        KafkaError.ILLEGAL_GENERATION,
        KafkaError.UNKNOWN_MEMBER_ID,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
    )
)
# A consumer that never reached a broker gives up after this long (a lost connection: `unreachable_timeout`).
STARTUP_UNREACHABLE_SECONDS = 10.0
_PROBE_SECONDS = 5.0


class KafkaSource:
    """Reads records from Kafka in batches, in one of two modes.

    - `partitions=None` (default): subscribe to `topics` as a member of consumer group `group_id`; the
      group coordinator assigns partitions and `listener`'s `on_assign`/`on_revoke`/`on_lost` fire on
      rebalances (inside `poll_batch` or `close`).
    - `partitions=[(topic, partition), ...]` or `ALL_PARTITIONS`: read exactly those partitions (or every
      partition of `topics`) without group membership; `group_id` then only names where offsets are
      committed. `listener.on_assign` is called once, in the constructor, before the assignment, so start
      offsets can be overridden.

    Start offsets: those returned by `listener.on_assign`, else the group's committed offsets, else the
    earliest. Offsets of lost partitions (`on_lost`) can no longer be committed.

    `unreachable_timeout`: seconds every broker may stay unreachable, once connected, before `poll_batch`
    raises `SourceUnreachableError` (before the first connection: `STARTUP_UNREACHABLE_SECONDS`).
    """

    def __init__(
        self,
        bootstrap_servers: str,
        topics: Sequence[str],
        group_id: str,
        *,
        partitions: Sequence[TopicPartition] | Literal["all"] | None = None,
        config: Mapping[str, object] | None = None,
        listener: RebalanceListener | None = None,
        metadata_timeout: float = 10.0,
        unreachable_timeout: float = 60.0,
    ) -> None:
        if isinstance(topics, str) or not topics:
            raise ValueError(f"topics must be a non-empty list of topic names, not {topics!r}")
        extra = dict(config or {})
        owned = {"bootstrap.servers", "group.id", *_FORCED_CONFIG}.intersection(extra)
        if owned:
            raise ValueError(f"KafkaSource sets {sorted(owned)} itself; remove them from config")
        self._user_error_cb = cast(Callable[[KafkaError], None] | None, extra.pop("error_cb", None))
        self._config = {
            **extra,
            "bootstrap.servers": bootstrap_servers,
            "group.id": group_id,
            **_FORCED_CONFIG,
            "error_cb": self._client_error,
        }
        self._secrets = secret_values(self._config)
        self._topics = list(topics)
        self._listener = listener
        self._cooperative = "cooperative" in str(self._config.get("partition.assignment.strategy", ""))
        self._deferred_error: SourceError | None = None
        self._unreachable_timeout = unreachable_timeout
        self._connected = False  # reached a broker at least once (records, an assignment, a commit)
        self._down_since: float | None = (
            None  # librdkafka reported every broker down, and no sign of life since
        )
        self._closed = False
        self._counts: dict[str, int] = {}
        self._paused: set[TopicPartition] = set()  # by `pause`, until `resume`
        self._counts_stale = True  # read the metadata again: nothing read yet, or partitions were assigned
        self._ends: EndOffsets | None = None  # made when first asked (`end_offsets`)
        log.info(
            "kafka source for %s, config %s",
            self._topics,
            {k: v for k, v in self.redacted_config().items() if k != "error_cb"},
        )
        consumer = create_client(Consumer, self._config)
        if isinstance(consumer, KafkaError):
            raise self._error("cannot create consumer", consumer)
        self._consumer = consumer
        try:
            self._start(partitions, metadata_timeout)
        except BaseException:
            self.close()
            raise

    def _start(
        self, partitions: Sequence[TopicPartition] | Literal["all"] | None, metadata_timeout: float
    ) -> None:
        if partitions is None:
            self._consumer.subscribe(
                self._topics, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._lost
            )
            return
        if partitions == ALL_PARTITIONS:
            chosen = self._all_partitions(metadata_timeout)
        else:
            chosen = [(topic, partition) for topic, partition in partitions]
            strays = {topic for topic, _ in chosen} - set(self._topics)
            if strays:
                raise ValueError(f"partitions name topics not in {self._topics}: {sorted(strays)}")
        self._consumer.assign(self._positioned(chosen))

    def _all_partitions(self, timeout: float) -> list[TopicPartition]:
        try:
            metadata = self._consumer.list_topics(timeout=timeout)
        except KafkaException as exc:
            raise self._error("cannot list topics", exc.args[0]) from exc
        chosen: list[TopicPartition] = []
        for topic in self._topics:
            info = metadata.topics.get(topic)
            if info is None or info.error is not None:
                raise SourceError(f"topic {topic!r} does not exist", client_code="UNKNOWN_TOPIC_OR_PART")
            chosen.extend((topic, partition) for partition in sorted(info.partitions))
        return chosen

    def _positioned(self, partitions: list[TopicPartition]) -> list[KafkaTopicPartition]:
        """TopicPartitions carrying the listener's start offsets; the rest start at the committed offset."""
        starts = (self._listener.on_assign(partitions) if self._listener else None) or {}
        return [
            KafkaTopicPartition(topic, partition, starts[topic, partition])
            if (topic, partition) in starts
            else KafkaTopicPartition(topic, partition)
            for topic, partition in partitions
        ]

    def _assigned(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        if self._closed:  # a rebalance finishing while the client leaves: the next member takes them
            log.info("not taking %s: leaving the group", _keys(partitions))
            return
        self._reached()
        self._counts_stale = True
        positioned = self._positioned(_keys(partitions))
        log.info("assigned %s", [(tp.topic, tp.partition, tp.offset) for tp in positioned])
        if self._cooperative:
            consumer.incremental_assign(positioned)
        else:
            consumer.assign(positioned)

    def _revoked(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        log.info("revoking %s", _keys(partitions))
        if self._listener:
            self._listener.on_revoke(_keys(partitions))

    def _lost(self, consumer: Consumer, partitions: list[KafkaTopicPartition]) -> None:
        log.warning("lost %s", _keys(partitions))
        if self._listener:
            self._listener.on_lost(_keys(partitions))

    def redacted_config(self) -> dict[str, object]:
        return redact_config(self._config)

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        """Up to `max_records` records; partition EOF events are skipped, other client errors raise.

        The records of a batch are consumed the moment librdkafka hands them over, so an error met mid-batch
        is raised on the next call, after the batch's good records have been returned.
        """
        if self._deferred_error is not None:
            pending, self._deferred_error = self._deferred_error, None
            raise pending
        try:
            messages = self._consumer.consume(num_messages=max_records, timeout=timeout)
        except KafkaException as exc:
            raise self._error("consume failed", exc.args[0]) from exc
        if messages:
            self._reached()
        else:
            self._check_reachable()
        records: list[SourceRecord] = []
        for message in messages:
            error = message.error()
            if error is None:
                records.append(_record(message))
            elif error.code() != KafkaError._PARTITION_EOF and self._deferred_error is None:
                self._deferred_error = self._error(_where(message), error)
        if not records and self._deferred_error is not None:
            pending, self._deferred_error = self._deferred_error, None
            raise pending
        return records

    def commit(
        self, offsets: Mapping[TopicPartition, int], watermarks: Mapping[TopicPartition, int] | None = None
    ) -> None:
        """Synchronously commit, per partition, the offset of the next record to read; a partition of
        `watermarks` carries its watermark in the commit's metadata."""
        if not offsets:
            return
        marks = watermarks or {}
        request = [commit_position(tp, offset, marks.get(tp)) for tp, offset in offsets.items()]
        try:
            result = self._consumer.commit(offsets=request, asynchronous=False)
        except KafkaException as exc:
            raise self._error(f"commit of {dict(offsets)} failed", exc.args[0]) from exc
        for tp in result or []:
            if tp.error is not None:
                raise self._error(f"commit of {tp.topic}[{tp.partition}]@{tp.offset} failed", tp.error)
        self._reached()

    def committed(
        self, partitions: Iterable[TopicPartition], timeout: float = 10.0
    ) -> dict[TopicPartition, int | None]:
        return {
            (tp.topic, tp.partition): tp.offset if tp.offset >= 0 else None
            for tp in self._committed(partitions, timeout)
        }

    def committed_watermarks(
        self, partitions: Iterable[TopicPartition], timeout: float = 10.0
    ) -> dict[TopicPartition, int]:
        """The watermarks the partitions' last commits carried (metadata another tool wrote carries none)."""
        marks = {
            (tp.topic, tp.partition): metadata_watermark(tp.metadata)
            for tp in self._committed(partitions, timeout)
        }
        return {tp: mark for tp, mark in marks.items() if mark is not None}

    def _committed(self, partitions: Iterable[TopicPartition], timeout: float) -> list[KafkaTopicPartition]:
        request = [KafkaTopicPartition(topic, partition) for topic, partition in partitions]
        try:
            result = self._consumer.committed(request, timeout=timeout)
        except KafkaException as exc:
            raise self._error("cannot read committed offsets", exc.args[0]) from exc
        for tp in result:
            if tp.error is not None:
                raise self._error(f"cannot read committed offset of {tp.topic}[{tp.partition}]", tp.error)
        return result

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        chosen = list(partitions)
        try:
            self._consumer.pause([KafkaTopicPartition(topic, partition) for topic, partition in chosen])
        except KafkaException as exc:
            raise self._error("pause failed", exc.args[0]) from exc
        self._paused.update(chosen)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        chosen = list(partitions)
        try:
            self._consumer.resume([KafkaTopicPartition(topic, partition) for topic, partition in chosen])
        except KafkaException as exc:
            raise self._error("resume failed", exc.args[0]) from exc
        self._paused.difference_update(chosen)

    def assignment(self) -> set[TopicPartition]:
        return set(_keys(self._consumer.assignment()))

    def behind(self) -> bool:
        """`KnowsItsEnd`, from librdkafka's own state, no request: a partition is behind while no fetch
        response came back for it yet, or the high watermark the last one carried lies past the position
        this source returned up to (a partition nothing was returned from since its assignment is at the
        end its fetch response found: records it fetched are returned by the next poll). Paused partitions
        are left out: the pipeline holds them back itself."""
        try:
            unpaused = [
                tp for tp in self._consumer.assignment() if (tp.topic, tp.partition) not in self._paused
            ]
            for tp in self._consumer.position(unpaused) if unpaused else []:
                _, high = self._consumer.get_watermark_offsets(tp, cached=True)
                if high < 0 or 0 <= tp.offset < high:
                    return True
        except KafkaException as exc:
            log.info("cannot tell whether the assigned partitions are at their end: %s", exc)
        return False

    def end_offsets(
        self, positions: Mapping[TopicPartition, int], paused: Iterable[TopicPartition]
    ) -> list[PartitionEnd]:
        """`FindsItsEnds`, with a client of its own (this one's fetch positions stay as they are)."""
        if self._ends is None:
            self._ends = EndOffsets(str(self._config["bootstrap.servers"]), self._config)
        found = self._ends.probe(positions, paused)
        return [found[tp] for tp in sorted(found)]

    def partition_counts(self) -> dict[str, int]:
        """`CountsPartitions`: read once and again after each assignment (a topic may have grown); the last
        counts known while the metadata cannot be read."""
        if self._counts_stale:
            counts = partition_counts(self._consumer, self._topics, _PROBE_SECONDS)
            if counts is not None:
                self._counts, self._counts_stale = counts, False
        return dict(self._counts)

    def close(self) -> None:
        """Leave the group (the listener's `on_revoke` fires in subscribe mode) and release the client;
        idempotent."""
        if not self._closed:
            self._closed = True
            if self._ends is not None:
                self._ends.close()
            self._consumer.close()

    def __enter__(self) -> KafkaSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- connection health -----------------------------------------------------------------------------
    def _client_error(self, error: KafkaError) -> None:
        """librdkafka's error events, served inside `consume`: most are transient (it retries by itself)."""
        if self._user_error_cb is not None:
            self._user_error_cb(error)
        if error.fatal() or error.code() in _REFUSED:
            if self._deferred_error is None or not isinstance(
                self._deferred_error, SourceAuthenticationError
            ):
                self._deferred_error = self._error(
                    "the brokers refused this client (check security.protocol, SASL and TLS settings)",
                    error,
                    SourceAuthenticationError,
                )
        elif error.code() == KafkaError._ALL_BROKERS_DOWN and self._down_since is None:
            self._down_since = time.monotonic()
            log.warning("kafka source: %s", scrubbed(error.str(), self._secrets))

    def _reached(self) -> None:
        self._connected = True
        self._down_since = None

    def _check_reachable(self) -> None:
        """After every broker was reported down for long enough, one metadata request decides."""
        patience = self._unreachable_timeout if self._connected else STARTUP_UNREACHABLE_SECONDS
        if self._down_since is None or time.monotonic() - self._down_since < patience:
            return
        try:
            self._consumer.list_topics(timeout=_PROBE_SECONDS)
        except KafkaException as exc:
            servers = self._config["bootstrap.servers"]
            raise self._error(
                f"no broker of {servers} reachable for {time.monotonic() - self._down_since:.0f} s",
                exc.args[0],
                SourceUnreachableError,
            ) from exc
        self._reached()

    def _error(self, context: str, error: KafkaError, kind: type[SourceError] = SourceError) -> SourceError:
        """A scrubbed `kind`; retriable when transient (refused or unreachable brokers were waited on
        already: those are final)."""
        retriable = kind is SourceError and (error.retriable() or error.code() in _TRANSIENT)
        return kind(
            scrubbed(f"{context}: {error.str()}", self._secrets),
            client_code=error.name(),
            retriable=retriable,
        )


def commit_position(tp: TopicPartition, offset: int, watermark: int | None) -> KafkaTopicPartition:
    """A commit's position; with a watermark, carrying it as metadata (the client takes no None there)."""
    topic, partition = tp
    if watermark is None:
        return KafkaTopicPartition(topic, partition, offset)
    return KafkaTopicPartition(topic, partition, offset, metadata=watermark_metadata(watermark))


def partition_counts(client: Consumer, topics: Iterable[str], timeout: float) -> dict[str, int] | None:
    """Per topic that exists, its partition count (the topics' metadata alone, not the cluster's); None
    (logged) when the metadata cannot be read."""
    try:
        found = {topic: client.list_topics(topic, timeout=timeout).topics.get(topic) for topic in topics}
    except (KafkaException, RuntimeError) as exc:  # RuntimeError: the client is closed
        log.warning("cannot read the partition counts of %s: %s", sorted(topics), exc)
        return None
    return {topic: len(info.partitions) for topic, info in found.items() if info and info.error is None}


def _keys(partitions: list[KafkaTopicPartition]) -> list[TopicPartition]:
    return [(tp.topic, tp.partition) for tp in partitions]


def _where(message: Message) -> str:
    topic = message.topic()
    return f"{topic}[{message.partition()}]" if topic else "kafka client"


def _record(message: Message) -> SourceRecord:
    # Coordinates are only None on error events, which never get here.
    timestamp_type, timestamp = message.timestamp()
    return SourceRecord(
        cast(str, message.topic()),
        cast(int, message.partition()),
        cast(int, message.offset()),
        None if timestamp_type == TIMESTAMP_NOT_AVAILABLE else timestamp,
        message.key(),
        message.value(),
    )


_CAPTURE_BATCH = 10_000
# consume() waits its full timeout unless the batch fills: short polls keep the idle clock accurate.
_CAPTURE_POLL_SECONDS = 0.2


def capture_topic(
    bootstrap_servers: str,
    topic: str,
    out_path: str | os.PathLike[str],
    idle_seconds: float = 5.0,
    from_committed_group: str | None = None,
    *,
    config: Mapping[str, object] | None = None,
) -> int:
    """Write every partition of `topic` to a capture file until no record arrived for `idle_seconds`.

    Reads from the beginning, or from `from_committed_group`'s committed offsets (that group's offsets are
    read, never changed). The file appears only once complete, so a failed capture leaves nothing behind.
    Returns the number of records written.

    A partition whose start offset must be looked up (no committed offset) can deliver its first record about
    a second after the others (librdkafka's offset-query timer plus one fetch long-poll), so an
    `idle_seconds` below ~2 s risks missing whole partitions.
    """
    group_id = from_committed_group or f"capture-{uuid.uuid4().hex}"
    out_path = Path(out_path)
    partial = out_path.with_name(f".{out_path.name}.partial")
    try:
        with (
            KafkaSource(
                bootstrap_servers, [topic], group_id, partitions=ALL_PARTITIONS, config=config
            ) as source,
            partial.open("wb") as fp,
        ):
            count = write_capture(_until_idle(source, idle_seconds), fp)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    partial.replace(out_path)
    return count


def _until_idle(source: Source, idle_seconds: float) -> Iterator[SourceRecord]:
    last_arrival = time.monotonic()
    while (remaining := idle_seconds - (time.monotonic() - last_arrival)) > 0:
        batch = source.poll_batch(_CAPTURE_BATCH, timeout=min(remaining, _CAPTURE_POLL_SECONDS))
        if batch:
            last_arrival = time.monotonic()
            yield from batch
