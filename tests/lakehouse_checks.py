"""Checks on a lakehouse root shared by the end-to-end tests (local directories and object stores alike)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from consumer.cli import EXIT_UNASSIGNED
from consumer.config import RunConfig, load_config
from consumer.lakehouse.storage import LakeRoot
from consumer.lakehouse.tables import KINDS, entry_uri, read_delta, tables
from consumer.simulate.truth import delta_changelogs
from consumer.testing.broker import EmbeddedBroker

SESSION_TIMEOUT_S = 3
FAST_GROUP_ENV = {  # group joins of ~SESSION_TIMEOUT_S / 2 on the embedded broker; many small commits
    "TICDC_CONSUMER_KAFKA_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_S * 1000),
    "TICDC_CONSUMER_KAFKA_HEARTBEAT_INTERVAL_MS": "300",
    # also the rebalance timeout: how long the broker waits for members killed in a rebalance to rejoin
    "TICDC_CONSUMER_KAFKA_MAX_POLL_INTERVAL_MS": "30000",
    "TICDC_CONSUMER_BUDGET_MAX_BATCH_RECORDS": "1000",
}
# A run its caller starts again after exit 5 (`run_to_end`) waits this long for a partition, not the default
# 30 s: a join takes ~SESSION_TIMEOUT_S / 2, and a wedged group (`EmbeddedBroker.reset_group`) never joins.
RETRIED_JOIN_GRACE = {"TICDC_CONSUMER_SOURCE_JOIN_GRACE_S": "10"}


def start_run(
    servers: str,
    topic: str,
    group: str,
    sink: str,
    log: Path,
    processes: int,
    options: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    until_idle: float = 3.0,
) -> subprocess.Popen[str]:
    """A `ticdc-consumer run` until idle, logging to `log`, in its own process group (a SIGKILL of the
    group takes its member processes too); `env` added to its environment. `until_idle`: long enough for
    members started together to join before the first goes idle."""
    command = [sys.executable, "-m", "consumer", "run", "--source", f"kafka://{servers}/{topic}"]
    command += ["--group", group, "--sink", sink, "--processes", str(processes)]
    command += ["--until-idle", str(until_idle)]
    command += options
    with log.open("w") as out:
        return subprocess.Popen(
            command,
            env={**os.environ, **FAST_GROUP_ENV, **(env or {})},
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )


def spark_config(
    broker: EmbeddedBroker, topic: str, group: str, root: Path, checkpoint: Path, budget: Mapping[str, int]
) -> RunConfig:
    """A Spark engine run of `topic` as `group` into the Delta lake `root` (`budget`: the `[budget]`
    settings), for `engine.run` in the test's process, on the session."""
    return load_config(
        environ={},
        overrides={
            "source": {"url": f"kafka://{broker.bootstrap_servers}/{topic}", "group": group},
            "sink": {"url": f"delta:{root}"},
            "engine": {"kind": "spark", "checkpoint": str(checkpoint)},
            "budget": dict(budget),
        },
    )


def run_to_end(
    broker: EmbeddedBroker,
    topic: str,
    group: str,
    sink: str,
    log_stem: Path,
    processes: int = 1,
    options: Sequence[str] = (),
    timeout: float = 300,
) -> tuple[int, Path]:
    """A `start_run` waited for: its exit code and log (`<log_stem>-<ns>.log`). A lone member ends 1 s after
    its last change record: it is idle only at the end of its partitions.

    The embedded broker wedges a group whose last two members leave together (`reset_group`): a run never
    given a partition (exit 5, after `RETRIED_JOIN_GRACE`) runs again after a reset, twice at most, and
    the group of several members is reset once they are gone, so the group's next run is not wedged."""
    idle = 1.0 if processes == 1 else 3.0
    for _ in range(3):
        log = Path(f"{log_stem}-{time.monotonic_ns()}.log")
        servers = broker.bootstrap_servers
        run = start_run(servers, topic, group, sink, log, processes, options, RETRIED_JOIN_GRACE, idle)
        code = run.wait(timeout)
        if code != EXIT_UNASSIGNED:
            break
        broker.reset_group(group, topic)
    if processes > 1:
        broker.reset_group(group, topic)
    return code, log


