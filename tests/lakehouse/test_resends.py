"""Re-sent changes (TiCDC delivers at least once): a stream with copies of changes it had sent, at any
position, makes the same lake as the stream sent once, and the run says how many it skipped."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from resent_streams import (
    Sent,
    Stream,
    as_of,
    consume,
    differences,
    lake,
    parquet_lake,
    point,
    simulated,
    table_names,
    with_copies,
    write,
)

from consumer.errors import ConflictingResendError
from consumer.lakehouse.status import read_status
from consumer.simulate.workload import WorkloadConfig
from consumer.sinks.dead_letter import read_letters

WORKLOAD = WorkloadConfig(rows=600, tables=3, partitions=2, seed=3, watermark_every_txns=20)


@pytest.fixture(scope="module", params=["simple", "debezium"])
def sent_once(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Stream, Path]:
    """A protocol, its stream sent once, and the lake that makes."""
    protocol = request.param
    stream, _ = simulated(WORKLOAD, protocol)
    directory = tmp_path_factory.mktemp(f"once-{protocol}")
    consume(write(stream, directory / "once.jsonl"), directory / "lake", protocol)
    return protocol, stream, directory / "lake"


def _dml_positions(records: list[Sent]) -> list[int]:
    return [index for index, sent in enumerate(records) if sent.kind == "DML"]


def _copied_in_each_partition(
    stream: Stream, place: Callable[[list[int], int], tuple[int, int, int]]
) -> tuple[Stream, int]:
    """`stream` with copies in each partition of the records `place(DML positions, records)` names (start,
    end, where the copies go), and how many DMLs were copied."""
    resent, copies = stream, 0
    for partition, records in stream.items():
        start, end, at = place(_dml_positions(records), len(records))
        resent = with_copies(resent, partition, start, end, at)
        copies += sum(1 for sent in records[start:end] if sent.kind == "DML")
    return resent, copies


def _first_third_at_the_end(dmls: list[int], size: int) -> tuple[int, int, int]:
    return 0, dmls[len(dmls) // 3], size


def _same_lake(protocol: str, stream: Stream, once: Path, tmp_path: Path) -> int:
    """Consume `stream` into a lake of its own and check it against the lake sent once; returns how many
    records the run skipped as re-sent."""
    stats = consume(write(stream, tmp_path / "resent.jsonl"), tmp_path / "lake", protocol)
    assert differences(lake(tmp_path / "lake"), lake(once)) == []
    assert stats.rows == sum(len(rows) for (_, kind), rows in lake(once).items() if kind == "changelog")
    return stats.resent


def test_one_early_insert_sent_again_at_the_end_of_its_partition(
    sent_once: tuple[str, Stream, Path], tmp_path: Path
) -> None:
    protocol, stream, once = sent_once
    partition = max(stream, key=lambda p: len(_dml_positions(stream[p])))
    first = _dml_positions(stream[partition])[0]
    records = stream[partition]
    resent = with_copies(stream, partition, first, first + 1, len(records))
    assert _same_lake(protocol, resent, once, tmp_path) == 1


def test_a_block_sent_again_in_the_middle_of_each_partition(
    sent_once: tuple[str, Stream, Path], tmp_path: Path
) -> None:
    """A third of each partition's DMLs sent again after the next third: the copies are mid-stream."""
    protocol, stream, once = sent_once

    def middle(dmls: list[int], size: int) -> tuple[int, int, int]:
        third = len(dmls) // 3
        return dmls[third], dmls[2 * third], dmls[2 * third] + 1

    resent, copies = _copied_in_each_partition(stream, middle)
    assert _same_lake(protocol, resent, once, tmp_path) == copies


def test_the_first_third_sent_again_at_the_end_as_after_a_restart_from_an_old_checkpoint(
    sent_once: tuple[str, Stream, Path], tmp_path: Path
) -> None:
    protocol, stream, once = sent_once
    resent, copies = _copied_in_each_partition(stream, _first_third_at_the_end)
    assert _same_lake(protocol, resent, once, tmp_path) == copies


def test_a_transaction_sent_again_right_after_itself(
    sent_once: tuple[str, Stream, Path], tmp_path: Path
) -> None:
    """No WATERMARK or older row between the copies and their originals: only their keys tell them apart
    from more rows of the same transaction."""
    protocol, stream, once = sent_once
    partition = 0
    records = stream[partition]
    dmls = _dml_positions(records)
    start = next(i for i in dmls if sum(r.commit_ts == records[i].commit_ts for r in records) > 1)
    end = start + sum(r.commit_ts == records[start].commit_ts for r in records)
    assert (
        _same_lake(protocol, with_copies(stream, partition, start, end, end), once, tmp_path) == end - start
    )


