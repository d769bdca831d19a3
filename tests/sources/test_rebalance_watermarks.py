"""Watermarks survive a rebalance: every offset commit carries its partition's last watermark, so whoever
reads a partition next (this member after losing it, or another one) resumes with it. A partition read to
its end has no WATERMARK left to read; without the one its commit carried, the other partitions' rows would
wait for TiCDC's next WATERMARK, forever on a finished stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jsonl_outputs import delivered_ddls, delivered_rows, unique_images

from consumer.errors import RecordLocation
from consumer.pipeline import Pipeline
from consumer.pipeline.resume import resumed_watermarks
from consumer.protocol.model import Watermark
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.simulate.output import write_capture_file, write_ground_truth
from consumer.simulate.truth import differences, replay_changelog
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sinks.dead_letter import DeadLetterFile
from consumer.sinks.jsonl import JsonLinesSink
from consumer.sources.base import CarriesWatermarks
from consumer.sources.capture import read_capture
from consumer.sources.commit_metadata import metadata_watermark, watermark_metadata
from consumer.sources.errors import SourceError
from consumer.sources.files import FileSource
from consumer.sources.kafka import KafkaSource
from consumer.sources.record import SourceRecord, TopicPartition
from consumer.state.machine import ConsumerState
from consumer.state.watermarks import WatermarkTrail
from consumer.testing.broker import EmbeddedBroker
from consumer.testing.pytest_plugin import TopicFactory

TOPIC = "t"
TSO = st.integers(min_value=0, max_value=(1 << 64) - 1)


# -- the metadata a commit carries ---------------------------------------------------------------------
@given(TSO)
def test_a_watermark_round_trips_through_commit_metadata(commit_ts: int) -> None:
    assert metadata_watermark(watermark_metadata(commit_ts)) == commit_ts


@given(st.one_of(st.text(), st.text().map(lambda text: watermark_metadata(0)[:-1] + text)))
def test_metadata_another_tool_wrote_carries_no_watermark_and_no_error(metadata: str) -> None:
    carried = metadata_watermark(metadata)
    assert carried is None or watermark_metadata(carried) == metadata


@pytest.mark.parametrize(
    "metadata",
    [None, "", "ticdc-watermark:", "ticdc-watermark:-1", "ticdc-watermark:01", "ticdc-watermark: 1",
     "ticdc-watermark:1e3", "ticdc-watermark:١٢", f"ticdc-watermark:{1 << 64}", "{'offset': 3}"],
)  # fmt: skip
def test_malformed_metadata_carries_no_watermark(metadata: str | None) -> None:
    assert metadata_watermark(metadata) is None


def test_a_watermark_outside_the_tso_range_is_refused() -> None:
    with pytest.raises(ValueError, match="64-bit"):
        watermark_metadata(1 << 64)


# -- which watermark a commit may carry ----------------------------------------------------------------
def test_a_commit_carries_the_newest_watermark_read_below_its_offset() -> None:
    trail = WatermarkTrail()
    trail.read(3, 100)
    trail.read(5, 90)  # a regression (TiCDC resending an older checkpoint) adds nothing
    trail.read(8, 200)
    assert trail.below(3) is None  # the WATERMARK at 3 itself is not below a commit at 3
    assert trail.below(4) == 100
    assert trail.below(8) == 100
    assert trail.below(9) == 200
    assert trail.below(5) is None  # after a failed commit, a lower one carries none it cannot justify


def test_a_carried_watermark_is_carried_on_until_a_newer_one_is_passed() -> None:
    trail = WatermarkTrail()
    trail.read(2, 50)
    trail.carry(100)  # the one the assigned position carried: newer than the WATERMARK at 2
    trail.read(4, 120)
    assert trail.below(0) == 100
    assert trail.below(3) == 100
    assert trail.below(5) == 120


@given(
    st.lists(st.tuples(st.integers(0, 50), TSO), max_size=30).map(sorted),
    st.lists(st.integers(0, 60), max_size=10),
)
def test_a_commit_never_carries_a_watermark_read_at_or_after_its_offset(
    marks: list[tuple[int, int]], asked: list[int]
) -> None:
    trail = WatermarkTrail()
    for offset, commit_ts in dict(marks).items():  # one WATERMARK per offset
        trail.read(offset, commit_ts)
    for offset in asked:
        carried = trail.below(offset)
        below = [commit_ts for at, commit_ts in dict(marks).items() if at < offset]
        assert carried is None or carried in below
        assert carried is None or carried == max(below)


def _watermark(state: ConsumerState, tp: TopicPartition, offset: int, commit_ts: int) -> None:
    state.process(RecordLocation(*tp, offset), Watermark(commit_ts=commit_ts, build_ts=0))


def test_the_state_machine_hands_each_commit_its_watermark_and_resumes_with_carried_ones() -> None:
    state = ConsumerState()
    p0, p1 = (TOPIC, 0), (TOPIC, 1)
    state.assign([p0, p1])
    _watermark(state, p0, 0, 10)
    _watermark(state, p1, 0, 12)
    offsets = state.committable()
    assert offsets == {p0: 1, p1: 1}
    assert state.commit_watermarks(offsets) == {p0: 10, p1: 12}
    state.revoke([p0, p1])
    state.assign([p0, p1])
    state.resume_watermarks({p0: 10, ("other", 0): 99})  # only owned partitions
    assert state.stats().global_watermark is None  # p1 carried none: nothing is complete yet
    _watermark(state, p1, 1, 12)
    assert state.stats().global_watermark == 10
    _watermark(state, p0, 1, 11)
    assert state.commit_watermarks({p0: 1, p1: 2}) == {p0: 10, p1: 12}


def test_a_member_resumes_with_its_own_commit_s_watermark_only_from_that_commit_on() -> None:
    p0, p1, p2 = (TOPIC, 0), (TOPIC, 1), (TOPIC, 2)
    remembered = {p0: (7, 100), p1: (7, 100), p2: (7, 100)}
    starts = {p0: 7, p1: 6, p2: None}  # p1 was rewound before the commit, p2 starts at the earliest
    assert resumed_watermarks([p0, p1, p2], starts, {}, remembered) == {p0: 100}
    carried = {p1: 90, p2: 120}  # what the partitions' last commits carried wins where newer
    assert resumed_watermarks([p0, p1, p2], starts, carried, remembered) == {p0: 100, p1: 90, p2: 120}


# -- losing and regaining partitions at every point of a finished stream ------------------------------
class _Group:
    """A consumer group of `members` over a finished stream: `regroup` takes every partition from its owner
    (lost, or revoked) and gives them to the next member, at their committed offsets (a listener's start
    offsets where later). Commits carry their watermarks when `keeps_metadata`; a lost partition's
    commits fail, as they do when the broker fenced the member."""

    def __init__(
        self, records: Iterable[SourceRecord], members: list[Pipeline], *, keeps_metadata: bool, lose: bool
    ) -> None:
        self._log: dict[TopicPartition, list[SourceRecord]] = {}
        for record in records:
            self._log.setdefault((record.topic, record.partition), []).append(record)
        self._members = members
        self._keeps_metadata = keeps_metadata
        self._lose = lose
        self._owner: Pipeline | None = None
        self._fenced = False
        self._turn = 0
        self._queued: dict[TopicPartition, deque[SourceRecord]] = {}
        self._committed: dict[TopicPartition, int] = {}
        self._regrouped_at: dict[TopicPartition, int] = {}  # the committed offsets at the last regroup
        self._marks: dict[TopicPartition, int] = {}

    def regroup(self) -> Pipeline:
        """Take every partition from its owner and give them to the next member, which is returned."""
        partitions = sorted(self._log)
        if self._owner is not None:
            self._fenced = self._lose
            (self._owner.on_lost if self._lose else self._owner.on_revoke)(partitions)
            self._fenced = False
        owner = self._owner = self._members[self._turn % len(self._members)]
        self._turn += 1
        owner.attach(self)
        self._regrouped_at = dict(self._committed)
        starts = owner.on_assign(partitions) or {}
        for tp in partitions:
            start = max(starts.get(tp, 0), self._committed.get(tp, 0))
            self._queued[tp] = deque(record for record in self._log[tp] if record.offset >= start)
        return owner

    @property
    def committed_since_regrouped(self) -> bool:
        return self._committed != self._regrouped_at

    @property
    def finished(self) -> bool:
        return all(self._committed.get(tp) == records[-1].offset + 1 for tp, records in self._log.items())

    def poll_batch(self, max_records: int, timeout: float) -> list[SourceRecord]:
        """Up to `max_records`, partition by partition: one is read to its end while the others wait."""
        batch: list[SourceRecord] = []
        for tp in sorted(self._queued):
            queue = self._queued[tp]
            while queue and len(batch) < max_records:
                batch.append(queue.popleft())
        return batch

    def commit(
        self, offsets: Mapping[TopicPartition, int], watermarks: Mapping[TopicPartition, int] | None = None
    ) -> None:
        if self._fenced:
            raise SourceError("the partitions were lost", client_code="UNKNOWN_MEMBER_ID", retriable=True)
        for tp, offset in offsets.items():
            self._committed[tp] = offset
            self._marks.pop(tp, None)
            if self._keeps_metadata and watermarks and tp in watermarks:
                self._marks[tp] = watermarks[tp]

    def committed(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        return {tp: self._committed.get(tp) for tp in partitions}

    def committed_watermarks(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: self._marks[tp] for tp in partitions if tp in self._marks}

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        return None

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        return None

    def assignment(self) -> set[TopicPartition]:
        return set(self._queued)

    def close(self) -> None:
        return None


def _member(root: Path) -> Pipeline:
    return Pipeline(
        group="g",
        state=ConsumerState(),
        sinks=[JsonLinesSink(root)],  # members of a group share the output
        dead_letters=DeadLetterFile(root / "_dead_letters.jsonl"),
    )


@pytest.mark.parametrize(
    ("members", "keeps_metadata"),
    [(1, False), (2, True)],
    ids=["one member, a broker that drops commit metadata", "two members taking turns"],
)
@pytest.mark.parametrize("lose", [False, True], ids=["revoked", "lost"])
def test_losing_and_regaining_partitions_at_every_point_of_a_finished_stream_applies_everything(
    tmp_path: Path, members: int, keeps_metadata: bool, lose: bool
) -> None:
    workload = Workload(WorkloadConfig(rows=300, tables=2, partitions=3, watermark_every_txns=10))
    capture = tmp_path / "stream.capture"
    write_capture_file(workload, MessageEncoder(), TOPIC, capture)
    truth = write_ground_truth(workload, tmp_path / "truth.json")
    records = list(read_capture(capture))
    root = tmp_path / "out"
    pipelines = [_member(root) for _ in range(members)]
    group = _Group(records, pipelines, keeps_metadata=keeps_metadata, lose=lose)
    assert isinstance(group, CarriesWatermarks)
    polls = regroups = 0
    member = group.regroup()
    try:
        while not group.finished and polls < 4 * len(records):  # a bound for the test failing
            member.step(group.poll_batch(7, timeout=0))
            polls += 1
            if group.committed_since_regrouped:  # at every commit, the partitions change hands
                member = group.regroup()
                regroups += 1
        assert group.finished, [str(u) for p in pipelines for u in p.state.unapplied()]
        assert regroups > len(records) // 50, f"only {regroups} regroups"
    finally:
        for pipeline in pipelines:
            pipeline.finish()
            pipeline.close()
    rows = unique_images(delivered_rows(root))
    assert differences(replay_changelog(rows, delivered_ddls(root)), truth) == []


def test_a_source_that_cannot_carry_watermarks_is_committed_to_as_before(tmp_path: Path) -> None:
    capture = tmp_path / "stream.capture"
    write_capture_file(
        Workload(WorkloadConfig(rows=40, tables=1, partitions=2)), MessageEncoder(), TOPIC, capture
    )
    pipeline = _member(tmp_path / "out")
    try:
        source = FileSource(capture, listener=pipeline)
        assert not isinstance(source, CarriesWatermarks)
        stats = pipeline.run(source, until_idle=0.2)
        assert stats.commits and not stats.unapplied
    finally:
        pipeline.close()


# -- the real client ---------------------------------------------------------------------------------
def test_kafka_commits_carry_watermarks_as_metadata_the_broker_may_drop(
    kafka_broker: EmbeddedBroker, kafka_topic: TopicFactory
) -> None:
    topic = kafka_topic(partitions=2)
    kafka_broker.produce(topic, [(0, None, b"a"), (0, None, b"b"), (1, None, b"c")])
    group = f"{topic}.metadata"
    with KafkaSource(
        kafka_broker.bootstrap_servers, [topic], group, partitions=[(topic, 0), (topic, 1)]
    ) as source:
        assert isinstance(source, CarriesWatermarks)
        source.commit({(topic, 0): 2, (topic, 1): 1}, {(topic, 0): 449512873440575500})
        assert source.committed([(topic, 0), (topic, 1)]) == {(topic, 0): 2, (topic, 1): 1}
        carried = source.committed_watermarks([(topic, 0), (topic, 1)])
        # Kafka keeps commit metadata; tansu 0.6 (the embedded broker) drops it
        assert carried in ({(topic, 0): 449512873440575500}, {})
