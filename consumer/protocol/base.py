"""What every protocol shares: the `Protocol` interface, the record decoder it builds, and the row images a
table version's rows decode into.

A `Protocol` (`consumer.protocol.simple`, `.ticdc_avro`, `.debezium`) is chosen once, from the configuration
(`decode.protocol`, see `consumer.protocol.protocols.protocol_for`). It gives the two halves of decoding:

- `record_decoder`: Kafka record (key, value) -> message (`RecordDecoder`); a DML waits in a `RawDML` for
  the table version that types its values;
- `table_rows`: the rows of one table version -> typed Arrow images (`TableRows`), which `TableCodec`
  dispatches to.

Every record decoder names its protocol (`RecordDecoder.protocol`), so whatever holds a decoder builds the
matching `TableCodec`s.
"""

from __future__ import annotations

import abc
import contextlib
import enum
import gc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple
from typing import Protocol as TypingProtocol

import pyarrow as pa

from consumer.errors import ConsumerError
from consumer.protocol.compression import CompressionSetting
from consumer.protocol.containment import KeyedValue, contained
from consumer.protocol.model import DML, Checksum, DecodedMessage, RawDML, TableSchema
from consumer.protocol.types import ColumnType, ValuePolicy

ProtocolName = Literal["simple", "avro", "debezium"]
EncodingSetting = Literal["auto", "json", "avro"]


# -- row images --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowImages:
    """The `data` and `old` images of a batch of DMLs, one Arrow row per DML in each.

    A DML without that image (INSERT has no `old`, DELETE no `data`) has an all-null row there and
    False in `has_data` / `has_old`. Columns absent from the wire are null.
    """

    data: pa.RecordBatch
    old: pa.RecordBatch
    has_data: list[bool]
    has_old: list[bool]


class ImageKind(enum.IntEnum):
    """Which row image of its DML a change row is (an UPDATE carries both, docs/protocols/simple.md §3.3)."""

    INSERT = 0
    UPDATE_OLD = 1
    UPDATE_NEW = 2
    DELETE = 3


@dataclass(frozen=True)
class ChangeImages:
    """The row images of a batch of DMLs in change order: an INSERT's new row, an UPDATE's old row then its
    new row, a DELETE's old row. An image missing from the wire (Go drops a map whose every column was
    filtered out) is an all-null row. Each value is decoded once, for the image it belongs to."""

    rows: pa.RecordBatch
    source: list[int]  # the DML (index into the batch) each image comes from
    kinds: list[int]  # each image's `ImageKind`
    # each DML's row checksums (docs/protocols/simple.md §8), None where it sent none
    checksums: list[Checksum | None]


class Images(NamedTuple):
    """What a self-describing protocol's rows decoder returns for a batch of DMLs: the images in change
    order (an UPDATE's old image only where the record has it), the DML each comes from, its `ImageKind`
    value, and whether it holds only the handle key."""

    rows: pa.RecordBatch
    source: list[int]
    kinds: list[int]
    key_only: list[bool]


class TableRows(TypingProtocol):
    """The rows of one table version -> typed values: what `TableCodec` dispatches to. Errors are
    `ConsumerError`s; a `ValueDecodeError` carries `.row` = the index in raws of the DML it met."""

    def decode_batch(self, raws: Sequence[RawDML]) -> RowImages: ...

    def decode_changes(self, raws: Sequence[RawDML]) -> ChangeImages: ...

    def decode(self, raw: RawDML) -> DML: ...


class ImagesDecoder(TypingProtocol):
    """A self-describing protocol's decoder of one table version's rows (TiCDC Avro, Debezium)."""

    def images(self, raws: Sequence[RawDML]) -> Images: ...


