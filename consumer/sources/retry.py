"""How a consumer loop treats a source that failed: a transient error (`SourceError.retriable`: a timeout,
a coordinator moving, the group rebalancing after a slow cycle) is tried again with jittered exponential
backoff, a bounded number of times; a permanent one (an unknown topic, refused credentials, brokers
unreachable for longer than the source waits) stops the loop at once."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from consumer.sources.errors import SourceError

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SourceRetry:
    """`attempts`: retries of one call after its first failure (0: none); the n-th waits about
    `backoff * 2**(n-1)` seconds, at most `max_backoff`."""

    attempts: int = 5
    backoff: float = 0.5
    max_backoff: float = 10.0

    def call(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, retried while it fails transiently. Once the retries are spent the last failure stops
        the loop, saying how many attempts were made."""
        retry = 0
        while True:
            try:
                return call()
            except SourceError as exc:
                if not exc.retriable:
                    raise
                if retry == self.attempts:
                    raise SourceError(
                        f"{what}: still failing after {retry + 1} attempts: {exc}",
                        client_code=exc.client_code,
                    ) from exc
                delay = min(self.backoff * 2**retry, self.max_backoff)
                log.warning(
                    "%s failed (%s), retrying in at most %.1f s (%d): %s",
                    what,
                    exc.client_code,
                    delay,
                    retry + 1,
                    exc,
                )
                time.sleep(random.uniform(delay / 2, delay))
                retry += 1
