"""Testing aids for users of the SDK: hypothesis strategies (`consumer.testing.strategies`, with a plain
install) and, with the `testing` extra (`pip install 'ticdc-consumer[testing]'`), an embedded Kafka-protocol
broker with pytest fixtures (`consumer.testing.broker`, `.pytest_plugin`) and a local S3 server (`.s3`)."""
