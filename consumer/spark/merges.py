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

A large MERGE into a bucketed mirror (`sink.mirror_split_rows`) is split further: its table's task prepares
it (everything a MERGE does before delta-rs's: schema, floor, deletes, revived keys) and spools each group of
buckets' source rows beside the mirror; then every prepared MERGE's groups run as tasks of one Spark job
(`merge_bucket_part`), each writing its buckets' new files; the driver commits each table's files at once
(`finish_split`: one commit per table and batch, with the MERGE's app transactions and claims). A commit that
conflicts prepares that table's MERGE again, up to the job's commit retries.

Exactly once: a MERGE commits the changelog offsets it applies as the mirror's app transactions, and reads
them before it MERGEs, so a task Spark runs again (a retry, a speculative copy, a restarted driver's catch-up)
finds its rows applied and commits nothing.
"""

from __future__ import annotations

import random
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar, Generic, TypeVar

from py4j.protocol import Py4JJavaError  # type: ignore[import-untyped]
from pyspark import SparkContext
from pyspark.errors import PySparkException

from consumer.errors import SinkError
from consumer.kill_points import kill_point
from consumer.sinks.bucket_merges import BucketOutcome, BucketPart, merge_bucket_part, remove_spooled
from consumer.sinks.delta import (
    AppendJob,
    AppendResult,
    HistoryJob,
    MergeJob,
    MergeResult,
    finish_split,
    prepare_merge_job,
    write_changelog_files,
    write_history,
)
from consumer.sinks.parquet import ParquetFiles, ParquetJob, write_parquet_files
from consumer.spark.workers import settle_worker

JOB_DESCRIPTION = "ticdc: mirror MERGEs"
BUCKETS_DESCRIPTION = "ticdc: mirror MERGEs in bucket groups"
APPEND_DESCRIPTION = "ticdc: changelog files"
HISTORY_DESCRIPTION = "ticdc: history MERGEs"
PARQUET_DESCRIPTION = "ticdc: Parquet files"
APPEND_TASK_ROWS = 50_000  # changelog rows one task writes at most, unless one table's batch is larger
# Spark SQL runs Python tasks (the `ticdc` source's reads) with this variable set; Spark keeps a pool of
# Python workers per environment, so RDD tasks with it too run in the same workers, which imported the SDK
# already, instead of a second daemon's workers importing it (and deltalake) again
SHARED_WORKERS = ("SPARK_SIMPLIFIED_TRACEBACK", "1")
Job = TypeVar("Job")
Result = TypeVar("Result")


class ExecutorMerges:
    """Runs `MergeJob`s as Spark tasks, one per table (`DeltaSink.run_merges_with(ExecutorMerges())`), and
    a split one's bucket groups as tasks of their own, on the active Spark context; a job that fails as
    often as Spark allows, or a split one conflicting more often than its commit retries, raises
    `SinkError`."""

    def __init__(self, context: SparkContext | None = None) -> None:
        self._context = context

    def __call__(self, jobs: Sequence[MergeJob]) -> list[MergeResult]:
        if not jobs:
            return []
        kill_point("executor-merges")  # tests: progress recorded, the MERGEs not run
        results = self._prepare(jobs)
        for retry in range(max(job.max_commit_retries for job in jobs) + 1):
            split = [index for index, result in enumerate(results) if result.split is not None]
            if not split:
                return results
            conflicted = self._run_splits([jobs[i] for i in split], [results[i] for i in split], retry)
            for index, result in zip(split, conflicted, strict=True):
                results[index] = result
        for result in results:
            if result.split is not None:
                remove_spooled(result.split)
        raise SinkError("mirror MERGEs in bucket groups: still conflicting after the commit retries")

    def _prepare(self, jobs: Sequence[MergeJob]) -> list[MergeResult]:
        tasks = [[job] for job in jobs]
        return _as_tasks(self._context, JOB_DESCRIPTION, prepare_merge_job, tasks, "mirror MERGEs")

    def _run_splits(
        self, jobs: Sequence[MergeJob], prepared: Sequence[MergeResult], retry: int
    ) -> list[MergeResult]:
        """The prepared MERGEs' bucket groups as one Spark job, each table's committed at once: the jobs'
        results, a conflicting one's prepared again after a jittered backoff (the `retry`th)."""
        parts = [(index, part) for index, result in enumerate(prepared) for part in _parts(result)]
        tasks = [[part] for _, part in parts]
        outcomes = _as_tasks(self._context, BUCKETS_DESCRIPTION, merge_bucket_part, tasks, "bucket MERGEs")
        per_job: list[list[BucketOutcome]] = [[] for _ in jobs]
        for (index, _), outcome in zip(parts, outcomes, strict=True):
            per_job[index].append(outcome)
        results = [finish_split(*args) for args in zip(jobs, prepared, per_job, strict=True)]
        again = [index for index, result in enumerate(results) if result is None]
        if again:
            time.sleep(random.uniform(0, min(jobs[again[0]].retry_backoff * 2**retry, 2.0)))
        redone = iter(self._prepare([jobs[i] for i in again]))
        return [result if result is not None else next(redone) for result in results]


class _ExecutorJobs(ABC, Generic[Job, Result]):
    """Runs jobs of one kind as Spark tasks, a job a task (`_tasks`), on the active Spark context (or
    `context`); a job that fails as often as Spark allows raises `SinkError`."""

    description: ClassVar[str]  # the Spark job's, as the UI shows it
    what: ClassVar[str]  # what the jobs write, as a failure names it

    def __init__(self, context: SparkContext | None = None) -> None:
        self._context = context

    def __call__(self, jobs: Sequence[Job]) -> list[Result]:
        return _as_tasks(self._context, self.description, self._run, self._tasks(jobs), self.what)

    @staticmethod
    @abstractmethod
    def _run(job: Job) -> Result:
        """One job, in a task."""

    def _tasks(self, jobs: Sequence[Job]) -> list[list[Job]]:
        return [[job] for job in jobs]


class ExecutorAppends(_ExecutorJobs[AppendJob, AppendResult]):
    """Writes changelog files (`DeltaSink.append_with(ExecutorAppends())`), a small batch's tables in one
    task (`_packed`)."""

    description, what = APPEND_DESCRIPTION, "changelog files"
    _run = staticmethod(write_changelog_files)

    def _tasks(self, jobs: Sequence[AppendJob]) -> list[list[AppendJob]]:
        return _packed(jobs)


class ExecutorHistories(_ExecutorJobs[HistoryJob, int]):
    """MERGEs histories, a task per table (`DeltaSink.history_with(ExecutorHistories())`)."""

    description, what = HISTORY_DESCRIPTION, "histories"
    _run = staticmethod(write_history)


class ExecutorParquet(_ExecutorJobs[ParquetJob, ParquetFiles]):
    """Writes a Parquet changelog's files, a task per table (`ParquetSink.append_with`)."""

    description, what = PARQUET_DESCRIPTION, "Parquet files"
    _run = staticmethod(write_parquet_files)


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


def _parts(result: MergeResult) -> tuple[BucketPart, ...]:
    return () if result.split is None else result.split.parts


def _reason(text: str) -> str:
    """The task's own error (the last Python exception line of its traceback), else the first line."""
    errors = re.findall(r"^(consumer\.\w+(?:\.\w+)*\.\w+Error: .*)$", text, re.MULTILINE)
    if errors:
        return errors[-1][:1000]
    lines = text.strip().splitlines()
    return (lines[0] if lines else "unknown")[:1000]
