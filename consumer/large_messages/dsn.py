"""The upstream TiDB DSN (`large_messages.upstream_dsn`) as PyMySQL's connect arguments: apart from the
lookup itself, so that the configuration checks a DSN without loading the MySQL client and the decoders."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


def connection_options(dsn: str) -> dict[str, Any]:
    """`mysql://user:password@host:port/?ssl_ca=PATH&connect_timeout=S` -> PyMySQL connect arguments."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("mysql", "tidb") or not parts.hostname:
        raise ValueError(f"upstream_dsn {dsn!r}: expected mysql://USER:PASSWORD@HOST:PORT")
    query = {name: values[-1] for name, values in parse_qs(parts.query).items()}
    options: dict[str, Any] = {
        "host": parts.hostname,
        "port": parts.port or 4000,
        "user": unquote(parts.username or "root"),
        "password": unquote(parts.password or ""),
        "connect_timeout": float(query.pop("connect_timeout", 10)),
        "read_timeout": float(query.pop("read_timeout", 60)),
        "charset": "utf8mb4",
        "autocommit": True,
        "init_command": "SET time_zone = '+00:00'",
    }
    ssl = {name.removeprefix("ssl_"): query.pop(name) for name in list(query) if name.startswith("ssl_")}
    if ssl:
        options["ssl"] = ssl
    if query:
        raise ValueError(f"upstream_dsn: unknown options {sorted(query)}")
    return options
