"""pytest fixtures: a real Kafka-protocol broker (one per test session, a fresh topic per request) and a
Confluent-compatible schema registry on localhost (one per session).

Enable with `pytest_plugins = ["consumer.testing.pytest_plugin"]` in a conftest.py.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Protocol

import pytest

from consumer.testing.broker import EmbeddedBroker
from consumer.testing.registry import LocalSchemaRegistry


class TopicFactory(Protocol):
    """What the `kafka_topic` fixture returns: creates a topic, returns its name."""

    def __call__(self, partitions: int = 1) -> str: ...


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[EmbeddedBroker]:
    with EmbeddedBroker() as broker:
        yield broker


@pytest.fixture
def kafka_topic(kafka_broker: EmbeddedBroker, request: pytest.FixtureRequest) -> TopicFactory:
    """`kafka_topic(partitions=1) -> name`: a new topic named after the test, unique across the session."""
    # Topic names allow only [a-zA-Z0-9._-]; the test name keeps broker logs readable.
    prefix = re.sub(r"[^a-zA-Z0-9._-]", "-", request.node.name)[:100]

    def create(partitions: int = 1) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        kafka_broker.create_topic(name, partitions)
        return name

    return create


@pytest.fixture(scope="session")
def schema_registry() -> Iterator[LocalSchemaRegistry]:
    """A registry for the whole session: ids are global, and identical schemas share one."""
    with LocalSchemaRegistry() as registry:
        yield registry
