"""A group's offsets committed without joining it. The Spark engine reads Kafka by offset ranges, not as a
group member, yet Kafka's lag tools, `ticdc-consumer status` and a loop member taking a partition over read
the group's committed offsets (and the watermarks they carry): so it commits what the lake applied, as a
member would. Kafka takes such commits only while the group has no members; one refused is the caller's to
retry, never a stop (the lake's own records, not Kafka's, are where either engine resumes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from confluent_kafka import Consumer, KafkaError, KafkaException

from consumer.kafka_config import create_client, scrubbed, secret_values
from consumer.sources.errors import SourceError
from consumer.sources.kafka import commit_position, partition_counts
from consumer.sources.record import TopicPartition


class GroupCommits:
    """Commits `group`'s next offsets to read, with a never-subscribing client (created at the first
    commit: a run that applies nothing opens no connection)."""

    def __init__(
        self, bootstrap_servers: str, group: str, config: Mapping[str, object] | None = None
    ) -> None:
        self._settings = {
            **(config or {}),
            "bootstrap.servers": bootstrap_servers,
            "group.id": group,
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
        }
        self._secrets = secret_values(self._settings)
        self._consumer: Consumer | None = None

    def commit(
        self, offsets: Mapping[TopicPartition, int], watermarks: Mapping[TopicPartition, int] | None = None
    ) -> None:
        """Synchronously commit, per partition, the offset of the next record to read, each partition of
        `watermarks` carrying its watermark; raises SourceError when Kafka refuses any of it."""
        if not offsets:
            return
        marks = watermarks or {}
        request = [commit_position(tp, offset, marks.get(tp)) for tp, offset in offsets.items()]
        try:
            result = self._client().commit(offsets=request, asynchronous=False)
        except KafkaException as exc:
            raise self._error(f"commit of {dict(offsets)} failed", exc.args[0]) from exc
        for tp in result or []:
            if tp.error is not None:
                raise self._error(f"commit of {tp.topic}[{tp.partition}]@{tp.offset} failed", tp.error)

    def partition_counts(self, topics: Iterable[str], timeout: float = 5.0) -> dict[str, int] | None:
        """Per topic that exists, its partition count; None when the metadata cannot be read."""
        return partition_counts(self._client(), topics, timeout)

    def close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

    def _client(self) -> Consumer:
        if self._consumer is None:
            consumer = create_client(Consumer, dict(self._settings))
            if isinstance(consumer, KafkaError):
                raise self._error("cannot create a Kafka client", consumer)
            self._consumer = consumer
        return self._consumer

    def _error(self, context: str, error: KafkaError) -> SourceError:
        return SourceError(scrubbed(f"{context}: {error.str()}", self._secrets), client_code=error.name())
