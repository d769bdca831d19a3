"""Shared test setup: the embedded Kafka broker fixtures (`kafka_broker`, `kafka_topic`)."""

pytest_plugins = ["consumer.testing.pytest_plugin"]
