"""What a running consumer shows: a live table on a terminal, structured log lines otherwise, and an
optional Prometheus endpoint. Called once per pipeline cycle; throttled to about once a second. Stalls are
read from the watchdog when scraped: a cycle blocked in a sink write calls nothing."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import TYPE_CHECKING

from consumer.protocol.model import watermark_lag_seconds
from consumer.watchdog import Watchdog

if TYPE_CHECKING:  # rich and the Prometheus client load only for a terminal and a metrics port
    from rich.live import Live
    from rich.table import Table

    from consumer.metrics import Metrics
    from consumer.pipeline import Pipeline

log = logging.getLogger("consumer.progress")


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
        self.metrics = _metrics(metrics_port, watchdog) if metrics_port else None
        self._live = _live_display() if self.interactive else None
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
        from rich.table import Table

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


def _metrics(port: int, watchdog: Watchdog | None) -> Metrics:
    from consumer.metrics import Metrics

    return Metrics(port, watchdog)


def _live_display() -> Live:
    """The live table on the terminal's stderr, started."""
    from rich.console import Console
    from rich.live import Live

    live = Live(console=Console(stderr=True), auto_refresh=False)
    live.start()
    return live
