"""The run configuration's fields as data, read from the structs: each one's help text, default and flag.

`run`'s flags, the map from flags to configuration fields and the README's configuration table are all made
from this, so a new setting is one edit: its field in consumer.config. `python -m consumer.config_fields`
prints the table for the README.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
from msgspec import inspect

from consumer.config import RunConfig

MiB = 1024 * 1024


class ConfigField(msgspec.Struct, frozen=True):
    section: str
    name: str
    type: inspect.Type
    default: Any
    help: str
    flag: str | None  # `run`'s flag setting it, e.g. --max-batch-records; None: the file or environment only

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}"

    @property
    def param(self) -> str:
        """The click parameter the flag fills (its name, dashes as underscores)."""
        return (self.flag or "").removeprefix("--").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        """A bool: --NAME/--no-NAME."""
        return isinstance(self.type, inspect.BoolType)


def _fields() -> tuple[ConfigField, ...]:
    return tuple(field for section in _struct(RunConfig).fields for field in _section_fields(section))


def _struct(kind: Any) -> inspect.StructType:
    info = kind if isinstance(kind, inspect.Type) else inspect.type_info(kind)
    assert isinstance(info, inspect.StructType), info
    return info


def _section_fields(section: inspect.Field) -> list[ConfigField]:
    return [_field(section.name, field) for field in _struct(section.type).fields]


def _field(section: str, field: inspect.Field) -> ConfigField:
    meta = field.type
    if not isinstance(meta, inspect.Metadata) or not (meta.extra_json_schema or {}).get("description"):
        raise TypeError(
            f"{section}.{field.name} has no help text: annotate it with consumer.config.described"
        )
    default = field.default_factory() if field.default is inspect.NODEFAULT else field.default
    return ConfigField(
        section=section,
        name=field.name,
        type=meta.type,
        default=default,
        help=str((meta.extra_json_schema or {})["description"]),
        flag=_flag(field.name, meta.type, (meta.extra or {}).get("flag", True)),
    )


def _flag(name: str, kind: inspect.Type, declared: str | bool) -> str | None:
    if isinstance(declared, str):
        return declared
    scalar = not isinstance(kind, inspect.DictType | inspect.ListType)
    return "--" + name.replace("_", "-") if declared and scalar else None


FIELDS = _fields()
# The override map: a flag's click parameter -> the field it sets
FLAGS: dict[str, ConfigField] = {field.param: field for field in FIELDS if field.flag}


def config_overrides(flags: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """`load_config`'s overrides from a command's parameters: those that are configuration flags."""
    found: dict[str, dict[str, Any]] = {}
    for param, value in flags.items():
        if param in FLAGS:
            found.setdefault(FLAGS[param].section, {})[FLAGS[param].name] = value
    return found


def default_text(field: ConfigField) -> str:
    """A default as written in the file ("" for an empty one): sizes in MiB, None as unset."""
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int) and value >= MiB and value % MiB == 0:
        return f"{value // MiB} MiB"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value) if value or value == 0 else ""


def flag_text(field: ConfigField) -> str:
    if field.flag is None:
        return ""
    return f"--[no-]{field.flag.removeprefix('--')}" if field.is_switch else field.flag


def table_cells(field: ConfigField) -> list[str]:
    return [f"`{field.key}`", _code(default_text(field)), _code(flag_text(field)), field.help]


def config_table() -> str:
    """The README's configuration table, one row per field."""
    lines = ["| key | default | flag | meaning |", "| --- | --- | --- | --- |"]
    for field in FIELDS:
        lines.append("| " + " | ".join(table_cells(field)) + " |")
    return "\n".join(lines)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


if __name__ == "__main__":
    print(config_table())
