"""Bad rows in a resolved batch: typing the batch anyway, without them.

A batch is typed at once (columnar decoding is what makes it fast), so one row that will not type fails the
whole call. The error policy decides: under "fail" that row stops the run; under "dead-letter" it goes to
the dead-letter destination and the rest of the batch is typed again without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from consumer.batches.changes import TableChanges, table_changes
from consumer.errors import DeadLetter, DecodeError, RecordLocation, RejectedRowsError
from consumer.protocol.model import RawDML
from consumer.protocol.table import TableCodec
from consumer.protocol.types import DecodeStats
from consumer.state.machine import ErrorPolicy
from consumer.state.units import RowBatch, RowOrigins

Rows = list[tuple[RawDML, RecordLocation]]

RowDecoder = Callable[[TableCodec, Sequence[tuple[RawDML, RecordLocation]], RowOrigins | None], TableChanges]
"""Types a resolved batch's rows (`table_changes`, or one that takes rows already decoded elsewhere, like the
Spark engine's); raises `ValueDecodeError` naming the bad row's index in `rows`."""


class RowOutput(Protocol):
    """Where a batch's rows go: the typed ones to the sinks, the bad ones to the dead-letter destination."""

    def deliver(self, changes: TableChanges) -> None: ...

    def dead_letter(self, letter: DeadLetter) -> None: ...

    def count_integrity_failures(self, count: int) -> None:
        """Rows that failed verification (a checksum mismatch, TiCDC's `corrupted` flag), dead-lettered."""
        ...


class BadRowRetry:
    """Types row batches with `row_decoder`, taking the rows that do not type out of them."""

    def __init__(
        self, *, error_policy: ErrorPolicy, row_decoder: RowDecoder, decode_stats: DecodeStats
    ) -> None:
        self.error_policy = error_policy
        self.row_decoder = row_decoder
        self.decode_stats = decode_stats

    def write(self, codec: TableCodec, unit: RowBatch, output: RowOutput) -> None:
        """Type the batch's rows and deliver them; each bad row is set aside (or raised, under "fail")."""
        rows = list(unit.rows)
        origins: RowOrigins | None = unit.origins  # until a bad row is taken out
        while rows:
            counted = self.decode_stats.unrepresentable
            try:
                changes = self.row_decoder(codec, rows, origins)
            except DecodeError as exc:
                if self.error_policy == "fail":
                    raise
                self.decode_stats.unrepresentable = counted  # the retry counts the batch's values again
                origins = None
                row = getattr(exc, "row", None)
                if row is None:  # which row is unknown: each alone tells, and is delivered alone
                    self._write_one_by_one(codec, rows, output)
                    return
                self.set_aside([rows.pop(row)], exc, output)
                continue
            except RejectedRowsError as exc:  # every row that failed verification, at once
                if self.error_policy == "fail":
                    raise exc.rejected[min(exc.rejected)] from exc
                self.decode_stats.unrepresentable = counted
                output.count_integrity_failures(len(exc.rejected))
                for index in sorted(exc.rejected, reverse=True):
                    bad_raw, bad_location = rows.pop(index)
                    error = exc.rejected[index]
                    output.dead_letter(DeadLetter(bad_location, str(error), bad_raw.payload, error.code))
                origins = None
                continue
            output.deliver(changes)
            return

    def set_aside(self, rows: Rows, error: DecodeError, output: RowOutput) -> None:
        """Dead-letter rows that cannot be typed (under "fail", raise the first's error instead)."""
        if self.error_policy == "fail":
            raise error.with_location(rows[0][1])
        reason = f"{type(error).__name__}: {error.reason}"
        for raw, location in rows:
            output.dead_letter(DeadLetter(location, reason, raw.payload, error.code))

    def _write_one_by_one(self, codec: TableCodec, rows: Rows, output: RowOutput) -> None:
        """A batch that failed without naming its row: each row on its own (a rare, slow path)."""
        for row in rows:
            try:
                changes = table_changes(codec, [row])
            except DecodeError as exc:
                self.set_aside([row], exc, output)
            else:
                output.deliver(changes)
