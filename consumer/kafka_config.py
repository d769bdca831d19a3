"""librdkafka client settings as users pass them (`[source.kafka]`, `[errors.kafka]`): which of them are
secrets, and keeping those out of logs and error messages. librdkafka echoes setting values in its own
errors (an invalid value, a failed SASL handshake), so every client of the SDK scrubs its errors here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Final, TypeVar

from confluent_kafka import KafkaError, KafkaException

T = TypeVar("T")
REDACTED: Final = "***"
# Keys whose values are credentials: passwords, client secrets, JAAS/OAUTHBEARER strings, private keys.
_SECRET_KEY_MARKERS = ("password", "secret", "jaas", "oauthbearer.config", "key.pem")


def is_secret_key(key: str) -> bool:
    lowered = key.lower()
    return any(marker in lowered for marker in _SECRET_KEY_MARKERS)


def redact_config(config: Mapping[str, object]) -> dict[str, object]:
    """A copy of a librdkafka config that is safe to log."""
    return {key: REDACTED if is_secret_key(key) else value for key, value in config.items()}


def secret_values(config: Mapping[str, object]) -> list[str]:
    """The values of a config's secret settings, for `scrubbed`."""
    return [value for key, value in config.items() if is_secret_key(key) and isinstance(value, str) and value]


def scrubbed(message: str, secrets: list[str]) -> str:
    """`message` with every secret value replaced by REDACTED."""
    for secret in secrets:
        message = message.replace(secret, REDACTED)
    return message


def create_client(kind: Callable[[dict[str, object]], T], config: dict[str, object]) -> T | KafkaError:
    """A librdkafka client (`Consumer`, `Producer`), or librdkafka's complaint about its config.

    Returned rather than raised: librdkafka echoes invalid config values, and the caller must be able to raise
    a scrubbed error without the original chained to it as `__context__`.
    """
    try:
        return kind(config)
    except KafkaException as exc:
        complaint: KafkaError = exc.args[0]
        return complaint
