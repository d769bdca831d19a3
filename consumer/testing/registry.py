"""A Confluent-compatible schema registry for tests: a real HTTP server on localhost, in a thread.

No registry server can be installed here, and a mock client would not exercise the REST calls TiCDC and
our decoder make, so this serves the smallest subset of the Confluent REST API that a producer and a
consumer use through confluent-kafka's `SchemaRegistryClient`:

- `GET /` -> `{}` (TiCDC's connectivity check)
- `POST /subjects/{subject}/versions` -> `{"id": N}`: identical schema text gets the same id everywhere
- `GET /schemas/ids/{id}` -> `{"schema": text}` (404 with error code 40403 when unknown)
- `GET /subjects`, `GET /subjects/{subject}/versions`, `GET /subjects/{subject}/versions/{n|latest}`

It keeps everything in memory, checks no compatibility level, and optionally demands HTTP basic auth. It is
a test fixture, not a registry to run anything on. `answers` makes it misbehave: a path found there is
answered with that JSON body (status 200), whatever the routes would say.
"""

from __future__ import annotations

import base64
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"
_SUBJECT_VERSIONS = re.compile(r"^/subjects/([^/]+)/versions/?$")
_SUBJECT_VERSION = re.compile(r"^/subjects/([^/]+)/versions/([^/]+)$")
_SCHEMA_BY_ID = re.compile(r"^/schemas/ids/(\d+)$")


@dataclass
class _Store:
    """Schema texts by id, and each subject's versions (ids in registration order)."""

    texts: dict[int, str] = field(default_factory=dict)
    ids: dict[str, int] = field(default_factory=dict)
    subjects: dict[str, list[int]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def register(self, subject: str, text: str) -> int:
        with self.lock:
            schema_id = self.ids.get(text)
            if schema_id is None:
                schema_id = self.ids[text] = len(self.texts) + 1
                self.texts[schema_id] = text
            versions = self.subjects.setdefault(subject, [])
            if schema_id not in versions:
                versions.append(schema_id)
            return schema_id


class LocalSchemaRegistry:
    """`with LocalSchemaRegistry() as registry: registry.url` -> a Confluent-compatible registry on localhost.

    With `credentials=("user", "secret")` every request must carry that HTTP basic auth (401 otherwise).
    """

    def __init__(self, *, credentials: tuple[str, str] | None = None) -> None:
        self.store = _Store()
        self.requests = 0  # how many requests were served: tests check the decoder's cache by it
        self.answers: dict[str, Any] = {}  # path -> the JSON body served for it instead (a broken registry)
        expected = (
            "Basic " + base64.b64encode(f"{credentials[0]}:{credentials[1]}".encode()).decode()
            if credentials
            else None
        )
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self, expected))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="schema-registry", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> LocalSchemaRegistry:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> LocalSchemaRegistry:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _handler(registry: LocalSchemaRegistry, expected_auth: str | None) -> type[BaseHTTPRequestHandler]:
    store = registry.store

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet: tests read their own output

        def do_GET(self) -> None:
            if self._authorized():
                path = urlsplit(self.path).path
                if path in registry.answers:
                    self._answer(200, registry.answers[path])
                else:
                    self._answer(*_get(store, path))

        def do_POST(self) -> None:
            if not self._authorized():
                return
            length = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
            except json.JSONDecodeError:
                self._answer(422, {"error_code": 42201, "message": "invalid JSON body"})
                return
            self._answer(*_post(store, urlsplit(self.path).path, body))

        def _authorized(self) -> bool:
            registry.requests += 1
            if expected_auth is None or self.headers.get("Authorization") == expected_auth:
                return True
            self._answer(401, {"error_code": 401, "message": "Unauthorized"})
            return False

        def _answer(self, status: int, body: Any) -> None:
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", _CONTENT_TYPE)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def _get(store: _Store, path: str) -> tuple[int, Any]:
    if path in ("", "/"):
        return 200, {}
    if path == "/subjects":
        return 200, sorted(store.subjects)
    if found := _SCHEMA_BY_ID.match(path):
        text = store.texts.get(int(found.group(1)))
        if text is None:
            return 404, {"error_code": 40403, "message": "Schema not found"}
        return 200, {"schema": text}
    if found := _SUBJECT_VERSIONS.match(path):
        versions = store.subjects.get(unquote(found.group(1)))
        if versions is None:
            return 404, {"error_code": 40401, "message": "Subject not found"}
        return 200, list(range(1, len(versions) + 1))
    if found := _SUBJECT_VERSION.match(path):
        return _version(store, unquote(found.group(1)), found.group(2))
    return 404, {"error_code": 404, "message": f"no route {path}"}


def _version(store: _Store, subject: str, version: str) -> tuple[int, Any]:
    versions = store.subjects.get(subject)
    if not versions:
        return 404, {"error_code": 40401, "message": "Subject not found"}
    number = len(versions) if version == "latest" else int(version) if version.isdigit() else 0
    if not 1 <= number <= len(versions):
        return 404, {"error_code": 40402, "message": "Version not found"}
    schema_id = versions[number - 1]
    return 200, {"subject": subject, "version": number, "id": schema_id, "schema": store.texts[schema_id]}


def _post(store: _Store, path: str, body: Any) -> tuple[int, Any]:
    found = _SUBJECT_VERSIONS.match(path)
    if found is None:
        return 404, {"error_code": 404, "message": f"no route {path}"}
    text = body.get("schema") if isinstance(body, dict) else None
    if not isinstance(text, str):
        return 422, {"error_code": 42201, "message": "body has no schema text"}
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return 422, {"error_code": 42201, "message": "Invalid schema"}
    return 200, {"id": store.register(unquote(found.group(1)), text)}
