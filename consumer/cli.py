"""The `ticdc-consumer` command line."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click
import msgspec
from msgspec import inspect

from consumer import __version__
from consumer.config import DecodeConfig, RunConfig, kafka_source_parts, load_config
from consumer.config_fields import FLAGS, ConfigField, config_overrides, default_text
from consumer.errors import ConfigError, ConsumerError
from consumer.large_messages.claim_check import ClaimCheckWriter
from consumer.large_messages.encoder import DEFAULT_MAX_MESSAGE_BYTES, LargeMessageEncoder
from consumer.protocol.base import RecordDecoder
from consumer.protocol.model import (
    DDL,
    TSO_PHYSICAL_SHIFT,
    Bootstrap,
    KeyOnlyDML,
    RawDML,
    TableSchema,
    Watermark,
)
from consumer.protocol.plain import message_object
from consumer.protocol.protocols import PROTOCOLS
from consumer.protocol.simple.encoder import MessageEncoder
from consumer.protocol.table import TableCodec
from consumer.protocol.types import ValuePolicy
from consumer.sources.errors import SourceAuthenticationError, SourceUnreachableError
from consumer.testing.extra import MissingExtraError
from consumer.watchdog import Watchdog

# What one command needs is imported by that command: `--help` loads no engine, and `run` (what most
# processes start for) neither the simulator, the encoders and the schema registry's HTTP stack, nor the
# status and dead-letter readers, nor rich.
if TYPE_CHECKING:
    from consumer.lakehouse.status import DeadLetterStatus, LakeStatus
    from consumer.pipeline import PipelineStats
    from consumer.redrive import LetterState
    from consumer.simulate.output import StreamWriter

T = TypeVar("T")

# Exit codes (the README's table): 1 is an unexpected error (a traceback), 2 also click's usage errors.
EXIT_BAD_INPUT = 2  # stopped on a ConsumerError: a bad record under policy "fail", a sink that failed...
EXIT_SCHEMA_MISSING = 3  # `decode`: DMLs whose schema never came
EXIT_UNAPPLIED = 3  # `run --until-idle`: went idle with rows still waiting (a WATERMARK, a schema) or unread
EXIT_SOURCE_UNAVAILABLE = 4  # the brokers refused this client, or none could be reached
# `run --until-idle`: went idle with no partition held by any of its members (never assigned, or lost)
EXIT_UNASSIGNED = 5
EXIT_NO_LAKEHOUSE = 2  # `status`: the root holds no lakehouse (or another ConsumerError, e.g. no such topic)
EXIT_BEHIND = 3  # `status --max-lag-s S`: the consistent point is older than S seconds (or unknown)
EXIT_UNRESOLVED = 3  # `dead-letters replay`: letters failed again (they keep their letter, with the reason)
EXIT_INTERRUPTED = 130  # a second Ctrl-C/SIGTERM before the clean stop the first asked for finished
_PROTOCOLS = click.Choice(list(PROTOCOLS))
# --protocol and what the TiCDC Avro protocol needs: its registry and the producer's zone
_PROTOCOL_FIELDS = (
    "decode.protocol",
    "decode.schema_registry",
    "decode.schema_registry_auth",
    "decode.timestamp_zone",
)
_CLICK_TYPES: dict[type[inspect.Type], click.ParamType] = {
    inspect.StrType: click.STRING,
    inspect.IntType: click.INT,
    inspect.FloatType: click.FLOAT,
}


def _config_options(*keys: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Flags for configuration fields (`section.field`; none given: every field with a flag), named and
    described by the structs, None when not given; `config_overrides` turns the command's parameters back into
    `load_config`'s overrides."""
    by_key = {field.key: field for field in FLAGS.values()}
    chosen = [by_key[key] for key in keys] if keys else list(FLAGS.values())

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        for field in reversed(chosen):
            function = _config_option(field)(function)
        return function

    return decorate


def _config_option(field: ConfigField) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    assert field.flag, field.key  # FLAGS holds only fields with a flag
    default = default_text(field)
    help_text = f"{field.help}  [default: {default}]" if default else field.help
    if field.is_switch:
        switch = f"{field.flag}/--no-{field.param.replace('_', '-')}"
        return click.option(switch, field.param, default=None, help=help_text)
    return click.option(field.flag, field.param, type=_click_type(field.type), help=help_text)


def _click_type(kind: inspect.Type) -> click.ParamType:
    """str, int and float as such (optional or not); literals and bools as a choice of their TOML texts."""
    members = kind.types if isinstance(kind, inspect.UnionType) else (kind,)
    given = [member for member in members if not isinstance(member, inspect.NoneType)]
    if len(given) == 1 and type(given[0]) in _CLICK_TYPES:
        return _CLICK_TYPES[type(given[0])]
    return click.Choice([text for member in given for text in _choice_texts(member)])


