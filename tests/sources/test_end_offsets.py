"""`EndOffsets` on the embedded broker: a partition's end is where a fetch finds it. tansu lists the end of a
partition whose last producer batch holds several records as that batch's first offset + 1, and the Spark
planner, which asked that, stopped there and said it was done (issue 41)."""

from __future__ import annotations

from confluent_kafka import Producer

from consumer.sources.ends import EARLIEST, EndOffsets, PartitionEnd, unread
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory


def _produce_batch(broker: EmbeddedBroker, topic: str, partition: int, count: int) -> None:
    """`count` records in one producer batch (queued, then flushed together)."""
    producer = Producer({"bootstrap.servers": broker.bootstrap_servers, "linger.ms": 60_000})
    for number in range(count):
        producer.produce(topic, value=b"%d" % number, partition=partition)
    assert producer.flush(30) == 0


def test_the_bounds_are_the_ends_a_fetch_finds_not_the_listed_ones(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(2)
    _produce_batch(kafka_broker, topic, 0, 10)
    _produce_batch(kafka_broker, topic, 0, 5)
    ends = EndOffsets(kafka_broker.bootstrap_servers, {})
    try:
        listed = ends.listed([topic])
        bounds = ends.bounds([topic])
    finally:
        ends.close()
    assert kafka_broker.end_offsets(topic) == {0: 15, 1: 0}
    assert bounds == {(topic, 0): (0, 15), (topic, 1): (0, 0)}
    assert listed[(topic, 0)][1] <= 15  # tansu lists 11: the last batch's first offset + 1


def test_a_probe_says_what_is_left_past_each_position(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(3)
    _produce_batch(kafka_broker, topic, 0, 12)
    _produce_batch(kafka_broker, topic, 1, 4)
    ends = EndOffsets(kafka_broker.bootstrap_servers, {})
    try:
        found = ends.probe({(topic, 0): 7, (topic, 1): 4, (topic, 2): EARLIEST}, paused=[(topic, 0)])
        again = ends.probe({(topic, 0): 12})  # the client is used again
    finally:
        ends.close()
    assert found == {
        (topic, 0): PartitionEnd(topic, 0, read=7, next=7, end=12, paused=True),
        (topic, 1): PartitionEnd(topic, 1, read=4, next=4, end=4),
        (topic, 2): PartitionEnd(topic, 2, read=0, next=0, end=0),
    }
    assert unread(found.values()) == [found[(topic, 0)]]
    left = f"{topic}[0]: read to 7 of end offset 12: offsets 7..11 unread (5, paused: "
    assert str(found[(topic, 0)]).startswith(left)
    assert str(found[(topic, 1)]) == f"{topic}[1]: read to its end offset 4"
    assert again[(topic, 0)].unread == 0
