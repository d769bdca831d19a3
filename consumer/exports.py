"""Public names a package exports without importing their modules up front: a Spark worker, a planner or a
CLI command that needs one name should not pay for the package's every dependency."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def exported(package: str, homes: Mapping[str, str], namespace: dict[str, Any], name: str) -> Any:
    """`package.name`, imported from its home module (`homes`: public name -> module) on first use and kept
    in the package's `namespace`, so the next use is a plain attribute; a module `__getattr__`'s body."""
    if name not in homes:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(homes[name]), name)
    namespace[name] = value
    return value
