"""The schema registry client's settings, typed and shown without secrets.

TOML may give a number as text (`timeout = "3"`) and the environment gives nothing else, while
confluent-kafka's `SchemaRegistryClient` takes numbers only (on httpx2, a text `timeout` fails at start). The
numbers are converted here; what the client still refuses is a `RegistrySettingsError` (a `ConfigError`)
naming the setting, its value masked where it is a secret. Light on purpose: the configuration checks it
without loading the client's HTTP stack.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from consumer.errors import ConfigError

# The client's numeric settings: each one's type and what it counts
NUMBERS: dict[str, tuple[type[int] | type[float], str]] = {
    "timeout": (float, "seconds"),
    "cache.capacity": (int, "schemas"),
    "cache.latest.ttl.sec": (float, "seconds"),
    "max.retries": (int, "retries"),
    "retries.wait.ms": (int, "milliseconds"),
    "retries.max.wait.ms": (int, "milliseconds"),
}
MASK = "***"
_SECRET_WORDS = ("password", "secret", "token", "user.info")
_USERINFO = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")


class RegistrySettingsError(ConfigError):
    """A setting of the registry client refused; `settings` names it (the client's key, `url` for the
    address), and the message shows no secret."""

    def __init__(self, message: str, settings: tuple[str, ...]) -> None:
        super().__init__(message)
        self.settings = settings


def is_secret(name: str) -> bool:
    return any(word in name for word in _SECRET_WORDS)


def shown(name: str, value: Any) -> str:
    """A setting's value as a message shows it: secrets masked, a URL without its credentials."""
    if is_secret(name):
        return MASK
    return repr(without_credentials(value) if isinstance(value, str) else value)


def without_credentials(text: str) -> str:
    """`text` with the `user:password@` of every URL in it masked."""
    return _USERINFO.sub(rf"\g<1>{MASK}@", text)


def typed(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The settings with the client's numbers as numbers; `RegistrySettingsError` for one that is none."""
    out = dict(settings)
    for name, (kind, unit) in NUMBERS.items():
        value = out.get(name)
        if value is None or (type(value) in (int, float) and kind is float):
            continue
        try:
            fraction = isinstance(value, float) and kind is int and not value.is_integer()
            if isinstance(value, bool) or fraction:
                raise ValueError(value)
            out[name] = kind(value.strip() if isinstance(value, str) else value)
        except (TypeError, ValueError):
            whole = "a whole number" if kind is int else "a number"
            raise RegistrySettingsError(
                f"schema registry setting {name} = {shown(name, value)}: expected {whole} of {unit}", (name,)
            ) from None
    return out


def refused(
    build: Callable[[dict[str, Any]], object], url: str, settings: Mapping[str, Any], exc: Exception
) -> RegistrySettingsError:
    """The client's refusal of `settings` (`build` makes a client of them and the URL), naming the setting
    it refused: the one whose removal makes `build` succeed. Secrets, the URL's credentials included, are
    masked in the client's words too."""
    culprits = tuple(name for name in settings if _accepts(build, url, settings, name))
    if not culprits:
        culprits = tuple(n for n in settings if n in str(exc)) or ("url",)
    said = str(exc) or type(exc).__name__
    for name, value in settings.items():
        if is_secret(name) and isinstance(value, str) and value:
            said = said.replace(value, MASK)
    address = url.partition("://")[2].rpartition("@")[0]
    if address:
        said = said.replace(address, MASK)
    what = ", ".join(
        f"url = {shown('url', url)}" if name == "url" else f"{name} = {shown(name, settings[name])}"
        for name in culprits
    )
    return RegistrySettingsError(
        f"schema registry setting {what} refused by the registry client: {without_credentials(said)}",
        culprits,
    )


def _accepts(
    build: Callable[[dict[str, Any]], object], url: str, settings: Mapping[str, Any], left_out: str
) -> bool:
    try:
        build({**{k: v for k, v in settings.items() if k != left_out}, "url": url})
    except Exception:  # the client's checks raise ValueError and TypeError, its HTTP client's its own types
        return False
    return True