def changelog_duplicates(root: str | Path, storage_options: Mapping[str, str] | None = None) -> int:
    """Change images written more than once, recognised by (topic, partition, offset, change type)."""
    duplicates = 0
    for keys in delta_changelogs(root, ["_topic", "_partition", "_offset", "_change_type"], storage_options):
        grouped = keys.group_by(keys.column_names).aggregate([([], "count_all")])
        duplicates += pc.sum(pc.subtract(grouped["count_all"], 1)).as_py() or 0
    return duplicates


def changelog_rows(root: str | Path, storage_options: Mapping[str, str] | None = None) -> int:
    return sum(rows.num_rows for rows in delta_changelogs(root, ["_offset"], storage_options))


def ddl_types(root: str | Path, storage_options: Mapping[str, str] | None = None) -> set[str]:
    lake = LakeRoot.of(root, storage_options)
    log = lake.open(lake.join("_ddl"))
    assert log is not None
    return set(read_delta(lake, log, ["type"])["type"].to_pylist())


def versions(root: str | Path, storage_options: Mapping[str, str] | None = None) -> dict[str, int]:
    """The version of every Delta table of the lakehouse but the progress records: a replay of a stream
    must not commit to any of them."""
    lake = LakeRoot.of(root, storage_options)
    uris = [lake.join("_catalog"), lake.join("_ddl")]
    uris += [entry_uri(lake, entry, kind) for entry in tables(lake) for kind in KINDS]
    opened = {uri: lake.open(uri) for uri in uris}
    return {uri: table.version() for uri, table in opened.items() if table is not None}


def lake_contents(root: str | Path, storage_options: Mapping[str, str] | None = None) -> dict[str, object]:
    """Everything a run leaves in a Delta lakehouse that two engines must agree on: per table incarnation
    (its name history, drop and truncate points) its changelog, mirror and history rows, in a canonical
    order. Not the `deletes` side table: bookkeeping whose rows depend on the MERGE cadence (a key deleted
    and inserted again between two MERGEs of a lazy mirror, as the Spark engine's are, is never recorded)
    and on when it was last purged."""
    lake = LakeRoot.of(root, storage_options)
    contents: dict[str, object] = {}
    for entry in tables(lake):
        names = [(p.since_ts, p.database, p.table) for p in entry.names]
        name = repr((names, entry.dropped_ts, entry.truncated_ts))
        contents[name] = {
            kind: _rows(lake, entry_uri(lake, entry, kind)) for kind in KINDS if kind != "deletes"
        }
    return contents


def _rows(lake: LakeRoot, uri: str) -> list[tuple[object, ...]]:
    table = lake.open(uri)
    if table is None:
        return []
    rows = read_delta(lake, table)
    names = sorted(rows.column_names)
    return sorted(
        (
            tuple(repr(value) for value in row)
            for row in zip(*(rows[n].to_pylist() for n in names), strict=True)
        ),
    )


def merge_processes(root: str | Path, storage_options: Mapping[str, str] | None = None) -> list[str]:
    """The process (`host:pid`, commit metadata `ticdc.process`) that made each MERGE commit of every
    mirror of the lake."""
    lake = LakeRoot.of(root, storage_options)
    found = []
    for entry in tables(lake):
        mirror = lake.open(entry_uri(lake, entry, "mirror"))
        if mirror is not None:
            found += [c.get("ticdc.process", "") for c in mirror.history() if c["operation"] == "MERGE"]
    return found


def valid_at(versions: pa.Table, tso: int) -> pa.Table:
    """The rows that existed at `tso`: versions valid then, tombstones left out."""
    started = pc.less_equal(versions["_valid_from_ts"], tso)
    not_ended = pc.fill_null(pc.greater(versions["_valid_to_ts"], tso), True)
    return versions.filter(pc.and_(pc.and_(started, not_ended), pc.invert(versions["_deleted"])))
