"""The adapters a server can use: loaded by bare name from one folder (never a path outside it), checked against
the served models, one default per (source, target) pair. Only safetensors files are ever read.

Tenants: one tenant must never change what another's requests are projected with. The server's adapters and
defaults (set at start, or by an in-process `add`/`load` without a tenant) serve every tenant; what a tenant loads
(LoadAdapter, or a request naming an adapter not loaded yet) is that tenant's own, under its name, and shadows the
server's adapter of that name for that tenant only; LoadAdapter(make_default) sets that tenant's own default.
Adapters of equal content (`Adapter.digest`) are one object in memory, however many tenants load them."""

from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from kvbridge.adapters.adapter import Adapter
from kvbridge.adapters.io import load_adapter
from kvbridge.server.errors import FailedPrecondition
from kvbridge.transfer.spec import ModelSpec
from safetensors import safe_open

log = logging.getLogger(__name__)

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SUFFIX = ".safetensors"


def check_name(name: str) -> str:
    """The adapter's bare name (a trailing .safetensors is dropped); ValueError for anything path-like."""
    if not isinstance(name, str) or not name:
        raise ValueError("adapter name is empty")
    bare = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else name
    if "/" in bare or "\\" in bare or ".." in bare or not NAME.fullmatch(bare):
        raise ValueError(f"adapter name {name!r} is not a bare name: use letters, digits, '.', '_' and '-' only "
                         "(no paths; adapters load from the server's adapter folder)")
    return bare


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    source_model: str
    target_model: str
    version: str
    layer_map: str
    loaded: bool
    is_default: bool
    metrics: dict


