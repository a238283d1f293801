"""Package exports imported on first use, so that importing a package (or any module below it) stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, modules: dict[str, list[str]]) -> tuple[list[str], Callable[[str], object]]:
    """(__all__, __getattr__) for `package`: modules maps a module's name to the names it defines that the package
    exports; each module is imported when one of its names is first used."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(where), __getattr__
