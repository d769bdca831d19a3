"""The Prometheus endpoint a running consumer serves on `[metrics] port` (`consumer.progress` starts it):
the pipeline's totals as counters, its state as gauges, the watchdog's stalls as they are when scraped."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from consumer.protocol.model import watermark_lag_seconds
from consumer.watchdog import Watchdog

if TYPE_CHECKING:
    from consumer.pipeline import Pipeline

_TOTALS = {
    "verified_images": "Row images whose checksum matched",
    "integrity_failures": "Rows set aside: checksum mismatch or TiCDC's corrupted flag",
    "claim_check_fetches": "Claim-check objects fetched",
    "claim_check_bytes": "Bytes of claim-check objects fetched",
    "claim_check_seconds": "Time spent fetching claim-checks (with retries)",
    "upstream_lookups": "Row images of handle-key-only messages read from upstream TiDB",
    "resent": "Records skipped as copies of changes already read or applied (re-sent by TiCDC)",
}


class Stalls(Collector):
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


class Metrics:
    def __init__(self, port: int, watchdog: Watchdog | None) -> None:
        self.registry = CollectorRegistry()
        if watchdog is not None:
            self.registry.register(Stalls(watchdog))
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
