"""`run --processes N`: the group members one command starts, their totals, failures and stopping."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from consumer.config import ConfigError, RunConfig, load_config
from consumer.members import GroupMembers, MemberFailed, MemberProcess
from consumer.pipeline import PipelineStats


def _reports_totals(records: int, asked: Any, reports: Any) -> None:
    reports.put(
        (MemberProcess(asked).name, PipelineStats(records=records, rows_by_table={"shop.t": records}))
    )


def _fails(asked: Any, reports: Any) -> None:
    member = MemberProcess(asked)
    reports.put((member.name, MemberFailed(f"{member.name}: SinkError: disk full")))
    raise SystemExit(1)


def _dies(asked: Any, reports: Any) -> None:
    os._exit(3)


def _runs_until_asked(asked: Any, reports: Any) -> None:
    member = MemberProcess(asked)
    consumed = 0
    while not member.stop.requested:
        consumed += 1
        member.on_cycle(None)
        time.sleep(0.01)
    reports.put((member.name, PipelineStats(records=consumed)))


def test_totals_of_every_member_come_back() -> None:
    totals = GroupMembers(2, _reports_totals, (5,)).stop(interrupt=False)
    assert [t.records for t in totals] == [5, 5]
    combined = totals[0].combined(totals[1])
    assert (combined.records, combined.rows_by_table) == (10, {"shop.t": 10})


def test_a_failed_member_is_raised_with_its_reason() -> None:
    members = GroupMembers(2, _fails, ())
    with pytest.raises(MemberFailed, match="disk full"):
        members.stop(interrupt=False)


def test_a_member_that_dies_without_a_word_is_a_failure() -> None:
    members = GroupMembers(1, _dies, ())
    with pytest.raises(MemberFailed, match="member-1 exited with code 3 and no report"):
        members.stop(interrupt=False)


def test_members_asked_to_stop_report_what_they_did() -> None:
    members = GroupMembers(2, _runs_until_asked, ())
    members.check()  # running (or still starting), nothing failed
    totals = members.stop(interrupt=True)  # asked at once: each member looks once it has started
    assert len(totals) == 2 and all(t.records > 0 for t in totals)


def _config(**parallelism: Any) -> RunConfig:
    return load_config(
        environ={},
        overrides={
            "source": {"url": "kafka://b:9092/t"},
            "sink": {"url": "delta:/lake"},
            "parallelism": parallelism,
        },
    )


def test_several_processes_decode_in_their_loops_unless_told_otherwise() -> None:
    assert _config(processes=2).parallelism.member_decode_workers() == 0
    assert _config(processes=2, decode_workers=1).parallelism.member_decode_workers() == 1
    assert (
        _config().parallelism.member_decode_workers()
        == _config(processes=1).parallelism.member_decode_workers()
    )


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"parallelism": {"processes": 0}}, "at least one process"),
        ({"parallelism": {"processes": 2}, "source": {"url": "file:/x.jsonl"}}, "needs a Kafka source"),
        ({"parallelism": {"processes": 2}, "sink": {"url": "parquet:/lake"}}, "one writer per root"),
        (
            {
                "parallelism": {"processes": 2},
                "sink": {"url": "delta:s3://b/lake", "allow_unsafe_commits": True},
            },
            "processes must be 1",
        ),
        ({"sink": {"url": "jsonl:s3://b/out"}}, "local directory"),
    ],
)
def test_processes_the_source_or_sink_cannot_share_are_refused(overrides: dict, words: str) -> None:
    layered = {"source": {"url": "kafka://b:9092/t"}, "sink": {"url": "delta:/lake"}}
    for section, values in overrides.items():
        layered[section] = {**layered.get(section, {}), **values}
    with pytest.raises(ConfigError, match=words):
        load_config(environ={}, overrides=layered)


def test_sink_storage_options_come_from_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        '[source]\nurl = "kafka://b:9092/t"\n'
        '[sink]\nurl = "delta:s3://bucket/lake"\ntarget_file_size = 2097152\n'
        '[sink.storage_options]\nAWS_REGION = "eu-west-1"\nAWS_ENDPOINT_URL = "http://127.0.0.1:9000"\n'
    )
    sink = load_config(path, environ={}).sink
    assert sink.storage_options == {"AWS_REGION": "eu-west-1", "AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}
    assert (sink.url, sink.target_file_size, sink.allow_unsafe_commits) == (
        "delta:s3://bucket/lake",
        2097152,
        False,
    )
