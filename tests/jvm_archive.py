"""A class-data-sharing archive of a Spark driver JVM's classes, mapped by the suite's JVMs.

Every `run --engine spark`, the notebook and each worker's session fixture start a Spark driver JVM, and
loading Spark's classes is most of the ~7.5 s of CPU such a start costs; with an archive of those classes
mapped at start (`-XX:SharedArchiveFile`) it measured ~4.4 s. The archive is only valid for one JDK and one
class path (the Spark jars where this environment has them), so it is kept per combination in the Python
environment the suite runs in (`<sys.prefix>/ticdc-consumer-tests/`, ~160 MB, gone with the environment)
and built once, in the background, by a Spark driver that exits normally: the JVM writes it as it exits.
An environment that cannot be written to runs without it. JVMs started before it exists, or with another
class path (Spark's launcher, a standalone cluster's daemons), run as before: the archive's log is
silenced, and a missing archive costs only what it would have saved.

Run as a script (`python tests/jvm_archive.py PARTIAL TARGET`) it is the builder.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pyspark

JVM_LOG_OFF = "-Xlog:cds*=off"  # a JVM that cannot use the archive says so on stdout otherwise


def archive_path(jvm_options: str) -> Path:
    """Where the archive for this JDK, this Spark installation and these JVM options is kept."""
    java = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False).stderr
    key = "\n".join([java, pyspark.__version__, str(Path(pyspark.__file__).parent), jvm_options])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(sys.prefix) / "ticdc-consumer-tests" / f"spark-driver-{digest}.jsa"


class ArchiveBuild:
    """The archive being built in the background, in a process group of its own (the builder and its JVM)."""

    def __init__(self, target: Path, jvm_options: str) -> None:
        self.partial = target.with_suffix(f".{os.getpid()}.partial")
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(self.partial), str(target)],
            env={**os.environ, "JAVA_TOOL_OPTIONS": f"{jvm_options} {JVM_LOG_OFF}"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    def stop(self) -> None:
        """End a build still running (a run shorter than the build: the next run builds it again)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # SIGKILL: a JVM exiting otherwise writes the archive
            self.process.wait()
            self.partial.unlink(missing_ok=True)


def build_in_background(target: Path, jvm_options: str) -> ArchiveBuild | None:
    """Start building `target` unless it exists or its directory cannot be written."""
    if target.exists():
        return None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return ArchiveBuild(target, jvm_options)


def _build(partial: Path, target: Path) -> None:
    """Run a Spark driver through the work every test's driver does first (start, a query, Arrow both ways),
    then end its JVM the way a finished program does, so that it writes the archive; move it into place only
    when whole, so that no JVM ever maps a partial file."""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("jvm-archive")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.extraJavaOptions", f"-XX:ArchiveClassesAtExit={partial}")
        .getOrCreate()
    )
    session.range(1000).selectExpr("sum(id)").collect()
    session.createDataFrame([(1, "a")], "x int, y string").toArrow()
    gateway = SparkContext._gateway
    session.stop()
    assert gateway is not None
    gateway.shutdown()
    gateway.proc.stdin.close()  # the JVM exits when its stdin closes, writing the archive
    if gateway.proc.wait(600) == 0 and partial.exists():
        partial.replace(target)
    else:
        partial.unlink(missing_ok=True)


if __name__ == "__main__":
    _build(Path(sys.argv[1]), Path(sys.argv[2]))