def _choice_texts(member: inspect.Type) -> tuple[str, ...]:
    if isinstance(member, inspect.LiteralType):
        return tuple(map(str, member.values))
    if isinstance(member, inspect.BoolType):
        return ("true", "false")
    raise TypeError(f"no command-line flag for a {member}: give its field flag=False")


@click.group()
@click.version_option(__version__, prog_name="ticdc-consumer", message="%(prog)s %(version)s")
def main() -> None:
    """Consumer SDK for TiCDC's Kafka protocols: Simple, Avro (Confluent) and Debezium."""


@main.command()
@_config_options("decode.encoding", "decode.compression", *_PROTOCOL_FIELDS)
@click.argument(
    "paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def decode(paths: tuple[Path, ...], **flags: Any) -> None:
    """Decode raw record values (one per file, in order, as one stream) to JSON lines.

    Files hold record values only: an Avro key-only DELETE (a tombstone) needs `run`, which reads keys."""
    from consumer.configured import build_decoder

    settings = config_overrides(flags)["decode"]
    try:
        config = msgspec.convert({k: v for k, v in settings.items() if v is not None}, DecodeConfig)
        policy = ValuePolicy(timestamp_location=config.timestamp_zone)
        stream = _DecodeStream(build_decoder(config, policy), policy)
    except (msgspec.ValidationError, ConsumerError) as exc:
        raise click.UsageError(str(exc)) from exc
    for path in paths:
        stream.feed(path)
    for (database, table, version), waiting in stream.waiting_for_schema().items():
        click.echo(
            f"{len(waiting)} DML(s) of {database}.{table} waited for schema version {version}, "
            f"which never arrived: {', '.join(waiting)}",
            err=True,
        )
    if stream.bad_files:
        sys.exit(EXIT_BAD_INPUT)
    if stream.waiting_for_schema():
        sys.exit(EXIT_SCHEMA_MISSING)


class _DecodeStream:
    """Schema messages feed the cache; a DML waits (in order) until its schema version is known."""

    def __init__(self, decoder: RecordDecoder, policy: ValuePolicy) -> None:
        self.decoder = decoder
        self.policy = policy
        self.codecs: dict[tuple[str, str, int], TableCodec] = {}
        self.held: dict[tuple[str, str, int], list[tuple[Path, RawDML]]] = {}
        self.bad_files = 0
        self._encoder = msgspec.json.Encoder()

    def feed(self, path: Path) -> None:
        try:
            message = self.decoder.decode_record(None, path.read_bytes())
            if isinstance(message, KeyOnlyDML):  # shown as sent: its key columns (the rest is elsewhere)
                message = message.row
            if isinstance(message, RawDML):
                self._dml(path, message)
                return
            self._emit(message)
            if isinstance(message, Bootstrap | DDL):
                self._learn(message)
        except ConsumerError as exc:
            self._bad(path, exc)

    def _dml(self, path: Path, raw: RawDML) -> None:
        described = self.decoder.described_schema(raw.schema_key)
        if described is not None:
            self._register(described)
        codec = self.codecs.get(raw.schema_key)
        if codec is None:
            self.held.setdefault(raw.schema_key, []).append((path, raw))
        else:
            self._emit(codec.decode(raw))

    def _learn(self, message: Bootstrap | DDL) -> None:
        schemas = (
            [message.table_schema]
            if isinstance(message, Bootstrap)
            else [s for s in (message.table_schema, message.pre_table_schema) if s is not None]
        )
        for schema in schemas:
            self._register(schema)

    def _register(self, schema: TableSchema) -> None:
        if schema.key not in self.codecs:
            self.codecs[schema.key] = TableCodec(schema, self.policy, protocol=self.decoder.protocol)
        for path, raw in self.held.pop(schema.key, []):
            try:
                self._emit(self.codecs[schema.key].decode(raw))
            except ConsumerError as exc:
                self._bad(path, exc)

    def _emit(self, message: Watermark | Bootstrap | DDL | object) -> None:
        sys.stdout.buffer.write(self._encoder.encode(message_object(message)) + b"\n")  # type: ignore[arg-type]

    def _bad(self, path: Path, exc: ConsumerError) -> None:
        self.bad_files += 1
        click.echo(f"{path}: {type(exc).__name__}: {exc}", err=True)

    def waiting_for_schema(self) -> dict[tuple[str, str, int], list[str]]:
        return {key: [str(p) for p, _ in rows] for key, rows in self.held.items() if rows}


@main.command()
@click.option("--brokers", help="Kafka bootstrap servers HOST:PORT (or use --out for a capture file)")
@click.option("--topic", required=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="write a capture file instead")
@click.option("--partitions", type=int, default=3, show_default=True)
@click.option("--encoding", type=click.Choice(["json", "avro"]), default="json", show_default=True)
@click.option(
    "--compression", type=click.Choice(["none", "snappy", "lz4"]), default="none", show_default=True
)
@click.option("--tables", type=int, default=4, show_default=True)
@click.option("--rows", type=int, default=10_000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--dispatch", type=click.Choice(["table", "primary-key"]), default="table", show_default=True)
@click.option("--bootstrap-every-rows", type=int, default=1_000, show_default=True)
@click.option("--bootstrap-every-seconds", type=float, default=120.0, show_default=True)
@click.option("--bootstrap-partition0-only", is_flag=True, help="send-bootstrap-to-all-partition = false")
@click.option("--watermark-every-txns", type=int, default=50, show_default=True)
@click.option("--no-ddl", is_flag=True, help="no DDLs after the initial CREATE TABLEs")
@click.option(
    "--resends",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="TiCDC restarts: each sends again every change after its checkpoint (at-least-once delivery)",
)
@click.option("--checksum", is_flag=True, help="rows carry TiDB row checksums (integrity-check-level)")
@click.option(
    "--large-message",
    type=click.Choice(["none", "handle-key-only", "claim-check"]),
    default="none",
    show_default=True,
    help="large-message-handle-option for DMLs over --max-message-bytes",
)
@click.option("--max-message-bytes", type=int, default=DEFAULT_MAX_MESSAGE_BYTES, show_default=True)
@click.option("--claim-check-uri", help="claim-check-storage-uri: file:///DIR, s3://BUCKET/PREFIX, ...")
@click.option("--claim-check-raw-value", is_flag=True, help="claim-check objects hold bare values")
@click.option("--truth", type=click.Path(dir_okay=False, path_type=Path), help="ground-truth file to write")
@click.option("--protocol", type=_PROTOCOLS, default="simple", show_default=True)
@click.option("--schema-registry", help="Confluent registry URL the avro protocol registers its schemas in")
@click.option("--tidb-extension", is_flag=True, help="avro/debezium: enable-tidb-extension = true")
@click.option(
    "--avro-watermark", is_flag=True, help="avro: avro-enable-watermark = true (needs --tidb-extension)"
)
@click.option("--debezium-disable-schema", is_flag=True, help="debezium: debezium-disable-schema = true")
def simulate(brokers: str | None, topic: str, out: Path | None, truth: Path | None, **options: Any) -> None:
    """Produce a TiCDC-like stream (Simple, Avro or Debezium protocol) and write its ground truth."""
    from consumer.simulate.output import produce_to_kafka, write_capture_file, write_ground_truth
    from consumer.simulate.workload import Workload, WorkloadConfig

    if not brokers and not out:
        raise click.UsageError("give --brokers (produce to Kafka) or --out (write a capture file)")
    encoder = _with_large_messages(_stream_writer(options, topic), options)
    config = WorkloadConfig(
        tables=options["tables"],
        rows=options["rows"],
        partitions=options["partitions"],
        seed=options["seed"],
        dispatch=options["dispatch"],
        bootstrap_every_rows=options["bootstrap_every_rows"],
        bootstrap_every_seconds=options["bootstrap_every_seconds"],
        bootstrap_to_all_partitions=not options["bootstrap_partition0_only"],
        watermark_every_txns=options["watermark_every_txns"],
        ddl=not options["no_ddl"],
        checksums=options["checksum"],
        resends=options["resends"],
    )
    workload = Workload(config)
    if out:
        report = write_capture_file(workload, encoder, topic, out)
    else:
        report = produce_to_kafka(workload, encoder, brokers, topic)  # type: ignore[arg-type]
    truth_path = truth or Path(f"{topic}-truth.json")
    write_ground_truth(workload, truth_path)
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(report.by_kind.items()))
    resent = f", {report.resent} of them re-sent" if report.resent else ""
    click.echo(
        f"produced {report.records} records to {out or topic} ({kinds}{resent}); ground truth in {truth_path}"
    )


def _with_large_messages(writer: StreamWriter, options: dict[str, Any]) -> StreamWriter:
    """The Simple protocol's writer with TiCDC's large-message handling, when asked for."""
    option, max_bytes = options.pop("large_message"), options.pop("max_message_bytes")
    uri, raw_value = options.pop("claim_check_uri"), options.pop("claim_check_raw_value")
    if option == "none":
        return writer
    if not isinstance(writer, MessageEncoder):
        raise click.UsageError("--large-message applies to the simple protocol")
    if option == "claim-check" and not uri:
        raise click.UsageError("--large-message claim-check needs --claim-check-uri")
    claim_check = ClaimCheckWriter(uri, raw_value=raw_value) if option == "claim-check" and uri else None
    return LargeMessageEncoder(writer, option, max_bytes, claim_check)


def _stream_writer(options: dict[str, Any], topic: str) -> StreamWriter:
    protocol, extension = options.pop("protocol"), options.pop("tidb_extension")
    registry, watermark = options.pop("schema_registry"), options.pop("avro_watermark")
    disable_schema = options.pop("debezium_disable_schema")
    encoding, compression = options.pop("encoding"), options.pop("compression")
    if protocol == "avro":
        from consumer.protocol.ticdc_avro.encoder import ConfluentAvroEncoder
        from consumer.protocol.ticdc_avro.registry import SchemaRegistry
        from consumer.protocol.ticdc_avro.schemas import AvroOptions
        from consumer.simulate.output import AvroStream

        if not registry:
            raise click.UsageError("--protocol avro needs --schema-registry URL")
        avro = AvroOptions(tidb_extension=extension, watermark=watermark and extension)
        return AvroStream(ConfluentAvroEncoder(SchemaRegistry(registry), avro), topic)
    if protocol == "debezium":
        from consumer.protocol.debezium.encoder import DebeziumEncoder, DebeziumOptions
        from consumer.simulate.output import DebeziumStream

        options_ = DebeziumOptions(
            tidb_extension=extension, disable_schema=disable_schema, compression=compression
        )
        return DebeziumStream(DebeziumEncoder(options_))
    return MessageEncoder(encoding, compression)


@main.command()
@click.option("--brokers", required=True, help="Kafka bootstrap servers HOST:PORT")
@click.option("--topic", required=True)
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--idle-seconds", type=float, default=5.0, show_default=True, help="stop after this long without records"
)
@click.option(
    "--from-group", help="start from this consumer group's committed offsets instead of the beginning"
)
def capture(brokers: str, topic: str, out: Path, idle_seconds: float, from_group: str | None) -> None:
    """Write a topic's records (all partitions) to a JSON-lines capture file, for offline replay."""
    from consumer.sources.kafka import capture_topic

    count = capture_topic(brokers, topic, out, idle_seconds=idle_seconds, from_committed_group=from_group)
    click.echo(f"captured {count} records of {topic} to {out}")