def test_a_restart_in_the_middle_of_a_re_sent_range_ends_at_the_same_lake(
    sent_once: tuple[str, Stream, Path], tmp_path: Path
) -> None:
    """The first run stops in the middle of the copies (the capture ends there); the second reads the whole
    stream, resuming where the lake says: the copies it reads are recognised from the lake alone."""
    protocol, stream, once = sent_once
    resent = stream
    for partition, records in stream.items():
        dmls = _dml_positions(records)
        resent = with_copies(resent, partition, dmls[len(dmls) // 4], dmls[len(dmls) // 2], len(records))
    cut = {
        p: records[: len(stream[p]) + (len(records) - len(stream[p])) // 2] for p, records in resent.items()
    }
    root = tmp_path / "lake"
    consume(write(cut, tmp_path / "cut.jsonl"), root, protocol)
    stats = consume(write(resent, tmp_path / "whole.jsonl"), root, protocol)
    assert stats.resent > 0
    assert differences(lake(root), lake(once)) == []
    counted = {(p.topic, p.partition): p.resent for p in read_status(str(root)).partitions}
    assert sum(counted.values()) >= stats.resent and all(counted.values())  # both runs', per partition


def test_as_of_reads_and_the_consistent_point_are_those_of_the_stream_sent_once(tmp_path: Path) -> None:
    stream, marks = simulated(WORKLOAD)
    consume(write(stream, tmp_path / "once.jsonl"), tmp_path / "once")
    resent = stream
    for partition, records in stream.items():
        dmls = _dml_positions(records)
        resent = with_copies(resent, partition, dmls[5], dmls[len(dmls) // 2], dmls[-3])
    consume(write(resent, tmp_path / "resent.jsonl"), tmp_path / "resent")
    names = table_names(WORKLOAD)
    assert as_of(tmp_path / "resent", names, marks) == as_of(tmp_path / "once", names, marks)
    assert point(tmp_path / "resent") == point(tmp_path / "once") is not None


def test_a_copy_whose_image_differs_is_set_aside_as_a_conflicting_resend(tmp_path: Path) -> None:
    stream, _ = simulated(WORKLOAD)
    consume(write(stream, tmp_path / "once.jsonl"), tmp_path / "once")
    records = stream[0]
    index = next(
        i for i in _dml_positions(records) if json.loads(records[i].value or b"")["type"] == "INSERT"
    )
    message = json.loads(records[index].value or b"")
    changed = {**message, "data": {**message["data"], "c_char": "not what was sent"}}
    forged = Sent("DML", records[index].commit_ts, records[index].key, json.dumps(changed).encode())
    resent = {**stream, 0: [*records, forged]}
    stats = consume(write(resent, tmp_path / "resent.jsonl"), tmp_path / "lake")
    assert differences(lake(tmp_path / "lake"), lake(tmp_path / "once")) == []
    [letter] = read_letters(str(tmp_path / "lake" / "_dead_letters.jsonl"))
    assert (letter.location.partition, letter.location.offset) == (0, len(records))
    assert letter.reason_code == ConflictingResendError.code == "conflicting-resend"
    assert "differs from the one the lake holds" in letter.reason
    [image] = json.loads(letter.value or b"")
    assert image["c_char"] == "not what was sent" and image["_commit_ts"] == records[index].commit_ts
    assert stats.dead_letters == 1 and stats.resent == 0


SMALL = WorkloadConfig(rows=160, tables=2, partitions=2, seed=5, watermark_every_txns=8, max_txn_rows=3)


@pytest.fixture(scope="module")
def small_once(tmp_path_factory: pytest.TempPathFactory) -> tuple[Stream, list[int], dict[str, object]]:
    """The small stream, its watermarks, and what its lake sent once holds: rows, as-of reads, the point."""
    stream, marks = simulated(SMALL)
    root = tmp_path_factory.mktemp("small") / "lake"
    consume(write(stream, root.parent / "once.jsonl"), root)
    held = {"lake": lake(root), "as_of": as_of(root, table_names(SMALL), marks), "point": point(root)}
    return stream, marks, held


@settings(
    max_examples=10,
    deadline=None,
    derandomize=True,  # the same plans each run: a failure is found again by the next run
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_re_sends_anywhere_make_the_lake_of_the_stream_sent_once(
    small_once: tuple[Stream, list[int], dict[str, object]], data: st.DataObject
) -> None:
    """Copies of single records, blocks and whole earlier ranges, with or without the DDLs among them,
    inserted anywhere after what they copy: mirrors, changelogs, histories, as-of reads at every watermark
    and the consistent point are those of the stream sent once."""
    stream, marks, once = small_once
    resent = stream
    for _ in range(data.draw(st.integers(1, 3), label="re-sends")):
        partition = data.draw(st.sampled_from(sorted(resent)), label="partition")
        size = len(resent[partition])
        start = data.draw(st.integers(0, size - 1), label="start")
        length = data.draw(
            st.one_of(st.just(1), st.integers(1, 12), st.integers(1, size - start)), label="length"
        )
        end = min(size, start + length)
        at = data.draw(st.integers(end, size), label="at")
        ddls = data.draw(st.booleans(), label="with DDLs")
        resent = with_copies(resent, partition, start, end, at, ddls)
    with tempfile.TemporaryDirectory() as directory:
        root = Path(directory) / "lake"
        stats = consume(write(resent, Path(directory) / "resent.jsonl"), root)
        copies = sum(len(resent[p]) - len(stream[p]) for p in stream)
        assert differences(lake(root), once["lake"]) == []  # type: ignore[arg-type]
        assert as_of(root, table_names(SMALL), marks) == once["as_of"]
        assert point(root) == once["point"]
        assert stats.resent <= copies


def test_a_parquet_lake_takes_each_re_sent_change_once(tmp_path: Path) -> None:
    """The Parquet sink's manifest keeps each partition's newest commit ts beside its next offset: the first
    third of each partition sent again at its end adds nothing."""
    stream, _ = simulated(WORKLOAD)
    resent, _ = _copied_in_each_partition(stream, _first_third_at_the_end)
    once = consume(write(stream, tmp_path / "once.jsonl"), tmp_path / "once", kind="parquet")
    again = consume(write(resent, tmp_path / "resent.jsonl"), tmp_path / "resent", kind="parquet")
    assert parquet_lake(tmp_path / "resent") == parquet_lake(tmp_path / "once")
    assert again.rows == once.rows and again.resent > 0
