"""The JSON-lines sink shared by the members of a group: no member's write is taken for a torn line."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

from consumer.sinks.jsonl import JsonLinesSink

WRITES, LINES = 150, 50


def test_members_appending_to_one_file_at_once_lose_no_line(tmp_path: Path) -> None:
    path = tmp_path / "shop" / "orders.jsonl"
    pad = "x" * 2000  # long writes: a reader sees one half-written more often

    def member(name: str) -> None:
        for write in range(WRITES):
            lines = [json.dumps({"member": name, "write": write, "pad": pad}).encode()] * LINES
            JsonLinesSink._append(path, lines)

    threads = [threading.Thread(target=member, args=(name,)) for name in "abc"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    counts = Counter((row["member"], row["write"]) for row in rows)
    assert len(rows) == 3 * WRITES * LINES
    assert set(counts.values()) == {LINES} and len(counts) == 3 * WRITES


def test_a_torn_last_line_is_dropped_before_the_next_append(tmp_path: Path) -> None:
    path = tmp_path / "orders.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2')
    JsonLinesSink._append(path, [b'{"a": 3}'])
    assert path.read_bytes() == b'{"a": 1}\n{"a": 3}\n'