@main.command("run")
@click.option(
    "--config",
    "config_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="a TOML file of the settings below and those without a flag",
)
@click.option(
    "--until-idle",
    type=float,
    help="stop cleanly once no change record arrived for this many seconds, at the end of the partitions",
)
@_config_options()
def run_command(config_path: Path | None, until_idle: float | None, **flags: Any) -> None:
    """Consume a topic (or a capture file) into lakehouse tables.

    Settings come from the --config file, then TICDC_CONSUMER_<SECTION>_<FIELD> environment variables,
    then these flags (the README's Configuration table)."""
    from consumer import app
    from consumer.progress import ProgressReporter

    try:
        config = load_config(config_path, overrides=config_overrides(flags))
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    watchdog = Watchdog(config.watchdog.stall_after_s)
    reporter = ProgressReporter(metrics_port=config.metrics.port, watchdog=watchdog)
    try:
        stats = _exiting_on_errors(
            lambda: app.run(
                config, until_idle=until_idle, on_cycle=reporter, pause_gc=True, watchdog=watchdog
            ),
            said="stopped",
        )
    except KeyboardInterrupt:
        click.echo("interrupted: records after the last commit are read again on restart", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        reporter.close()
    _report_totals(stats)
    _report_ends(stats)
    if stats.unapplied:
        _report_unapplied(stats)
    if (stats.unapplied or any(end.unread for end in stats.ends)) and not stats.stopped_on_request:
        sys.exit(EXIT_UNAPPLIED)
    if stats.unassigned_s is not None and not stats.stopped_on_request:
        _report_unassigned(config, stats.unassigned_s)
        sys.exit(EXIT_UNASSIGNED)


def _report_totals(stats: PipelineStats) -> None:
    click.echo(
        f"{stats.records} records, {stats.rows} changelog rows, {stats.ddls} DDLs, "
        f"{stats.dead_letters} dead letters, {stats.resent} re-sent (skipped)"
    )
    if stats.verified_images or stats.integrity_failures:
        click.echo(
            f"checksums: {stats.verified_images} row images verified, "
            f"{stats.integrity_failures} rows failed verification"
        )
    if stats.claim_check_fetches or stats.upstream_lookups:
        click.echo(
            f"large messages: {stats.claim_check_fetches} claim-checks fetched "
            f"({stats.claim_check_bytes} bytes, {stats.claim_check_seconds:.1f} s), "
            f"{stats.upstream_lookups} upstream lookups"
        )
    merges = stats.sink_metrics.get("merges")
    if merges:
        metrics = stats.sink_metrics
        click.echo(
            f"{merges} mirror MERGEs: {metrics['num_target_files_scanned']} files scanned, "
            f"{metrics['num_target_files_skipped_during_scan']} skipped, "
            f"{metrics['num_target_files_removed']} rewritten; {metrics['num_output_rows']} rows written for "
            f"{metrics['num_target_rows_updated'] + metrics['num_target_rows_inserted']} upserted and "
            f"{metrics['num_target_rows_deleted']} deleted"
        )
    if stats.stalls:
        waits = ", ".join(f"{operation} {seconds:.1f} s" for operation, seconds in stats.stalls.items())
        click.echo(f"stalls (longest wait of each operation that stalled): {waits}", err=True)


def _report_ends(stats: PipelineStats) -> None:
    """Per topic, the offsets read against its end offsets, as a fetch found them when the run went idle:
    exit 0 claims every partition was read to its end. What is left, per partition, exits 3."""
    totals: dict[str, list[int]] = {}
    for end in stats.ends:
        read, ends, partitions = totals.setdefault(end.topic, [0, 0, 0])
        totals[end.topic] = [read + end.end - end.unread, ends + end.end, partitions + 1]
    for topic, (read, ends, partitions) in sorted(totals.items()):
        click.echo(f"{topic}: read to {read} of its end offsets' {ends} ({partitions} partitions)")
    left = [end for end in stats.ends if end.unread]
    if left:
        offsets = sum(end.unread for end in left)
        click.echo(f"{offsets} offset(s) left unread (not committed: a restart reads them):", err=True)
        for end in left:
            click.echo(f"  {end}", err=True)


def _report_unassigned(config: RunConfig, seconds: float) -> None:
    """Idle without a partition proves nothing applied: say so, and who holds the group's partitions."""
    group = config.source.group
    click.echo(f"no partitions assigned to group {group} within {seconds:.0f} seconds", err=True)
    from consumer.app import describe_consumer_group

    click.echo(describe_consumer_group(config).summary(), err=True)


def _report_unapplied(stats: PipelineStats) -> None:
    """Records the run stopped without applying: never committed, so read again on restart."""
    rows = sum(u.waiting_rows + u.held_rows for u in stats.unapplied)
    ddls = sum(u.waiting_ddls for u in stats.unapplied)
    click.echo(
        f"{rows} row(s) and {ddls} DDL(s) not applied (not committed either: a restart reads them again):",
        err=True,
    )
    for unapplied in stats.unapplied:
        click.echo(f"  {unapplied}", err=True)


@main.command()
@click.option(
    "--sink", "sink_url", help="delta:ROOT or parquet:ROOT (ROOT a directory or an object-store URI)"
)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--cluster", is_flag=True, help="rewrite mirrors sorted by their key (Z-order), not just compact"
)
@click.option(
    "--retention-hours",
    type=int,
    default=168,
    show_default=True,
    help="VACUUM files removed longer ago than this (at least the tables' own retention)",
)
@click.option("--no-vacuum", is_flag=True, help="compact, purge and checkpoint only")
@click.option(
    "--as-of-retention",
    default="7d",
    show_default=True,
    help="as-of reads stay exact this far back (e.g. 7d, 36h, 90m; 'all' keeps every change); older "
    "changelog rows go, and mirrors' files a read within it needs are not vacuumed",
)
def maintain(
    sink_url: str | None,
    config_path: Path | None,
    cluster: bool,
    retention_hours: int,
    no_vacuum: bool,
    as_of_retention: str,
) -> None:
    """Keep a lakehouse fast: compact or cluster its Delta tables, purge recent deletes below the consistent
    point, remove changes older than the as-of retention needs, VACUUM, checkpoint; safe while consumers
    write."""
    from consumer.lakehouse.maintenance import maintain as run_maintenance

    try:
        config = load_config(config_path, overrides={"sink": {"url": sink_url}}, sink_only=True)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    root = config.sink.url.partition(":")[2]
    report = run_maintenance(
        root,
        config.sink.storage_options,
        cluster=cluster,
        retention_hours=retention_hours,
        vacuum=not no_vacuum,
        as_of_retention_hours=retention_span_hours(as_of_retention),
    )
    for done in report.tables:
        outcome = (
            f"error: {done.error}"
            if done.error
            else (
                f"{done.files_before} -> {done.files_after} files ({done.files_rewritten} rewritten"
                f"{', clustered' if done.clustered else ''}), {done.files_vacuumed} vacuumed"
                f"{f', {done.deletes_purged} deletes purged' if done.deletes_purged else ''}"
                f"{f', {done.changes_removed} changes past as-of retention' if done.changes_removed else ''}"
            )
        )
        click.echo(f"{done.uri.removeprefix(root).lstrip('/')}: {outcome}")
    click.echo(
        f"{len(report.tables)} tables maintained in {report.seconds:.1f} s; "
        f"consistent at TSO {report.consistent_ts}; as-of reads answer from TSO {report.as_of_from}"
    )
    if any(done.error for done in report.tables):
        sys.exit(1)


