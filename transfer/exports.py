"""Package exports imported on first use, so that importing a package (or any module below it) stays cheap."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable


def lazy_exports(package: str, modules: dict[str, list[str]]) -> tuple[list[str], Callable[[str], object]]:
    """(__all__, __getattr__) for `package`: modules maps a module's name to the names it defines that the package
    exports; each module is imported when one of its names is first used. A submodule's name gives the submodule
    (imported then), as it does after `import package.name`: so no export may have a submodule's name, or the
    attribute would change type once the submodule is imported (tests/test_exports.py checks)."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name in where:
            return getattr(importlib.import_module(where[name]), name)
        if not name.startswith("__") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return sorted(where), __getattr__
