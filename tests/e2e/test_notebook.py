"""The quickstart notebook runs top to bottom, and the figures it prints match the simulator's ground truth,
recomputed here independently from the workload configuration the notebook reports."""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from consumer.protocol.model import DDL, DML, DDLType, DMLType
from consumer.simulate.workload import Workload, WorkloadConfig

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"
KERNEL = "python3"
CELL_TIMEOUT = 300  # seconds per cell; the whole notebook takes ~30 s on 2 cores (Spark's start ~10 s)
SUMMARY_PREFIX = "SUMMARY "
pytestmark = pytest.mark.xdist_group("notebook")  # one worker runs the notebook once for all its tests


def _runs_this_interpreter(argv: list[str]) -> bool:
    """jupyter_client replaces a bare `python`/`python3`/`python3.X` with sys.executable; any other path
    must be this very interpreter (not resolved: a venv's python is a symlink to the base one)."""
    bare = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info[:2])}
    return bool(argv) and (argv[0] in bare or os.path.abspath(argv[0]) == os.path.abspath(sys.executable))


def _kernel_manager(tmp_path: Path) -> KernelManager:
    """A `python3` kernel running this interpreter, which has the package installed.

    The installed kernelspec is used when it runs this interpreter; when there is none, or it points at
    another Python (e.g. a user-wide spec for the system Python), ipykernel writes one for sys.executable
    into a temporary directory (no network needed)."""
    manager = KernelSpecManager()
    try:
        usable = _runs_this_interpreter(manager.get_kernel_spec(KERNEL).argv)
    except NoSuchKernel:
        usable = False
    if not usable:
        kernels = tmp_path / "kernels"
        write_kernel_spec(kernels / KERNEL)
        manager = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=manager)


def _stream_text(cell: Any) -> str:
    return "".join(out.get("text", "") for out in cell.get("outputs", ()) if out["output_type"] == "stream")


def _cell(notebook: Any, cell_id: str) -> Any:
    return next(cell for cell in notebook.cells if cell.get("id") == cell_id)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The notebook after a full run (any failing cell fails here with its traceback)."""
    tmp_path = tmp_path_factory.mktemp("notebook")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    kernel = _kernel_manager(tmp_path)
    client = NotebookClient(
        notebook,
        km=kernel,
        timeout=CELL_TIMEOUT,
        startup_timeout=120,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's working directory
    )
    try:
        client.execute()
    finally:  # nbclient leaves a kernel it was handed running, and with it the notebook's Spark JVM
        kernel.shutdown_kernel()
    return notebook


@pytest.fixture(scope="module")
def summary(executed: Any) -> dict[str, Any]:
    lines = _stream_text(_cell(executed, "summary")).splitlines()
    found = [line.removeprefix(SUMMARY_PREFIX) for line in lines if line.startswith(SUMMARY_PREFIX)]
    assert len(found) == 1, lines
    return json.loads(found[0])


def test_the_committed_notebook_is_clean() -> None:
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(notebook)
    assert notebook.metadata["kernelspec"]["name"] == KERNEL
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert "sys.path" not in "".join(cell.source for cell in code)  # the package is installed


@pytest.mark.slow
def test_the_lakehouse_equals_the_ground_truth(summary: dict[str, Any]) -> None:
    workload = Workload(WorkloadConfig(**summary["workload_config"]))
    records = list(workload.records())
    truth = workload.ground_truth()
    live = {name: len(t["rows"]) for name, t in truth["tables"].items() if not t["dropped"]}
    dropped = [r.message for r in records if isinstance(r.message, DDL) and r.message.type is DDLType.ERASE]
    assert all(live.values()) and dropped  # the run exercised non-empty tables and a DROP TABLE

    assert summary["records"] == summary["pipeline"]["records"] == len(records)
    ddls = sum(isinstance(r.message, DDL) for r in records) // workload.config.partitions  # broadcast
    assert summary["pipeline"]["ddls"] == ddls
    assert summary["pipeline"]["dead_letters"] == 0
    assert summary["differences"] == []
    assert summary["mirror_rows"] == live
    assert list(summary["dropped_mirror_rows"].values()) == [0]  # the dropped table, its name taken again
    assert summary["consistent_ts"] == summary["watermark"] == workload.last_watermark


def test_foreach_batch_saw_exactly_the_delta_changelogs(summary: dict[str, Any]) -> None:
    counts = summary["changelog_counts"]
    assert summary["foreach_counts"] == counts
    assert sum(counts.values()) == summary["pipeline"]["rows"]
    assert counts["update_preimage"] == counts["update_postimage"] > 0
    assert counts["insert"] > 0 and counts["delete"] > 0


def test_values_are_typed_in_python_and_in_spark(summary: dict[str, Any]) -> None:
    python_types = summary["python_types"]
    assert {
        "c_decimal": "Decimal",
        "c_wide_decimal": "Decimal",
        "c_bigint_u": "int",
        "c_timestamp": "datetime",
        "c_datetime": "datetime",
        "c_time": "timedelta",
        "c_binary": "bytes",
    }.items() <= python_types.items()
    assert summary["timestamp_zone"] == "UTC"
    assert {
        "c_decimal": "decimal(12,2)",
        "c_bigint_u": "decimal(20,0)",
        "c_timestamp": "timestamp",
        "c_datetime": "timestamp_ntz",
        "c_date": "date",
        "c_time": "interval day to second",
        "_commit_time": "timestamp",
    }.items() <= summary["delta_spark_types"].items()


def test_the_notebook_works_in_a_temporary_directory_and_removes_it(executed: Any) -> None:
    printed = _stream_text(_cell(executed, "imports"))
    work = Path(printed.removeprefix("working in").strip())
    assert work.is_absolute() and not work.is_relative_to(REPO)
    assert not work.exists()  # the last cell cleaned up


@pytest.mark.slow
def test_one_tables_typed_stream_saw_each_of_its_changes_once(summary: dict[str, Any]) -> None:
    workload = Workload(WorkloadConfig(**summary["workload_config"]))
    kinds = {DMLType.INSERT: "insert", DMLType.UPDATE: "update_postimage", DMLType.DELETE: "delete"}
    expected = collections.Counter(
        kinds[r.message.type]
        for r in workload.records()
        if isinstance(r.message, DML) and (r.message.database, r.message.table) == ("shop", "t1")
    )
    assert summary["stream_counts"] == dict(expected)
    assert summary["stream_delta_rows"] == sum(expected.values()) > 0