@main.command()
@click.option("--sink", "sink_url", help="delta:ROOT (a directory or an object-store URI)")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--table", "name", required=True, help="DATABASE.TABLE, the name the table had then")
@click.option("--as-of-tso", type=int, help="a TSO (default: the consistent point)")
@click.option(
    "--as-of-time",
    type=click.DateTime(["%Y-%m-%dT%H:%M:%S%z", "%Y-%m-%dT%H:%M:%S.%f%z", "%Y-%m-%dT%H:%M:%S"]),
    help="a wall-clock time, ISO 8601 (UTC unless it has an offset), as the TSO of its millisecond",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path), help="Parquet file")
def snapshot(
    sink_url: str | None,
    config_path: Path | None,
    name: str,
    as_of_tso: int | None,
    as_of_time: datetime | None,
    out: Path,
) -> None:
    """Write a table's rows as of a TSO (or a time) to a Parquet file, exact from the lakehouse's earliest
    retained change to its consistent point."""
    import pyarrow.parquet as pq

    from consumer.lakehouse.tables import TsoOutOfRangeError, read_mirror

    if as_of_tso is not None and as_of_time is not None:
        raise click.UsageError("give --as-of-tso or --as-of-time, not both")
    database, dot, table = name.partition(".")
    if not dot:
        raise click.UsageError(f"--table {name!r}: expected DATABASE.TABLE")
    try:
        config = load_config(config_path, overrides={"sink": {"url": sink_url}}, sink_only=True)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    tso = as_of_tso if as_of_time is None else time_tso(as_of_time)
    root = config.sink.url.partition(":")[2]
    try:
        rows = read_mirror(root, database, table, storage_options=config.sink.storage_options, as_of_tso=tso)
    except TsoOutOfRangeError as exc:
        raise click.ClickException(str(exc)) from exc
    if rows is None:
        raise click.ClickException(f"no table {name} with a mirror {'now' if tso is None else f'at {tso}'}")
    pq.write_table(rows, out)
    click.echo(
        f"{rows.num_rows} rows of {name} as of {'the consistent point' if tso is None else tso} -> {out}"
    )


