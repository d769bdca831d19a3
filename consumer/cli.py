"""The `ticdc-consumer` command line."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import click
import msgspec

from consumer import app
from consumer.config import ConfigError, load_config
from consumer.errors import ConsumerError
from consumer.pipeline import PipelineStats
from consumer.progress import ProgressReporter
from consumer.protocol.codec import MessageDecoder, MessageEncoder
from consumer.protocol.model import DDL, Bootstrap, RawDML, TableSchema, Watermark
from consumer.protocol.rows import TableCodec
from consumer.render import message_object
from consumer.simulate.output import produce_to_kafka, write_capture_file, write_ground_truth
from consumer.simulate.workload import Workload, WorkloadConfig
from consumer.sources.capture import capture_topic
from consumer.sources.errors import SourceAuthenticationError, SourceUnreachableError

# Exit codes (the README's table): 1 is an unexpected error (a traceback), 2 also click's usage errors.
EXIT_BAD_INPUT = 2  # stopped on a ConsumerError: a bad record under policy "fail", a sink that failed...
EXIT_SCHEMA_MISSING = 3  # `decode`: DMLs whose schema never came
EXIT_UNAPPLIED = 3  # `run --until-idle`: went idle with rows still waiting (for a WATERMARK or a schema)
EXIT_SOURCE_UNAVAILABLE = 4  # the brokers refused this client, or none could be reached
EXIT_INTERRUPTED = 130  # a second Ctrl-C/SIGTERM before the clean stop the first asked for finished
_ENCODINGS = click.Choice(["auto", "json", "avro"])
_COMPRESSIONS = click.Choice(["auto", "none", "snappy", "lz4"])


@click.group()
def main() -> None:
    """Consumer SDK for TiCDC's Simple protocol."""


@main.command()
@click.option("--encoding", type=_ENCODINGS, default="auto", show_default=True)
@click.option("--compression", type=_COMPRESSIONS, default="auto", show_default=True)
@click.argument(
    "paths", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False, path_type=Path)
)
def decode(encoding: str, compression: str, paths: tuple[Path, ...]) -> None:
    """Decode raw record values (one per file, in order, as one stream) to JSON lines."""
    stream = _DecodeStream(MessageDecoder(encoding, compression))  # type: ignore[arg-type]
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

    def __init__(self, decoder: MessageDecoder) -> None:
        self.decoder = decoder
        self.codecs: dict[tuple[str, str, int], TableCodec] = {}
        self.pending: dict[tuple[str, str, int], list[tuple[Path, RawDML]]] = {}
        self.bad_files = 0
        self._encoder = msgspec.json.Encoder()

    def feed(self, path: Path) -> None:
        try:
            message = self.decoder.decode(path.read_bytes())
            if isinstance(message, RawDML):
                self._dml(path, message)
                return
            self._emit(message)
            if isinstance(message, Bootstrap | DDL):
                self._learn(message)
        except ConsumerError as exc:
            self._bad(path, exc)

    def _dml(self, path: Path, raw: RawDML) -> None:
        codec = self.codecs.get(raw.schema_key)
        if codec is None:
            self.pending.setdefault(raw.schema_key, []).append((path, raw))
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
        self.codecs.setdefault(schema.key, TableCodec(schema))
        for path, raw in self.pending.pop(schema.key, []):
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
        return {key: [str(p) for p, _ in rows] for key, rows in self.pending.items() if rows}


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
@click.option("--truth", type=click.Path(dir_okay=False, path_type=Path), help="ground-truth file to write")
def simulate(brokers: str | None, topic: str, out: Path | None, truth: Path | None, **options: Any) -> None:
    """Produce a TiCDC-like Simple-protocol stream and write its ground truth."""
    if not brokers and not out:
        raise click.UsageError("give --brokers (produce to Kafka) or --out (write a capture file)")
    encoder = MessageEncoder(options.pop("encoding"), options.pop("compression"))
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
    )
    workload = Workload(config)
    if out:
        report = write_capture_file(workload, encoder, topic, out)
    else:
        report = produce_to_kafka(workload, encoder, brokers, topic)  # type: ignore[arg-type]
    truth_path = truth or Path(f"{topic}-truth.json")
    write_ground_truth(workload, truth_path)
    kinds = ", ".join(f"{count} {kind}" for kind, count in sorted(report.by_kind.items()))
    click.echo(f"produced {report.records} records to {out or topic} ({kinds}); ground truth in {truth_path}")


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
    count = capture_topic(brokers, topic, out, idle_seconds=idle_seconds, from_committed_group=from_group)
    click.echo(f"captured {count} records of {topic} to {out}")


@main.command("run")
@click.option("--source", "source_url", help="kafka://HOST:PORT/TOPIC[,TOPIC...] or file:PATH.jsonl")
@click.option("--group", help="consumer group id")
@click.option("--sink", "sink_url", help="delta:ROOT, parquet:ROOT or jsonl:ROOT")
@click.option("--mode", type=click.Choice(["changelog", "mirror", "both"]))
@click.option("--encoding", type=_ENCODINGS)
@click.option("--compression", type=_COMPRESSIONS)
@click.option("--until-idle", type=float, help="stop cleanly once no record arrived for this many seconds")
@click.option("--metrics-port", type=int, help="serve Prometheus metrics on this port")
@click.option(
    "--processes", type=int, help="group members to run, a process each: several cores (Kafka sources)"
)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def run_command(config_path: Path | None, until_idle: float | None, **flags: Any) -> None:
    """Consume a topic (or a capture file) into lakehouse tables."""
    overrides = {
        "source": {"url": flags["source_url"], "group": flags["group"]},
        "sink": {"url": flags["sink_url"], "mode": flags["mode"]},
        "decode": {"encoding": flags["encoding"], "compression": flags["compression"]},
        "metrics": {"port": flags["metrics_port"]},
        "budget": {"processes": flags["processes"]},
    }
    try:
        config = load_config(config_path, overrides=overrides)
    except ConfigError as exc:
        raise click.UsageError(str(exc)) from exc
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    reporter = ProgressReporter(metrics_port=config.metrics.port)
    try:
        stats = app.run(config, until_idle=until_idle, on_cycle=reporter)
    except (SourceAuthenticationError, SourceUnreachableError) as exc:
        click.echo(f"stopped: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_SOURCE_UNAVAILABLE)
    except ConsumerError as exc:
        click.echo(f"stopped: {type(exc).__name__}: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        click.echo("interrupted: records after the last commit are read again on restart", err=True)
        sys.exit(EXIT_INTERRUPTED)
    finally:
        reporter.close()
    click.echo(
        f"{stats.records} records, {stats.rows} changelog rows, {stats.ddls} DDLs, "
        f"{stats.dead_letters} dead letters"
    )
    if stats.unapplied:
        _report_unapplied(stats)
        if not stats.stopped_on_request:
            sys.exit(EXIT_UNAPPLIED)


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
    from consumer.demo import DemoSettings, run_demo  # Spark and Delta load only for the demo

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    run_dir = workdir / time.strftime("run-%Y%m%d-%H%M%S")
    report = run_demo(run_dir, DemoSettings(rows=rows, encoding=encoding, compression=compression))
    if report.mirror_differences or report.late_join.delivered_rows != report.late_join.expected_rows:
        sys.exit(1)


if __name__ == "__main__":
    main()
