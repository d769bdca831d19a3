"""Delta writes on Spark's executors: the Delta sink's merge runner and changelog append runner in the Spark
engine.

Changelog appends (`ExecutorAppends`): a batch's rows of a table, spooled by the source's tasks, are read,
sorted and written as a Parquet file in the changelog's directory by one Spark task (`write_changelog_files`),
which returns the file's add action; the driver commits it with the batch's app transactions. A file written
and not committed (the driver died before its commit, or the commit conflicted and was written again) is
never committed: it is an orphan until `maintain` vacuums it.

The driver decides which lazy mirrors are due and up to which TSO (metadata: locations, offsets, TSOs); each
due table's MERGE runs as one Spark task (`run_merge_job`, the same code, app transactions and commit
metadata as a MERGE in the sink's own process), all due tables in parallel, and only small results come
back (`MergeResult`: TSOs, a row count, delta-rs metrics, the process that ran it). No mirror row passes
through the driver.

Exactly once: a MERGE commits the changelog offsets it applies as the mirror's app transactions, and reads
them before it MERGEs, so a task Spark runs again (a retry, a speculative copy, a restarted driver's catch-up)
finds its rows applied and commits nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from functools import partial
from typing import TypeVar

from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
from pyspark import SparkContext
from pyspark.errors import PySparkException

from consumer.errors import SinkError
from consumer.kill_points import kill_point
from consumer.sinks.delta import (
    AppendJob,
    AppendResult,
    MergeJob,
    MergeResult,
    run_merge_job,
    write_changelog_files,
)
from consumer.spark.workers import settle_worker

JOB_DESCRIPTION = "ticdc: mirror MERGEs"
APPEND_DESCRIPTION = "ticdc: changelog files"
APPEND_TASK_ROWS = 50_000  # changelog rows one task writes at most, unless one table's batch is larger
# Spark SQL runs Python tasks (the `ticdc` source's reads) with this variable set; Spark keeps a pool of
# Python workers per environment, so RDD tasks with it too run in the same workers, which imported the SDK
# already, instead of a second daemon's workers importing it (and deltalake) again
SHARED_WORKERS = ("SPARK_SIMPLIFIED_TRACEBACK", "1")
Job = TypeVar("Job")
Result = TypeVar("Result")


class ExecutorMerges:
    """Runs `MergeJob`s as Spark tasks, one per table (`DeltaSink.run_merges_with(ExecutorMerges())`), on
    the active Spark context; a job that fails as often as Spark allows raises `SinkError`."""

    def __init__(self, context: SparkContext | None = None) -> None:
        self._context = context

    def __call__(self, jobs: Sequence[MergeJob]) -> list[MergeResult]:
        if not jobs:
            return []
        kill_point("executor-merges")  # tests: progress recorded, the MERGEs not run
        return _as_tasks(
            self._context, JOB_DESCRIPTION, run_merge_job, [[job] for job in jobs], "mirror MERGEs"
        )


class ExecutorAppends:
    """Writes changelog files as Spark tasks, one per job (`DeltaSink.append_with(ExecutorAppends())`), on
    the active Spark context; a job that fails as often as Spark allows raises `SinkError`."""

    def __init__(self, context: SparkContext | None = None) -> None:
        self._context = context

    def __call__(self, jobs: Sequence[AppendJob]) -> list[AppendResult]:
        return _as_tasks(
            self._context, APPEND_DESCRIPTION, write_changelog_files, _packed(jobs), "changelog files"
        )


def _packed(jobs: Sequence[AppendJob]) -> list[list[AppendJob]]:
    """The jobs in tasks of up to `APPEND_TASK_ROWS` rows, in order (a job larger alone): a small batch's
    tables share one task, as a small batch's Kafka ranges share one read task."""
    tasks: list[list[AppendJob]] = []
    size = 0
    for job in jobs:
        rows = job.rows()
        if not tasks or size + rows > APPEND_TASK_ROWS:
            tasks.append([])
            size = 0
        tasks[-1].append(job)
        size += rows
    return tasks


def _as_tasks(
    context: SparkContext | None,
    description: str,
    run: Callable[[Job], Result],
    tasks: Sequence[Sequence[Job]],
    what: str,
) -> list[Result]:
    """Each task's jobs run by `run` in a Spark task, one after the other, as one Spark job named
    `description`; the results in the jobs' order."""
    if not tasks:
        return []
    spark = context or SparkContext.getOrCreate()
    spark.environment.setdefault(*SHARED_WORKERS)
    spark.setJobDescription(description)
    try:
        done = (
            spark.parallelize([list(jobs) for jobs in tasks], len(tasks)).map(partial(_task, run)).collect()
        )
        return [result for results in done for result in results]
    except (Py4JJavaError, PySparkException) as exc:
        raise SinkError(f"{what} on the executors failed: {_reason(str(exc))}") from exc
    finally:
        spark.setJobDescription(None)  # type: ignore[arg-type]


def _task(run: Callable[[Job], Result], jobs: list[Job]) -> list[Result]:
    """A task: `run` on each job, then its worker settled (`settle_worker`: the Delta writer it imported)."""
    try:
        return [run(job) for job in jobs]
    finally:
        settle_worker()


def _reason(text: str) -> str:
    """The task's own error (the last Python exception line of its traceback), else the first line."""
    errors = re.findall(r"^(consumer\.\w+(?:\.\w+)*\.\w+Error: .*)$", text, re.MULTILINE)
    if errors:
        return errors[-1][:1000]
    lines = text.strip().splitlines()
    return (lines[0] if lines else "unknown")[:1000]