class AdapterRegistry:
    def __init__(self, folder: str | Path | None, source: ModelSpec, targets: list[ModelSpec],
                 device: torch.device | str = "cpu"):
        self.folder = Path(folder).expanduser().resolve() if folder else None
        self.source = source
        self.targets = {t.identity.config_hash: t for t in targets}
        self.device = device
        self._loaded: dict[str, Adapter] = {}  # name -> the server's adapter (every tenant's)
        self._tenant_loaded: dict[tuple[str, str], Adapter] = {}  # (tenant, name) -> what that tenant loaded
        self._by_digest: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # digest -> adapter on device
        self._defaults: dict[str, str] = {}  # target config hash -> adapter name (the server's default)
        self._tenant_defaults: dict[tuple[str, str], str] = {}  # (tenant, target config hash) -> adapter name
        self._lock = threading.RLock()  # _info is called with it held

    # ------------------------------------------------------------------------------------------ files

    def path(self, name: str) -> Path:
        bare = check_name(name)
        if self.folder is None:
            raise ValueError("this server has no adapter folder (start it with --adapters DIR)")
        path = (self.folder / f"{bare}{SUFFIX}").resolve()
        if path.parent != self.folder:  # a symlink pointing out of the folder
            raise ValueError(f"adapter {bare!r} resolves outside the adapter folder")
        return path

    def _read_meta(self, path: Path) -> dict | None:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                header = f.metadata() or {}
            meta = json.loads(header["kvbridge_adapter"])
            if not isinstance(meta, dict):
                raise ValueError("its kvbridge_adapter metadata is not a JSON object")
            return meta
        except Exception as exc:  # not an adapter, or unreadable: listed by nobody
            log.warning("skipping %s: not a readable kvbridge adapter (%s)", path.name, exc)
            return None

    def available(self, tenant: str | None = None) -> list[AdapterInfo]:
        """Every adapter file in the folder, plus adapters added in memory (is_default as `tenant` sees it)."""
        out = {}
        if self.folder is not None and self.folder.is_dir():
            for path in sorted(self.folder.glob(f"*{SUFFIX}")):
                if not _file_name_ok(path):
                    continue
                meta = self._read_meta(path)
                if meta is not None:
                    out[path.stem] = self._info(path.stem, meta, tenant)
        with self._lock:
            for name in {*self._loaded, *(n for t, n in self._tenant_loaded if t == tenant)}:
                out[name] = self._info(name, _meta_dict(self._lookup(name, tenant)), tenant)
        return [out[k] for k in sorted(out)]

    def _lookup(self, name: str, tenant: str | None) -> Adapter | None:
        """The adapter `name` as `tenant` sees it: its own, else the server's; None when neither is loaded."""
        with self._lock:
            own = self._tenant_loaded.get((tenant, name)) if tenant is not None else None
            return own if own is not None else self._loaded.get(name)

    def _default_name(self, target_hash: str, tenant: str | None) -> str | None:
        """The adapter a request naming none uses for this target: the tenant's own default, else the server's."""
        with self._lock:
            own = self._tenant_defaults.get((tenant, target_hash)) if tenant is not None else None
            return own or self._defaults.get(target_hash)

    def _info(self, name: str, meta: dict, tenant: str | None = None) -> AdapterInfo:
        with self._lock:
            loaded = self._lookup(name, tenant) is not None
            default = self._default_name(str(meta.get("target", {}).get("config_hash", "")), tenant) == name
        return AdapterInfo(name=name, source_model=meta.get("source", {}).get("name", "?"),
                           target_model=meta.get("target", {}).get("name", "?"), version=str(meta.get("version", "")),
                           layer_map=str(meta.get("layer_map", "")), loaded=loaded, is_default=default,
                           metrics=meta.get("metrics", {}))

    # ------------------------------------------------------------------------------------------ loading

    def _target_of(self, adapter: Adapter, name: str) -> ModelSpec:
        src, tgt = adapter.meta.source, adapter.meta.target
        if src["config_hash"] != self.source.identity.config_hash or tgt["config_hash"] not in self.targets:
            raise ValueError(f"adapter {name!r} maps {src['name']!r} -> {tgt['name']!r}; this server serves "
                             f"{self.source.name!r} -> {sorted(t.name for t in self.targets.values())}")
        target = self.targets[tgt["config_hash"]]
        adapter.check_models(self.source, target)
        return target

    def add(self, name: str, adapter: Adapter, make_default: bool = False, tenant: str | None = None
            ) -> AdapterInfo:
        """Register an adapter object (an in-memory one, or one just read from the folder): the server's (every
        tenant's) without a tenant, else that tenant's own. make_default: the server's default for its pair, or with
        a tenant that tenant's own; the first adapter of a pair with no default becomes the default the same way."""
        name = check_name(name)
        target = self._target_of(adapter, name)
        digest = adapter.digest  # computed once here, before the move; kept by `to`
        target_hash = target.identity.config_hash
        with self._lock:
            shared = self._by_digest.get(digest)
            adapter = shared if shared is not None else adapter.to(self.device)
            self._by_digest[digest] = adapter
            if tenant is not None:
                self._tenant_loaded[(tenant, name)] = adapter
                if make_default or self._default_name(target_hash, tenant) is None:
                    self._tenant_defaults[(tenant, target_hash)] = name
            else:
                self._loaded[name] = adapter
                if make_default or target_hash not in self._defaults:
                    self._defaults[target_hash] = name
        log.info("adapter %s (%s) loaded%s: %s -> %s%s", name, digest[:16], f" for tenant {tenant}" if tenant else "",
                 self.source.name, target.name, " (default)" if self._default_name(target_hash, tenant) == name else "")
        return self._info(name, _meta_dict(adapter), tenant)

    def load(self, name: str, make_default: bool = False, tenant: str | None = None) -> AdapterInfo:
        path = self.path(name)
        if not path.is_file():
            raise FileNotFoundError(f"no adapter {check_name(name)!r} in the adapter folder")
        try:
            adapter = load_adapter(path)
        except (AttributeError, KeyError, TypeError) as exc:
            raise ValueError(f"adapter {path.stem!r}: its kvbridge_adapter metadata has the wrong shape ({exc})"
                             ) from None
        return self.add(path.stem, adapter, make_default=make_default, tenant=tenant)

    def autoload(self, preferred: str | None = None) -> list[str]:
        """Load a default adapter for each served pair: `preferred` if given, else the newest matching file."""
        if preferred:
            return [self.load(preferred, make_default=True).name]
        if self.folder is None or not self.folder.is_dir():
            return []
        names = []
        files = sorted(self.folder.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime, reverse=True)
        for target_hash in self.targets:
            for path in files:
                meta = self._read_meta(path) if _file_name_ok(path) else None
                if (meta and meta.get("source", {}).get("config_hash") == self.source.identity.config_hash
                        and meta.get("target", {}).get("config_hash") == target_hash):
                    try:
                        names.append(self.load(path.stem).name)
                        break
                    except ValueError as exc:
                        log.warning("adapter %s not usable: %s", path.stem, exc)
        return names

    def default_for(self, target: ModelSpec) -> str | None:
        with self._lock:
            return self._defaults.get(target.identity.config_hash)

    def resolve(self, name: str, source: ModelSpec, target: ModelSpec, tenant: str | None = None
                ) -> tuple[str, Adapter]:
        """(label "name@version", adapter) for a request: the named one as the tenant sees it (loaded from the
        folder on first use, as the tenant's own) or the pair's default (the tenant's own, else the server's).
        Caches key projections by the adapter's `digest`, not by the label: a file replaced under the same name
        and version is another adapter."""
        if name:
            bare = check_name(name)
            adapter = self._lookup(bare, tenant)
            if adapter is None:
                try:
                    bare = self.load(name, tenant=tenant).name
                except FileNotFoundError:
                    raise ValueError(f"adapter: unknown adapter {bare!r} (not loaded, not in the adapter folder)"
                                     ) from None
                adapter = self._lookup(bare, tenant)
        else:
            with self._lock:
                bare = self._default_name(target.identity.config_hash, tenant)
                adapter = self._lookup(bare, tenant) if bare else None
            if adapter is None:
                raise FailedPrecondition(f"no adapter is loaded for {source.name!r} -> {target.name!r}: fit one with "
                                         "`train-adapter`, put it in the adapter folder and call LoadAdapter")
        if adapter.meta.target["config_hash"] != target.identity.config_hash:
            raise ValueError(f"adapter {bare!r} maps to {adapter.meta.target['name']!r}, not to {target.name!r}")
        return f"{bare}@{adapter.meta.version}", adapter


def _file_name_ok(path: Path) -> bool:
    """A file whose stem is a loadable bare name (x.safetensors.safetensors is not: its name would strip to x) and
    that resolves inside its folder (a symlink pointing out is neither listed nor loaded: `AdapterRegistry.path`)."""
    return (bool(NAME.fullmatch(path.stem)) and not path.stem.endswith(SUFFIX)
            and path.resolve().parent == path.parent.resolve())


def _meta_dict(adapter: Adapter) -> dict:
    import dataclasses

    return dataclasses.asdict(adapter.meta)