class SelfDescribedRows:
    """`TableRows` of a protocol whose records describe their own rows: every reading goes through one
    `images` call of the decoder `make` builds on first use (building it may read a registry, so it happens
    inside the decode's containment). Their row checksums are not verified."""

    def __init__(self, schema: TableSchema, columns: Sequence[ColumnType], make: Callable[[], ImagesDecoder]):
        self.schema = schema
        self.columns = tuple(columns)
        self._make = make
        self._decoder: ImagesDecoder | None = None

    def _images(self, raws: Sequence[RawDML]) -> Images:
        if self._decoder is None:
            self._decoder = self._make()
        return self._decoder.images(raws)

    def decode_changes(self, raws: Sequence[RawDML]) -> ChangeImages:
        with collector_paused(), contained("decoding rows"):
            rows, source, kinds, _ = self._images(raws)
            return ChangeImages(rows, source, kinds, [None] * len(raws))

    def decode_batch(self, raws: Sequence[RawDML]) -> RowImages:
        with collector_paused(), contained("decoding rows"):
            rows, source, kinds, _ = self._images(raws)
            data: list[int | None] = [None] * len(raws)
            old: list[int | None] = [None] * len(raws)
            for position, (index, kind) in enumerate(zip(source, kinds, strict=True)):
                (data if kind in (ImageKind.INSERT, ImageKind.UPDATE_NEW) else old)[index] = position
            return RowImages(  # a null index takes an all-null row: the image a DML does not have
                data=rows.take(pa.array(data, pa.int64())),
                old=rows.take(pa.array(old, pa.int64())),
                has_data=[position is not None for position in data],
                has_old=[position is not None for position in old],
            )

    def decode(self, raw: RawDML) -> DML:
        with contained("decoding rows"):
            rows, _, kinds, key_only = self._images([raw])
            images: dict[int, dict[str, Any]] = {}
            keys = set(self.schema.handle_key())
            for position, kind in enumerate(kinds):
                images[kind] = {
                    c.name: c.to_python(rows.column(i).slice(position, 1))[0]
                    for i, c in enumerate(self.columns)
                    if not key_only[position] or c.name in keys
                }
            old = images.get(ImageKind.UPDATE_OLD, images.get(ImageKind.DELETE))
            new = images.get(ImageKind.UPDATE_NEW, images.get(ImageKind.INSERT))
            return DML(
                type=raw.type,
                database=raw.database,
                table=raw.table,
                table_id=raw.table_id,
                commit_ts=raw.commit_ts,
                build_ts=raw.build_ts,
                schema_version=raw.schema_version,
                data=new,
                old=old,
            )


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """A batch decodes into many short-lived tuples and lists, which the garbage collector's automatic
    passes would scan again and again (7-10% of the time); none of them form reference cycles."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# -- the protocol interface ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecoderSettings:
    """`encoding` applies to the Simple protocol, `compression` to Simple and Debezium, the registry to
    TiCDC Avro (URL, may hold `user:password@`; `registry_config`: more `SchemaRegistryClient` settings)."""

    protocol: ProtocolName = "simple"
    encoding: EncodingSetting = "auto"
    compression: CompressionSetting = "auto"
    registry_url: str = ""
    registry_config: dict[str, Any] = field(default_factory=dict)
    policy: ValuePolicy = field(default_factory=ValuePolicy)


class ProtocolSettingsError(ConsumerError):
    """The decoder cannot be built as configured (e.g. Avro without a registry URL)."""


class RecordDecoder(TypingProtocol):
    """Kafka record (key, value) -> message. `described_schema` gives the table version a returned row's own
    record described (None when BOOTSTRAP/DDL records announce versions, as in the Simple protocol);
    `protocol` is the protocol the records are in, which decodes their rows."""

    @property
    def protocol(self) -> Protocol: ...

    def decode_record(self, key: bytes | None, value: bytes | None) -> DecodedMessage: ...

    def decode_records(self, records: Sequence[KeyedValue]) -> list[DecodedMessage | ConsumerError]:
        """A poll's records: each one's message or the `ConsumerError` it met (see `decoded_each`)."""
        ...

    def described_schema(self, key: tuple[str, str, int]) -> TableSchema | None: ...


class Protocol(abc.ABC):
    """One Kafka protocol TiCDC writes: its record decoding and its row decoding.

    An instance holds what decoding needs beyond the settings (TiCDC Avro: its schema registry client); it
    pickles, so decode workers in other processes get it too.
    """

    name: ClassVar[ProtocolName]
    # Whether the protocol's streams always carry watermarks (the default ordering follows it).
    resolves_by_watermark: ClassVar[bool] = False

    @abc.abstractmethod
    def record_decoder(self, settings: DecoderSettings) -> RecordDecoder:
        """The decoder of this protocol's records, as `settings` configure it."""

    @abc.abstractmethod
    def table_rows(
        self, schema: TableSchema, columns: Sequence[ColumnType], policy: ValuePolicy
    ) -> TableRows:
        """The decoder of the rows of one table version (its validated `columns`, in schema order)."""
