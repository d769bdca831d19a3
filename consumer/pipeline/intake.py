"""Records into the state machine: decoded here (a poll's) or before (the Spark engine's executors'), fed in
one call per batch. Key-only DMLs are made whole first, each kept at its record's place; a record that does
not decode, or cannot be made whole, goes to the state's error path between the records before and after it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from consumer.errors import ConsumerError, RecordLocation
from consumer.large_messages.resolver import LargeMessageResolver
from consumer.protocol.base import RecordDecoder
from consumer.protocol.model import DecodedMessage, KeyOnlyDML, TableSchema, Watermark
from consumer.sources.record import SourceRecord
from consumer.state.machine import ConsumerState

DecodedRecord = tuple[RecordLocation, DecodedMessage | ConsumerError, bytes | None, bytes | None]
"""A record decoded before it reached the pipeline: its message, or the error decoding it met, and its value
and key (kept for the dead-letter destination: a replay decodes them again)."""


@dataclass(frozen=True, slots=True)
class _Failed:
    """A record that goes to the error policy instead of the state machine's ordering, and why."""

    error: ConsumerError
    value: bytes | None
    key: bytes | None = None


Decoded = list[tuple[RecordLocation, DecodedMessage | _Failed]]


@dataclass(frozen=True, slots=True)
class Batch:
    """Decoded records ready for the state; `values` and `keys` (the records' own) only when some failed or
    are key-only: the exceptional path needs them (a dead letter keeps both, for a replay)."""

    records: Decoded
    values: list[bytes | None] | None
    keys: list[bytes | None] | None = None


class RecordIntake:
    """Feeds the state machine; `take` says whether a change record (anything but a WATERMARK) was fed."""

    def __init__(
        self, *, state: ConsumerState, decoder: RecordDecoder, large_messages: LargeMessageResolver
    ) -> None:
        self.state = state
        self.decoder = decoder
        self.large_messages = large_messages
        large_messages.schemas = self._schema_of

    def decode(self, records: Sequence[SourceRecord]) -> Batch:
        """A poll's records, decoded; an error of a dependency (the schema registry is down) stops the run
        and sets nothing aside."""
        messages = self.decoder.decode_records(records)
        decoded: Decoded = []
        exceptional = False
        for record, message in zip(records, messages, strict=True):
            if isinstance(message, ConsumerError):
                decoded.append((record.location, _Failed(message, record.value, record.key)))
                exceptional = True
            else:
                exceptional = exceptional or message.__class__ is KeyOnlyDML
                decoded.append((record.location, message))
        if not exceptional:
            return Batch(decoded, None)
        return Batch(decoded, [record.value for record in records], [record.key for record in records])

    def decoded_elsewhere(self, records: Iterable[DecodedRecord]) -> Batch:
        """Records decoded before they reached the pipeline, in each partition's offset order."""
        decoded: Decoded = []
        values: list[bytes | None] = []
        keys: list[bytes | None] = []
        exceptional = False
        for location, message, value, key in records:
            if isinstance(message, ConsumerError):
                decoded.append((location, _Failed(message, value, key)))
                exceptional = True
            else:
                exceptional = exceptional or message.__class__ is KeyOnlyDML
                decoded.append((location, message))
            values.append(value)
            keys.append(key)
        return Batch(decoded, values, keys) if exceptional else Batch(decoded, None)

    def take(self, batch: Batch) -> bool:
        """Hand the batch to the state in one call (in runs, when some records are exceptional)."""
        if batch.values is not None:
            return self._take_exceptional(batch.records, batch.values, batch.keys)
        self.state.process_many(batch.records)  # type: ignore[arg-type]
        return any(not isinstance(message, Watermark) for _, message in batch.records)

    def _take_exceptional(
        self, decoded: Decoded, values: list[bytes | None], keys: list[bytes | None] | None
    ) -> bool:
        """Resolve the batch's key-only DMLs together (their claim-checks are fetched concurrently), then
        feed the state in runs split at the records that go to the error policy."""
        positions = [i for i, (_, message) in enumerate(decoded) if message.__class__ is KeyOnlyDML]
        if positions:
            resolved = self.large_messages.resolve([decoded[i][1] for i in positions])  # type: ignore[misc]
            for position, whole in zip(positions, resolved, strict=True):
                location = decoded[position][0]
                if isinstance(whole, ConsumerError):
                    key = keys[position] if keys is not None else None
                    decoded[position] = (location, _Failed(whole, values[position], key))
                else:
                    decoded[position] = (location, whole)
        run: list[tuple[RecordLocation, DecodedMessage]] = []
        for location, message in decoded:
            if isinstance(message, _Failed):
                self.state.process_many(run)
                run = []
                error = message.error.with_location(location)
                self.state.process_failed(location, error, message.value, key=message.key)
            else:
                run.append((location, message))
        self.state.process_many(run)
        return any(not isinstance(message, Watermark) for _, message in decoded)

    def _schema_of(self, message: KeyOnlyDML) -> TableSchema | None:
        """The known schema of a handle-key-only row (what an upstream lookup is typed by)."""
        return self.state.schemas.lookup(message.row.schema_key, message.row.table_id)
