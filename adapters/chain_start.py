"""Where a chain's stages start, kept in its work folder: the ridge fit (ridge/) or the trained adapter `--init` names
with the whitening statistics of the ridge windows through it (init/).

Each is one checkpoint of work_folder.py: its tensors, then its JSON with the *inputs* it was made from
(`start_inputs`: the corpus, the windows, the options that shape it), written last. A rerun reads it back only for
the same inputs, refuses other ones by name, and computes again one left incomplete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import torch
from kvbridge.adapters.adapter import Adapter
from kvbridge.adapters.context import ContextConfig
from kvbridge.adapters.distributed import is_main
from kvbridge.adapters.fit import RidgeStats
from kvbridge.adapters.io import load_adapter, save_adapter
from kvbridge.adapters.residual import adapter_stats, fit_ridge
from kvbridge.adapters.teacher import TeacherCache, Window
from kvbridge.adapters.work_folder import (
    begin_checkpoint,
    check_inputs,
    ids_digest,
    read_checkpoint,
    write_json,
    write_tensors,
)
from kvbridge.transfer.models import LoadedModel
from safetensors.torch import load_file

RIDGE = ("ridge", "fit.json", ("stats.safetensors", "ridge.safetensors"))  # folder, marker, tensor files
INIT = ("init", "init.json", ("stats.safetensors",))


def context_config(config) -> ContextConfig:
    """The context branch a command asks for (--context-window, --context-rank, --context-no-norm)."""
    return ContextConfig(window=config.context_window, rank=config.context_rank, norm=config.context_norm)


def load_init(config, source: LoadedModel, target: LoadedModel) -> Adapter:
    """The trained adapter `config.init` (a ChainConfig's), float32, checked against the models and the branch the
    command asks for; raised before any work (a missing file: FileNotFoundError, another pair: ValueError)."""
    adapter = load_adapter(config.init)
    adapter.check_models(source.spec, target.spec)
    if adapter.ctx_lags is not None and config.context_window and (
            ContextConfig.of(adapter) != context_config(config)):
        raise ValueError(f"{config.init} has a context branch of {len(adapter.ctx_lags)} tokens, rank "
                         f"{adapter.ctx_a.shape[-1]}, {'with' if adapter.context_norm else 'without'} its norm; the "
                         f"command asks for {config.context_window}, rank {config.context_rank}, "
                         f"{'with' if config.context_norm else 'without'} (leave out --context-window to keep the "
                         "adapter's)")
    if adapter.ctx_lags is not None and config.fuser_rank:
        raise ValueError(f"{config.init} has a context branch (adapter format {adapter.meta.format_version}): a "
                         "fuser starts from the linear maps of formats 1-3 only")
    if adapter.ctx_lags is None and config.context_window:
        raise ValueError(f"{config.init} has no context branch: --context-window trains one from a ridge fit, "
                         "not from --init")
    adapter = adapter.with_maps_dtype(torch.float32)
    return dataclasses.replace(adapter, start_kv=None if adapter.start_kv is None else adapter.start_kv.float())


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def start_inputs(config, corpus: dict[str, str], dev: list[Window], ridge_windows: list[Window]) -> dict:
    """What the starting point depends on: the corpus files' sha256, the teacher windows' shape, the windows it reads
    (the dev windows choose the ridge's λ and α) and the options that shape it; with --init, the adapter's sha256 in
    place of the ridge's options."""
    teacher = {k: getattr(config.teacher, k) for k in ("context_tokens", "continuation_tokens", "topk")}
    if config.init:
        return {"corpus": corpus, "init": file_sha256(config.init), "teacher": teacher,
                "ridge_windows": config.ridge_windows, "seed": config.seed,
                "windows": ids_digest(w.id for w in ridge_windows)}
    return {"corpus": corpus, "init": "", "teacher": teacher, "layer_map": config.layer_map, "k": config.k,
            "token_rank": config.token_rank, "source_rank": config.source_rank, "ridge_windows": config.ridge_windows,
            "dev_per_corpus": config.dev_per_corpus, "seed": config.seed,
            "windows": ids_digest([*(w.id for w in dev), "", *(w.id for w in ridge_windows)])}


def read_start(work: Path, config, inputs: dict) -> dict | None:
    """The work folder's complete ridge/ (or init/) checkpoint's JSON when its inputs are this run's; None when there
    is none (or an incomplete one, logged); ValueError naming the option when it was made for other inputs."""
    name, marker, files = INIT if config.init else RIDGE
    folder = work / name
    saved = read_checkpoint(folder, marker, files)
    if saved is None:
        return None
    if config.init and saved.get("sha256") != inputs["init"]:
        raise ValueError(f"{folder} holds the statistics of {saved.get('adapter')} over {saved.get('windows')} "
                         f"windows, not of {config.init}: use another --work or remove {folder} (its teacher/ can be "
                         "reused)")
    check_inputs(saved.get("inputs"), inputs, work, folder,
                 "the statistics of its --init adapter" if config.init else "its ridge fit")
    return saved


def ridge_start(work: Path, saved: dict | None, inputs: dict, cache: TeacherCache, train_idx, dev_idx, target,
                config, progress: bool) -> tuple[Adapter, RidgeStats, float]:
    """The ridge fit: read back from `saved` (read_start's), else fitted and written to work/ridge."""
    folder = work / RIDGE[0]
    if saved is not None:
        stats = RidgeStats.from_state_dict(load_file(str(folder / "stats.safetensors")))
        adapter = load_adapter(folder / "ridge.safetensors")
        if (adapter.token_rank, adapter.source_rank) != (config.token_rank, config.source_rank):
            raise ValueError(f"{folder} holds a ridge fit with token features of rank {adapter.token_rank} and a "
                             f"source basis of rank {adapter.source_rank}, this run asks for {config.token_rank} and "
                             f"{config.source_rank}: use another work folder (its teacher/ can be reused)")
        return adapter, stats, saved["seconds"]
    t0 = time.perf_counter()
    adapter, stats = fit_ridge(cache, train_idx[:config.ridge_windows], dev_idx, target, config.layer_map, config.k,
                               progress=progress, token_rank=config.token_rank, source_rank=config.source_rank)
    seconds = time.perf_counter() - t0
    if is_main():
        begin_checkpoint(folder, RIDGE[1])
        write_tensors(folder / "stats.safetensors", stats.state_dict())
        save_adapter(adapter, folder / "ridge.safetensors")
        write_json(folder / RIDGE[1], {"seconds": seconds, "inputs": inputs})
    return adapter, stats, seconds


def init_start(work: Path, saved: dict | None, inputs: dict, adapter: Adapter, cache: TeacherCache, train_idx,
               target: LoadedModel, config, progress: bool) -> tuple[Adapter, RidgeStats, float]:
    """The --init adapter (load_init's) and the whitening statistics of the ridge windows through it: read back from
    `saved` (read_start's), else computed and written to work/init."""
    folder = work / INIT[0]
    if saved is not None:
        return adapter, RidgeStats.from_state_dict(load_file(str(folder / "stats.safetensors"))), saved["seconds"]
    t0 = time.perf_counter()
    stats = adapter_stats(adapter, cache, train_idx[:config.ridge_windows], target, progress)
    seconds = time.perf_counter() - t0
    if is_main():
        begin_checkpoint(folder, INIT[1])
        write_tensors(folder / "stats.safetensors", stats.state_dict())
        write_json(folder / INIT[1], {"adapter": str(Path(config.init).resolve()), "windows": config.ridge_windows,
                                      "sha256": inputs["init"], "seconds": seconds, "inputs": inputs})
    return adapter, stats, seconds
