"""Writer schemas by id from a Confluent schema registry, through confluent-kafka's `SchemaRegistryClient`.

Ids are immutable, so a fetched schema is cached (parsed) for good; a bounded LRU keeps a long-running
consumer's memory flat. Registering is what encoders (the simulator, users' tests) do, as TiCDC does:
under TopicNameStrategy subjects `<topic with "." as "_">-key` / `-value`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from cachetools import LRUCache
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.error import SchemaRegistryError as ClientError

from consumer.errors import SchemaRegistryError, UnknownSchemaError
from consumer.protocol.ticdc_avro.registry_settings import refused, typed

SCHEMAS_CACHED = 10_000
_NOT_FOUND = (40401, 40402, 40403)
# What confluent-kafka's client raises reading fields of an answer that is no JSON object (`list.pop` with a
# default, `str.get`...), or no JSON at all
_UNREADABLE_ANSWER = (TypeError, AttributeError, KeyError, ValueError)


class SchemaRegistry:
    """`url` may carry `user:password@` (HTTP basic auth, URL-encoded); `config` passes any other
    `SchemaRegistryClient` setting through (e.g. `basic.auth.user.info`, `ssl.ca.location`), its numbers
    (`timeout`, `cache.capacity`...) also as text. A setting the client refuses is a `RegistrySettingsError`
    (a `ConfigError`) naming it."""

    def __init__(self, url: str, config: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self.config = typed(config or {})
        try:
            self.client = SchemaRegistryClient({**self.config, "url": url})
        except Exception as exc:  # the client (and its HTTP client) validate the settings on construction
            raise refused(SchemaRegistryClient, url, self.config, exc) from exc
        self._schemas: LRUCache[int, Any] = LRUCache(SCHEMAS_CACHED)
        self._registered: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()  # encoders may run in a producer thread beside the decoder

    def __reduce__(self) -> tuple[type[SchemaRegistry], tuple[str, dict[str, Any]]]:
        """Pickled as its settings (decode workers build their own client and cache)."""
        return (SchemaRegistry, (self.url, self.config))

    def schema(self, schema_id: int) -> Any:
        """The parsed writer schema (JSON) of `schema_id`."""
        with self._lock:
            cached = self._schemas.get(schema_id)
        if cached is not None:
            return cached
        try:
            text = self.client.get_schema(schema_id).schema_str
        except ClientError as exc:
            if exc.http_status_code == 404 or exc.error_code in _NOT_FOUND:
                raise UnknownSchemaError(f"schema id {schema_id} is not in the registry") from exc
            raise SchemaRegistryError(f"fetching schema id {schema_id}: {exc}") from exc
        except _UNREADABLE_ANSWER as exc:  # the client read fields of an answer that has none
            raise self._not_a_schema(schema_id) from exc
        except Exception as exc:  # connection refused, timeouts, TLS: the registry, not the record
            raise SchemaRegistryError(f"fetching schema id {schema_id}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(text, str):  # an object without schema text
            raise self._not_a_schema(schema_id)
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError as exc:  # Python's words are not ours: where it breaks is what tells
            raise UnknownSchemaError(
                f"schema id {schema_id} is not JSON (its schema text breaks at character {exc.pos})"
            ) from exc
        with self._lock:
            self._schemas[schema_id] = parsed
        return parsed

    def _not_a_schema(self, schema_id: int) -> SchemaRegistryError:
        """The registry's fault, not the record's: its answer is no schema object (a JSON array, a bare
        value, no JSON at all). Named by the URL it came from, without credentials."""
        address = urlsplit(self.url)
        shown = address._replace(netloc=address.netloc.rpartition("@")[2]).geturl().rstrip("/")
        return SchemaRegistryError(
            f"the schema registry answered {shown}/schemas/ids/{schema_id} with something that is not a "
            'schema (expected {"schema": "<Avro schema text>"})'
        )

    def register(self, subject: str, schema: Any) -> int:
        """Register `schema` (JSON) under `subject` (compact text, as TiCDC sends it); returns its id."""
        text = json.dumps(schema, separators=(",", ":"))
        key = (subject, text)
        with self._lock:
            known = self._registered.get(key)
        if known is not None:
            return known
        try:
            schema_id = self.client.register_schema(subject, Schema(text, "AVRO"))
        except Exception as exc:
            raise SchemaRegistryError(f"registering under {subject!r}: {type(exc).__name__}: {exc}") from exc
        with self._lock:
            self._registered[key] = schema_id
            self._schemas[schema_id] = schema
        return schema_id


def subject_names(topic: str) -> tuple[str, str]:
    """TopicNameStrategy as TiCDC applies it: every `.` of the topic becomes `_`."""
    base = topic.replace(".", "_")
    return f"{base}-key", f"{base}-value"
