"""The layering of the package, read from the source: no import from a lower layer to a higher one, no import circle.

Layers, lowest first: the foundation (kvbridge.transfer), its store (.store), the target's pipeline (.suffix), then
kvbridge.adapters, kvbridge.server, kvbridge.eval and the vLLM connector (kvbridge.vllm, side by side), and at the
top the `kvbridge` command (kvbridge.cli) and the benchmarks. kvbridge.proto (generated stubs) imports nothing of
kvbridge. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"kvbridge.transfer": "transfer", "kvbridge.adapters": "adapters", "kvbridge.server": "server",
           "kvbridge.eval": "eval", "kvbridge.vllm": "vllm_connector", "kvbridge.cli": "cli", "kvbridge.proto": "proto"}
RANKS = [("kvbridge.proto", 0), ("kvbridge.transfer.store", 1), ("kvbridge.transfer.suffix", 2),
         ("kvbridge.transfer", 0), ("kvbridge.adapters", 3), ("kvbridge.server", 4), ("kvbridge.eval", 5),
         ("kvbridge.vllm", 5),
         ("kvbridge.cli", 6), ("bench", 6)]


def rank(module: str) -> int:
    for prefix, r in RANKS:
        if module == prefix or module.startswith(prefix + "."):
            return r
    raise AssertionError(f"module {module} belongs to no layer")


def source_modules() -> dict[str, Path]:
    """Every module of the package (and the benchmarks, as bench.NAME) by its import name."""
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    for path in sorted((ROOT / "bench").glob("*.py")):
        out[f"bench.{path.stem}"] = path
    return out


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The kvbridge modules a file imports (`from package import submodule` resolves to the submodule)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("kvbridge."))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = source_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def test_the_walk_sees_the_whole_package(graph):
    assert {"kvbridge.transfer.kvcache", "kvbridge.transfer.store.paged_store", "kvbridge.transfer.suffix.generator",
            "kvbridge.adapters.adapter", "kvbridge.server.service", "kvbridge.eval.run", "kvbridge.cli",
            "bench.bench_store"} <= set(graph)
    assert "kvbridge.transfer.store" in graph["kvbridge.transfer.suffix.cache_manager"]
    assert "kvbridge.transfer.kvcache" in graph["kvbridge.transfer.suffix.reuse"]  # from package import module


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{importer} (layer {rank(importer)}) imports {target} (layer {rank(target)})"
                  for importer, targets in graph.items() for target in targets if rank(target) > rank(importer))


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_runs_from_a_lower_layer_to_a_higher_one(graph):
    assert upward_imports(graph) == []


def test_no_import_circles(graph):
    assert circles(graph) == []


def test_the_checks_catch_what_they_are_for():
    bad = {"kvbridge.transfer.store.registry": {"kvbridge.transfer.suffix.reuse"},  # store -> pipeline: upward
           "kvbridge.transfer.suffix.reuse": {"kvbridge.transfer.kvcache"},
           "kvbridge.server.service": {"kvbridge.server.adapter_registry"},
           "kvbridge.server.adapter_registry": {"kvbridge.server.service"}}  # a circle within one layer
    assert upward_imports(bad) == ["kvbridge.transfer.store.registry (layer 1) imports "
                                   "kvbridge.transfer.suffix.reuse (layer 2)"]
    assert circles(bad) == [["kvbridge.server.adapter_registry", "kvbridge.server.service"]]


@pytest.mark.parametrize("package", ["kvbridge.transfer", "kvbridge.transfer.store", "kvbridge.transfer.suffix",
                                     "kvbridge.adapters", "kvbridge.server", "kvbridge.eval",
                                     "kvbridge.vllm"])
def test_every_exported_name_resolves(package):
    import importlib

    module = importlib.import_module(package)
    assert module.__all__, f"{package} exports nothing"
    for name in module.__all__:
        assert getattr(module, name) is not None, f"{package}.{name}"
    with pytest.raises(AttributeError, match="no attribute"):
        module.no_such_name  # noqa: B018
