"""A throwaway S3-protocol server (moto, from `moto[server]`) on a loopback port, for tests and benchmarks.
Its create-only puts are atomic, as on S3 (`consumer.testing.s3_server`).

It runs in its own process (its Python work does not compete with the consumer's GIL) and dies with the
interpreter. Clients reach it through the usual AWS environment variables (`environment()`), as a
deployment would reach real S3. Requests can be recorded, so a test can prove an object was never read.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from consumer.testing.extra import missing_extra
from consumer.testing.ports import free_port

if importlib.util.find_spec("moto") is None:  # the server runs in a child, which would only log the error
    raise missing_extra(__name__, "moto[server]")

_STOP_GRACE_SECONDS = 5.0


class LocalS3Server:
    """A running moto S3 server; starts in the constructor, `stop()` (or `with`) ends it."""

    def __init__(self, *, startup_timeout: float = 30.0) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        directory = Path(tempfile.mkdtemp(prefix="moto-"))
        self._recording = directory / "requests.jsonl"
        self.log_path = directory / "server.log"
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "consumer.testing.s3_server", "--port", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "MOTO_RECORDER_FILEPATH": str(self._recording)},
            )
        try:
            self._wait_until_ready(startup_timeout)
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def storage_options(self) -> dict[str, str]:
        """The delta-rs storage options (and `[sink.storage_options]`) that reach this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
        }

    def environment(self) -> dict[str, str]:
        """What a client process needs to reach this server as S3 (pyarrow, delta-rs, boto3)."""
        return {**self.storage_options, "AWS_EC2_METADATA_DISABLED": "true"}

    def create_bucket(self, name: str) -> None:
        self._call("PUT", f"/{name}")

    def bucket(self) -> str:
        """A new, empty bucket's name."""
        name = f"lake-{uuid.uuid4().hex[:12]}"
        self.create_bucket(name)
        return name

    def start_recording(self) -> None:
        """Forget recorded requests and record from now on."""
        self._call("POST", "/moto-api/recorder/reset-recording")
        self._call("POST", "/moto-api/recorder/start-recording")

    def recorded(self) -> list[dict[str, Any]]:
        """The S3 requests since `start_recording`: each a dict with `method` and `url`."""
        text = self._call("GET", "/moto-api/recorder/download-recording")
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    def stop(self) -> None:
        """End the server (idempotent)."""
        atexit.unregister(self.stop)
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=_STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _wait_until_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"moto server exited with {self._process.returncode} (log: {self.log_path})"
                )
            try:
                self._call("GET", "/moto-api/data.json")
                return
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    message = f"moto server not answering after {timeout} s (log: {self.log_path})"
                    raise RuntimeError(message) from None
                time.sleep(0.05)

    def _call(self, method: str, path: str) -> str:
        body = b"" if method in ("PUT", "POST") else None
        request = urllib.request.Request(self.endpoint + path, data=body, method=method)
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    def __enter__(self) -> LocalS3Server:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
