"""What replays did with dead letters, kept in the lake root: `<root>/_dead_letters_resolved/`.

Letters themselves are never rewritten (a file is append-only, a Kafka topic immutable), so every
destination shares one side log beside the lake the letters belong to. A replay is a *run*:

    <run>/started.json                           the run's group and the origins it replays, written first
    <run>/failed/<topic>/<partition>/<offset>.json  a letter that failed again, with its new reason, written
                                                 (durably) as the failure happens
    <run>/done.json                              the origins it applied, written last

Runs are named by the time they started (sortable). A letter's state is what the latest run concerning it
says: resolved, or failed with a new reason; a run without `done.json` (the replay stopped) is *in doubt*
for the origins it did not record failed: the next replay finishes it under the same group first.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import msgspec
import pyarrow as pa
import pyarrow.fs as pafs

from consumer.errors import SinkError
from consumer.lakehouse.storage import LakeRoot
from consumer.sinks.dead_letter import DeadLetterObjects, read_letters

SIDE_LOG = "_dead_letters_resolved"
Origin = tuple[str, int, int]  # topic, partition, offset


R = TypeVar("R", bound=msgspec.Struct)


class _Started(msgspec.Struct):
    group: str
    letters: list[Origin]


class _Done(msgspec.Struct):
    resolved: list[Origin]


@dataclass
class Run:
    """One replay: its id, the group its commits are made under, the origins it replays, those it set aside
    again (origin -> (reason_code, reason)), and those it applied (None: not finished, in doubt)."""

    id: str
    group: str
    letters: list[Origin]
    failed: dict[Origin, tuple[str, str]] = field(default_factory=dict)
    resolved: set[Origin] | None = None


class Outcomes:
    """The side log of a lake root (a directory or an object-store URI); a storage failure raises
    SinkError."""

    def __init__(self, root: str, storage_options: Mapping[str, str] | None = None) -> None:
        lake = LakeRoot.of(root, storage_options)
        self._filesystem, path = lake.filesystem()
        self._prefix = f"{path.rstrip('/')}/{SIDE_LOG}"
        self._uri = f"{'file://' if lake.is_local else ''}{lake.join(SIDE_LOG)}"  # a directory URI, always
        self._storage_options = storage_options

    def runs(self) -> list[Run]:
        """Every run recorded, oldest first."""
        with _storage(self._uri):
            selector = pafs.FileSelector(self._prefix, allow_not_found=True)
            names = sorted(info.base_name for info in self._filesystem.get_file_info(selector))
            return [run for run in map(self._run, names) if run is not None]

    def start(self, group: str, letters: list[Origin]) -> Run:
        """Record a new run before it applies anything; its commits go under `<group>:dead-letters:<id>`."""
        run_id = f"{time.time_ns():020d}"
        run = Run(run_id, f"{group}:dead-letters:{run_id}", sorted(letters))
        self._write(f"{run_id}/started.json", _Started(run.group, run.letters))
        return run

    def failures(self, run: Run) -> DeadLetterObjects:
        """Where `run` records the letters it sets aside again."""
        return DeadLetterObjects(f"{self._uri}/{run.id}/failed", self._storage_options)

    def finish(self, run: Run, resolved: set[Origin]) -> None:
        run.resolved = resolved
        self._write(f"{run.id}/done.json", _Done(sorted(resolved)))

    def _run(self, run_id: str) -> Run | None:
        started = self._read(f"{run_id}/started.json", _Started)
        if started is None:  # a run that stopped before recording itself applied nothing
            return None
        run = Run(run_id, started.group, started.letters)
        for letter in read_letters(f"{self._uri}/{run_id}/failed", self._storage_options):
            run.failed[letter.topic, letter.partition, letter.offset] = (letter.reason_code, letter.reason)
        done = self._read(f"{run_id}/done.json", _Done)
        if done is not None:
            run.resolved = set(done.resolved)
        return run

    def _read(self, name: str, kind: type[R]) -> R | None:
        path = f"{self._prefix}/{name}"
        if self._filesystem.get_file_info(path).type != pafs.FileType.File:
            return None
        with self._filesystem.open_input_stream(path) as stream:
            data = stream.read()
        try:
            return msgspec.json.decode(data, type=kind)
        except msgspec.DecodeError as exc:
            raise SinkError(f"{self._uri}/{name} is not a replay record: {exc}") from exc

    def _write(self, name: str, record: _Started | _Done) -> None:
        path = f"{self._prefix}/{name}"
        with _storage(self._uri):
            self._filesystem.create_dir(path.rpartition("/")[0], recursive=True)
            with self._filesystem.open_output_stream(path) as out:
                out.write(msgspec.json.encode(record))


@contextmanager
def _storage(where: str) -> Iterator[None]:
    """Storage failures as the SDK's own error, naming the side log."""
    try:
        yield
    except (OSError, pa.ArrowException) as exc:
        raise SinkError(f"{where}: {exc}") from exc
