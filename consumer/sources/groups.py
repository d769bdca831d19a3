"""A consumer group as the broker describes it: who holds its partitions when a member was given none (a
member that died mid-join may hold them until its session expires, or a stranger shares the group id)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConsumerGroupDescription, MemberDescription

from consumer.kafka_config import create_client, scrubbed, secret_values

_DESCRIBED_EMPTY = frozenset({"EMPTY", "DEAD"})  # states in which a group rightly lists no member


@dataclass(frozen=True, slots=True)
class GroupDescription:
    """`members`: each as "CLIENT-ID@HOST [topic[p], ...]"; `state`: the broker's (STABLE, EMPTY...), empty
    with `error` when the broker could not be asked."""

    group: str
    state: str = ""
    members: tuple[str, ...] = ()
    error: str = ""

    def summary(self) -> str:
        """What an operator reads: the members, or why they are unknown."""
        if self.error:
            return f"members unknown (describing group {self.group} failed: {self.error})"
        if self.members:
            return f"members of {self.group} as the broker reports them: {'; '.join(self.members)}"
        if self.state in _DESCRIBED_EMPTY:
            return f"the broker reports group {self.group} {self.state} (no member)"
        # tansu describes a group with members as STABLE without listing them
        return f"members unknown (the broker reports group {self.group} {self.state} but lists no member)"


def describe_group(
    bootstrap_servers: str, group: str, config: Mapping[str, object] | None = None, timeout: float = 10.0
) -> GroupDescription:
    """Ask the brokers about `group` with the source's client settings (TLS, SASL); a failure is described,
    not raised: this only explains another failure."""
    settings = {**(config or {}), "bootstrap.servers": bootstrap_servers, "log_level": 3}  # no warnings
    secrets = secret_values(settings)
    admin = create_client(cast(Callable[[dict[str, object]], AdminClient], AdminClient), settings)
    if isinstance(admin, KafkaError):
        return GroupDescription(group, error=scrubbed(admin.str(), secrets))
    try:
        future = admin.describe_consumer_groups([group], request_timeout=timeout)[group]
        described: ConsumerGroupDescription = future.result(timeout=timeout)
    except KafkaException as exc:
        return GroupDescription(group, error=scrubbed(str(exc.args[0]), secrets))
    except TimeoutError:
        return GroupDescription(group, error=f"no answer within {timeout:.0f} s")
    members = tuple(_member(member) for member in described.members)
    return GroupDescription(group, described.state.name, members)


def _member(member: MemberDescription) -> str:
    held = member.assignment.topic_partitions if member.assignment else []
    partitions = ", ".join(f"{tp.topic}[{tp.partition}]" for tp in held)
    return f"{member.client_id}@{member.host} [{partitions}]"