def retention_span_hours(span: str) -> float | None:
    """`--as-of-retention`: a number of days, hours or minutes (`7d`, `36h`, `90m`) in hours; `all`: None."""
    if span.strip().lower() == "all":
        return None
    units = {"d": 24.0, "h": 1.0, "m": 1 / 60}
    number, unit = span.strip()[:-1], span.strip()[-1:].lower()
    try:
        hours = float(number) * units[unit]
    except (KeyError, ValueError) as exc:
        raise click.BadParameter(
            f"{span!r}: expected e.g. 7d, 36h, 90m or all", param_hint="--as-of-retention"
        ) from exc
    if hours < 0:
        raise click.BadParameter(f"{span!r}: negative", param_hint="--as-of-retention")
    return hours


def time_tso(moment: datetime) -> int:
    """The TSO of a wall-clock time's millisecond (physical milliseconds << 18); naive times are UTC."""
    aware = moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)
    return int(aware.timestamp() * 1000) << TSO_PHYSICAL_SHIFT


@main.command()
@click.option(
    "--sink", "sink_url", help="ROOT (a directory or an object-store URI), or delta:ROOT / parquet:ROOT"
)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--brokers", help="Kafka bootstrap servers HOST:PORT: adds committed and end offsets, the lag")
@click.option("--topic", help="the topic the lake consumes (with --brokers)")
@click.option("--group", help="only this consumer group (default: every group the lake recorded)")
@click.option(
    "--dead-letter", help="where dead letters go when not the default: file:PATH, a URI or kafka://HOST/TOPIC"
)
@click.option("--max-lag-s", type=float, help="exit 3 when the consistent point is older than this")
@click.option("--json", "as_json", is_flag=True, help="print the status as JSON (the README's shape)")
def status(
    sink_url: str | None,
    config_path: Path | None,
    brokers: str | None,
    topic: str | None,
    group: str | None,
    dead_letter: str | None,
    max_lag_s: float | None,
    as_json: bool,
) -> None:
    """How far a lakehouse is, and whether anything is stuck: its tables, consistent point, each group's
    offsets and lag, rows left waiting at the last stop, dead letters. A health check with --max-lag-s."""
    if bool(brokers) != bool(topic):
        raise click.UsageError("give --brokers and --topic together")
    if sink_url and not sink_url.startswith(("delta:", "parquet:")):
        sink_url = f"delta:{sink_url}"
    overrides = {"sink": {"url": sink_url}, "errors": {"dead_letter": dead_letter}}
    try:
        config = load_config(config_path, overrides=overrides, sink_only=True)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        report = lake_status(config, group=group, brokers=brokers, topic=topic)
    except (SourceAuthenticationError, SourceUnreachableError) as exc:
        click.echo(f"error: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_SOURCE_UNAVAILABLE)
    except ConsumerError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(EXIT_NO_LAKEHOUSE)
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        _show_status(report)
    if max_lag_s is not None and report.behind(max_lag_s):
        sys.exit(EXIT_BEHIND)


def lake_status(
    config: RunConfig, *, group: str | None = None, brokers: str | None = None, topic: str | None = None
) -> LakeStatus:
    """The configured sink root's status (`consumer.lakehouse.status`): with each group's Kafka offsets in
    `topic` when `brokers` and `topic` are given (`group`, else every group the lake recorded), and the
    dead letters wherever the configuration sends them."""
    from consumer.lakehouse.status import read_status, with_kafka
    from consumer.sources.lookups import group_offsets

    root = config.sink.url.partition(":")[2]
    status = read_status(root, config.sink.storage_options, group=group)
    if brokers and topic:
        groups = [group] if group else sorted({p.group for p in status.partitions})
        status = with_kafka(status, group_offsets(brokers, topic, groups, config=config.source.kafka))
    return msgspec.structs.replace(status, dead_letters=_dead_letter_status(config))


def _dead_letter_status(config: RunConfig) -> DeadLetterStatus:
    from consumer.configured import dead_letter_target
    from consumer.lakehouse.status import DeadLetterStatus
    from consumer.sinks.dead_letter import count_letters
    from consumer.sources.lookups import count_by_header

    target = dead_letter_target(config)
    if target.startswith("kafka://"):
        servers, topics = kafka_source_parts(target)
        counts = count_by_header(
            servers, topics[0], "ticdc.reason_code", distinct_by="ticdc.source", config=config.errors.kafka
        )
    else:
        where = target if "://" in target else target.partition(":")[2]
        counts = count_letters(where, config.sink.storage_options)
    return DeadLetterStatus(
        destination=target, total=sum(counts.values()), by_reason_code=dict(sorted(counts.items()))
    )


def _show_status(report: LakeStatus) -> None:
    from rich.console import Console
    from rich.table import Table

    age = "unknown" if report.consistent_age_s is None else f"{report.consistent_age_s:.1f} s ago"
    console = Console()
    console.print(f"[bold]{report.root}[/bold]: consistent at TSO {report.consistent_ts} ({age})")
    if report.as_of_from is not None:
        console.print(f"as-of reads answer from TSO {report.as_of_from} to {report.consistent_ts}")
    tables = Table(
        "table",
        "location",
        "mirror rows",
        "changelog rows",
        "last change ts",
        "committed s ago",
        "mirror holds to ts",
        "exact",
    )
    for t in report.tables:
        sizes = (t.mirror_rows, t.changelog_rows, t.last_change_ts, t.freshness_s, t.mirror_ts)
        exact = "-" if t.mirror_exact is None else ("yes" if t.mirror_exact else "no")
        tables.add_row(f"{t.database}.{t.table}", t.location, *map(_cell, sizes), exact)
    partitions = Table(
        "group", "partition", "lake offset", "committed", "end", "lag", "lag s", "waiting", "held", "re-sent"
    )
    for p in report.partitions:
        numbers = (p.lake_offset, p.committed_offset, p.end_offset, p.lag_records, p.lag_s)
        counts = (p.waiting_rows, p.held_rows, p.resent)
        partitions.add_row(p.group, f"{p.topic}[{p.partition}]", *map(_cell, (*numbers, *counts)))
    console.print(tables, partitions)
    letters = report.dead_letters
    if letters is not None:
        codes = ", ".join(f"{code or '(none)'}: {n}" for code, n in letters.by_reason_code.items())
        console.print(
            f"dead letters in {letters.destination}: {letters.total}" + (f" ({codes})" if codes else "")
        )


def _cell(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _dead_letter_options(function: Any) -> Any:
    """What `dead-letters list` and `replay` share: the lake, its configuration, a reason filter, JSON."""
    options = [
        click.option(
            "--sink",
            "sink_url",
            help="ROOT (a directory or an object-store URI), or delta:ROOT / parquet:ROOT",
        ),
        click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path)),
        click.option(
            "--group", help="the consumer group the lake is written by (a replay commits beside it)"
        ),
        click.option(
            "--dead-letter",
            help="where dead letters go when not the default: file:PATH, a URI or kafka://HOST/TOPIC",
        ),
        click.option("--reason", "reason_code", help="only letters set aside for this reason_code now"),
        click.option("--json", "as_json", is_flag=True, help="print JSON"),
    ]
    for option in reversed(options):
        function = option(function)
    return function


