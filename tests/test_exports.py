"""Lazy package exports (`kvbridge.transfer.exports`): a package attribute keeps its meaning however the package's
modules were imported."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

PACKAGES = ["kvbridge.transfer", "kvbridge.transfer.suffix", "kvbridge.server", "kvbridge.vllm", "kvbridge.eval",
            "kvbridge.adapters"]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_export_has_the_name_of_a_submodule(package):
    """`import package.name` sets the package's attribute `name` to the submodule: an export of that name would
    change type after the first such import anywhere in the process."""
    module = importlib.import_module(package)
    submodules = {info.name for info in pkgutil.iter_modules(module.__path__)}
    assert not set(module.__all__) & submodules


def test_suffix_blend_is_the_submodule_before_and_after_its_import():
    code = ("import types, kvbridge.transfer.suffix as suffix\n"
            "before = suffix.blend\n"
            "import kvbridge.transfer.suffix.blend\n"
            "assert isinstance(before, types.ModuleType), before\n"
            "assert suffix.blend is before is sys.modules['kvbridge.transfer.suffix.blend']\n"
            "assert suffix.BlendConfig is before.BlendConfig\n")
    done = subprocess.run([sys.executable, "-c", "import sys\n" + code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_an_unknown_name_is_an_attribute_error():
    import kvbridge.transfer.suffix as suffix

    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        suffix.no_such_name  # noqa: B018
