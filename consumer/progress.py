"""What a running consumer shows: a live table on a terminal, structured log lines otherwise, and an
optional Prometheus endpoint. Called once per pipeline cycle; throttled to about once a second. Stalls are
read from the watchdog when scraped: a cycle blocked in a sink write calls nothing."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rich.console import Console
from rich.live import Live
from rich.table import Table

from consumer.protocol.model import TSO_PHYSICAL_SHIFT
from consumer.watchdog import Watchdog

if TYPE_CHECKING:
    from consumer.pipeline import Pipeline

log = logging.getLogger("consumer.progress")


_TOTALS = {
    "verified_images": "Row images whose checksum matched",
    "integrity_failures": "Rows set aside: checksum mismatch or TiCDC's corrupted flag",
    "claim_check_fetches": "Claim-check objects fetched",
    "claim_check_bytes": "Bytes of claim-check objects fetched",
    "claim_check_seconds": "Time spent fetching claim-checks (with retries)",
    "upstream_lookups": "Row images of handle-key-only messages read from upstream TiDB",
}


def watermark_lag_seconds(watermark: int | None, now: float | None = None) -> float | None:
    if not watermark:
        return None
    return max(0.0, (now or time.time()) - (watermark >> TSO_PHYSICAL_SHIFT) / 1000)


class _Stalls(Collector):
    """The watchdog's stalls as gauges, as they are when scraped."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def collect(self) -> Iterable[Metric]:
        longest: dict[str, float] = {}
        for stall in self.watchdog.stalls():  # longest first: one sample per operation, its longest
            longest.setdefault(stall.operation, stall.seconds)
        overall = GaugeMetricFamily(
            "ticdc_stall_seconds",
            "How long the longest sink or store operation in progress past watchdog.stall_after_s has "
            "waited (0: none)",
            value=max(longest.values(), default=0.0),
        )
        each = GaugeMetricFamily(
            "ticdc_stalled_operation_seconds",
            "Each stalled operation (e.g. DeltaSink.write db.table) and how long it has waited",
            labels=["operation"],
        )
        for operation, seconds in longest.items():
            each.add_metric([operation], seconds)
        return [overall, each]


class _Metrics:
    def __init__(self, port: int, watchdog: Watchdog | None) -> None:
        self.registry = CollectorRegistry()
        if watchdog is not None:
            self.registry.register(_Stalls(watchdog))
        self.rows = Counter("ticdc_rows", "Changelog rows written", ["table"], registry=self.registry)
        self.records = Counter("ticdc_records", "Kafka records consumed", registry=self.registry)
        self.dead_letters = Counter(
            "ticdc_dead_letters", "Records sent to dead letters", registry=self.registry
        )
        self.held = Gauge("ticdc_held_rows", "DMLs waiting for their schema", registry=self.registry)
        self.watermark = Gauge("ticdc_global_watermark", "Global watermark (TSO)", registry=self.registry)
        self.lag = Gauge(
            "ticdc_watermark_lag_seconds", "Now minus the watermark's time", registry=self.registry
        )
        self.totals = {  # counters mirroring a PipelineStats field each
            name: Counter(f"ticdc_{name}", text, registry=self.registry) for name, text in _TOTALS.items()
        }
        self.sink = Counter(
            "ticdc_sink_operations",
            "Sink operation counters, e.g. delta-rs MERGE metrics (files scanned/skipped/rewritten, rows)",
            ["metric"],
            registry=self.registry,
        )
        start_http_server(port, registry=self.registry)
        self._seen: dict[str, float] = {}
        self._seen_sink: dict[str, int] = {}

    def update(self, pipeline: Pipeline) -> None:
        stats, state = pipeline.stats, pipeline.state.stats()
        for table, rows in stats.rows_by_table.items():
            self.rows.labels(table).inc(rows - self._seen.get(table, 0))
            self._seen[table] = rows
        self.records.inc(stats.records - self._seen.get("\0records", 0))
        self._seen["\0records"] = stats.records
        self.dead_letters.inc(stats.dead_letters - self._seen.get("\0dead", 0))
        self._seen["\0dead"] = stats.dead_letters
        for name, counter in self.totals.items():
            total = getattr(stats, name)
            counter.inc(total - self._seen.get(name, 0))
            self._seen[name] = total
        for name, value in stats.sink_metrics.items():
            self.sink.labels(name).inc(value - self._seen_sink.get(name, 0))
            self._seen_sink[name] = value
        self.held.set(state.held_rows)
        self.watermark.set(state.global_watermark or 0)
        self.lag.set(watermark_lag_seconds(state.global_watermark) or 0)


class ProgressReporter:
    """Pass as `on_cycle`; call `close()` when the run ends. `watchdog`: the pipeline's, whose stalls the
    metrics endpoint shows."""

    def __init__(
        self,
        *,
        interactive: bool | None = None,
        metrics_port: int = 0,
        every: float = 1.0,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.every = every
        self.metrics = _Metrics(metrics_port, watchdog) if metrics_port else None
        self._live = Live(console=Console(stderr=True), auto_refresh=False) if self.interactive else None
        if self._live:
            self._live.start()
        self._last = 0.0
        self._last_rows: dict[str, int] = {}

    def __call__(self, pipeline: Pipeline) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            return
        elapsed, self._last = now - self._last if self._last else now - pipeline.stats.started, now
        if self.metrics:
            self.metrics.update(pipeline)
        rates = {
            t: (n - self._last_rows.get(t, 0)) / elapsed for t, n in pipeline.stats.rows_by_table.items()
        }
        self._last_rows = dict(pipeline.stats.rows_by_table)
        if self._live:
            self._live.update(self._table(pipeline, rates), refresh=True)
        else:
            log.info(json.dumps(self._summary(pipeline, rates)))

    def close(self) -> None:
        if self._live:
            self._live.stop()

    @staticmethod
    def _summary(pipeline: Pipeline, rates: dict[str, float]) -> dict[str, object]:
        state = pipeline.state.stats()
        return {
            "records": pipeline.stats.records,
            "rows": pipeline.stats.rows,
            "rows_per_s": {t: round(r) for t, r in rates.items()},
            "global_watermark": state.global_watermark,
            "watermark_lag_s": watermark_lag_seconds(state.global_watermark),
            "held_rows": state.held_rows,
            "waiting_rows": state.waiting_rows,
            "dead_letters": pipeline.stats.dead_letters,
            "verified_images": pipeline.stats.verified_images,
            "integrity_failures": pipeline.stats.integrity_failures,
            "claim_check_fetches": pipeline.stats.claim_check_fetches,
        }

    def _table(self, pipeline: Pipeline, rates: dict[str, float]) -> Table:
        summary = self._summary(pipeline, rates)
        lag = summary["watermark_lag_s"]
        table = Table(
            title=f"watermark {summary['global_watermark']} (lag {lag:.1f} s)"
            if lag is not None
            else "waiting for a watermark on every partition"
        )
        table.add_column("table")
        table.add_column("rows", justify="right")
        table.add_column("rows/s", justify="right")
        for name, rows in sorted(pipeline.stats.rows_by_table.items()):
            table.add_row(name, f"{rows:,}", f"{rates.get(name, 0):,.0f}")
        table.caption = (
            f"{summary['records']:,} records, {summary['held_rows']:,} held for a schema, "
            f"{summary['waiting_rows']:,} waiting for the watermark, "
            f"{summary['dead_letters']} dead letters"
        )
        return table