def _dead_letter_config(config_path: Path | None, sink_url: str | None, flags: dict[str, Any]) -> RunConfig:
    """`run`'s layered configuration for a lake given by --sink (bare roots are Delta lakes)."""
    if sink_url and not sink_url.startswith(("delta:", "parquet:", "jsonl:")):
        sink_url = f"delta:{sink_url}"
    layered = config_overrides(flags)
    layered.setdefault("sink", {})["url"] = sink_url
    try:
        return load_config(config_path, overrides=layered, sink_only=True)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc


@main.group("dead-letters")
def dead_letters() -> None:
    """Records the error policy set aside: list them, replay them once their cause is fixed."""


@dead_letters.command("list")
@_dead_letter_options
def list_letters(
    config_path: Path | None, sink_url: str | None, reason_code: str | None, as_json: bool, **flags: Any
) -> None:
    """The letters (origin, reason, whether a replay applied them), each record once."""
    from consumer.redrive import letter_states

    config = _dead_letter_config(config_path, sink_url, flags)
    letters = _exiting_on_errors(lambda: letter_states(config, reason_code))
    if as_json:
        click.echo(msgspec.json.encode(letters).decode())
        return
    _show_letters(letters, f"{len(letters)} dead letters, {sum(x.resolved for x in letters)} resolved")


