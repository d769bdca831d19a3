"""A Spark standalone cluster on this machine (a master and workers) from the pip-installed pyspark.

The pyspark package ships Spark's jars and `bin/spark-class`, so the package directory is a SPARK_HOME:
tests run the `ticdc` stream on a real cluster (executors in their own JVMs and Python workers, the driver
elsewhere) without a Spark download. Every process starts in its own session, so `stop()` ends each with
everything it spawned (executors and their Python workers included).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

import pyspark

from consumer.testing.ports import free_port

_STOP_GRACE_SECONDS = 10.0


class ClusterError(RuntimeError):
    """The cluster did not start."""


class SparkStandaloneCluster:
    """A master on 127.0.0.1 and `workers` workers of `cores` cores and `memory` each; starts in the
    constructor, `stop()` (or `with`) ends it. `master_url` is what a driver connects to; drivers on this
    machine need `SPARK_LOCAL_IP=127.0.0.1` too (`driver_environment`)."""

    def __init__(
        self, workers: int = 2, *, cores: int = 1, memory: str = "1g", startup_timeout: float = 90.0
    ) -> None:
        self.home = Path(pyspark.__file__).parent
        self.directory = Path(tempfile.mkdtemp(prefix="spark-cluster-"))
        port, ui_port = free_port(), free_port()
        self.master_url = f"spark://127.0.0.1:{port}"
        self._ui = f"http://127.0.0.1:{ui_port}/json/"
        self._processes: list[subprocess.Popen[bytes]] = []
        self._groups: list[int] = []  # every process started leads its own group
        try:
            self._start(
                "master",
                [
                    *("org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"),
                    *("--port", str(port), "--webui-port", str(ui_port)),
                ],
            )
            for index in range(workers):
                work = self.directory / f"worker-{index}"
                self._start(
                    f"worker-{index}",
                    [
                        *("org.apache.spark.deploy.worker.Worker", self.master_url, "--host", "127.0.0.1"),
                        *("--cores", str(cores), "--memory", memory, "--work-dir", str(work)),
                        *("--webui-port", str(free_port())),
                    ],
                )
            self._wait_for_workers(workers, startup_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def driver_environment(self) -> dict[str, str]:
        return {"SPARK_LOCAL_IP": "127.0.0.1"}

    def running(self) -> list[int]:
        """Processes of the cluster still alive (zombies waiting to be reaped aside): the master, the
        workers, and what they spawned (each started its own process group)."""
        groups = {str(group) for group in self._groups}
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()  # state, ppid, pgrp, ...
            except OSError:
                continue  # ended meanwhile
            if fields[2] in groups and fields[0] != "Z":
                alive.append(int(stat.parent.name))
        return alive

    def executors(self) -> dict[str, int]:
        """Per application that ran on the cluster, how many executors the workers started for it."""
        counts: dict[str, int] = {}
        for directory in self.directory.glob("worker-*/app-*/*"):
            counts[directory.parent.name] = counts.get(directory.parent.name, 0) + 1
        return counts

    def _start(self, name: str, arguments: list[str]) -> None:
        environment = {
            **os.environ,
            "SPARK_HOME": str(self.home),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "SPARK_DAEMON_MEMORY": "256m",
            "SPARK_LOG_DIR": str(self.directory),
        }
        with (self.directory / f"{name}.log").open("wb") as log:
            process = subprocess.Popen(
                [str(self.home / "bin" / "spark-class"), *arguments],
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends what it spawns too
            )
        self._processes.append(process)
        self._groups.append(process.pid)

    def _wait_for_workers(self, workers: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in self._processes:
                if process.poll() is not None:
                    raise ClusterError(
                        f"a cluster process exited with {process.returncode} ({self.directory})"
                    )
            try:
                with urllib.request.urlopen(self._ui, timeout=2) as answer:
                    if json.load(answer).get("aliveworkers", 0) >= workers:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise ClusterError(f"{workers} workers did not register within {timeout} s ({self.directory})")

    def stop(self) -> None:
        """End every process of the cluster (idempotent): SIGTERM to each process group, SIGKILL to what
        remains after a grace period."""
        if not self._processes:
            return
        for group in reversed(self._groups):
            _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        for process in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(max(0.1, deadline - time.monotonic()))
        for group in self._groups:  # what outlived the grace period, executors and Python workers included
            _signal_group(group, signal.SIGKILL)
        for process in self._processes:
            process.wait()
        self._processes.clear()
        deadline = time.monotonic() + _STOP_GRACE_SECONDS
        while self.running() and time.monotonic() < deadline:  # children the kernel is still taking down
            time.sleep(0.05)

    def __enter__(self) -> SparkStandaloneCluster:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _signal_group(group: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)
