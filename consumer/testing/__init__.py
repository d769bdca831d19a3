"""Testing aids for users of the SDK: hypothesis strategies (`consumer.testing.strategies`) and an
embedded Kafka-protocol broker with pytest fixtures (`consumer.testing.broker`, `.pytest_plugin`)."""