@dead_letters.command("replay")
@_dead_letter_options
@_config_options("sink.mode", "decode.encoding", *_PROTOCOL_FIELDS)
def replay_letters(
    config_path: Path | None, sink_url: str | None, reason_code: str | None, as_json: bool, **flags: Any
) -> None:
    """Apply the unresolved letters to the lake with the current configuration, exactly once; a letter
    that fails again keeps its new reason (exit 3)."""
    from consumer.redrive import replay

    config = _dead_letter_config(config_path, sink_url, flags)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    report = _exiting_on_errors(lambda: replay(config, reason_code))
    if as_json:
        click.echo(msgspec.json.encode(report).decode())
    else:
        runs = ", ".join(report.runs) or "none needed"
        summary = f"{report.resolved} letters applied, {len(report.failed)} failed again (runs: {runs})"
        _show_letters(report.failed, summary)
    if report.failed:
        sys.exit(EXIT_UNRESOLVED)


def _exiting_on_errors(job: Callable[[], T], said: str = "error") -> T:
    """Run a command's job; a failure it names ends the command with its exit code."""
    try:
        return job()
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    except (SourceAuthenticationError, SourceUnreachableError) as exc:
        click.echo(f"{said}: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_SOURCE_UNAVAILABLE)
    except ConsumerError as exc:
        click.echo(f"{said}: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)


def _show_letters(letters: Sequence[LetterState], summary: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if letters:
        table = Table("origin", "reason code", "resolved", "reason")
        for x in letters:
            table.add_row(
                f"{x.topic}[{x.partition}]@{x.offset}", x.reason_code, "yes" if x.resolved else "no", x.reason
            )
        console.print(table)
    console.print(summary)


@main.command()
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("demo-output"),
    show_default=True,
    help="each run writes to a fresh run-<time> directory under it",
)
@click.option("--rows", type=int, default=20_000, show_default=True, help="DML events to simulate")
@click.option("--encoding", type=click.Choice(["json", "avro"]), default="json", show_default=True)
@click.option("--compression", type=click.Choice(["none", "snappy", "lz4"]), default="lz4", show_default=True)
def demo(workdir: Path, rows: int, encoding: str, compression: str) -> None:
    """Embedded broker, simulated TiCDC, a mid-stream joiner, Delta and Parquet, checked against the truth."""
    try:
        from consumer.demo import DemoSettings, run_demo  # Spark and Delta load only for the demo
    except MissingExtraError as exc:  # a plain install has no embedded broker
        raise click.ClickException(f"the demo runs the embedded Kafka broker: {exc}") from exc

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    run_dir = workdir / time.strftime("run-%Y%m%d-%H%M%S")
    report = run_demo(run_dir, DemoSettings(rows=rows, encoding=encoding, compression=compression))
    if report.mirror_differences or report.late_join.delivered_rows != report.late_join.expected_rows:
        sys.exit(1)


if __name__ == "__main__":
    main()
