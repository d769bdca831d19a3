"""moto's S3 server, with an atomic create-only put (what concurrent Delta commits depend on) and a quicker
dispatch.

moto checks `If-None-Match: *` (and `If-Match`) and then writes, as two steps in one of many request threads,
so two writers of one log entry can both pass the check and the second overwrites the first: exactly the
lost commit that real S3 refuses. Here every conditional write holds one lock, so it is checked and
written with no other conditional write in between (Delta commits are the only writes with a condition);
reads and plain writes (data files) stay concurrent.

moto's own server looks each request's service up among all of moto's packages (a directory listing per
request, most of its CPU for an S3 GET); this one serves S3, and moto's `/moto-api` (state, recording).

Run as `python -m consumer.testing.s3_server --port N` (what `LocalS3Server` does).
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from consumer.testing.extra import missing_extra

try:
    from moto.moto_server.werkzeug_app import MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple
except ModuleNotFoundError as exc:
    raise missing_extra(__name__, "moto[server]") from exc

_CONDITIONS = ("HTTP_IF_NONE_MATCH", "HTTP_IF_MATCH")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def serialized_writes(app: WsgiApp) -> WsgiApp:
    """`app` with its conditional writes run one at a time, so each is atomic."""
    lock = threading.Lock()

    def call(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD") not in ("PUT", "POST") or not any(h in environ for h in _CONDITIONS):
            return app(environ, start_response)
        with lock:
            return list(app(environ, start_response))

    return call


def s3_and_moto_api() -> WsgiApp:
    """moto's S3 app, and its `/moto-api` app for paths under that."""
    s3, api = create_backend_app("s3"), create_backend_app("moto_api")

    def call(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        app = api if environ.get("PATH_INFO", "").startswith("/moto-api") else s3
        return app(environ, start_response)

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    os.environ.setdefault("MOTO_PORT", str(args.port))  # as moto's own server does (it builds URLs with it)
    app = serialized_writes(s3_and_moto_api())
    run_simple(args.host, args.port, app, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
