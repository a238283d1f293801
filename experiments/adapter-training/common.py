"""What the arms of the first comparison (issue 13) share: the work folder's split, the ridge init, the trainer's
maps. The work folder (the scripts' `--work`, default experiments/out/arms) holds what build_cache.py writes
(cache/, split.json) and what the arms write (ridge/, runs/NAME/, results.json)."""

import json
import os
import time
from pathlib import Path

import torch
from kvbridge.adapters.fit import RidgeStats
from kvbridge.adapters.io import load_adapter, save_adapter
from kvbridge.adapters.residual import ResidualMaps, fit_ridge
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from safetensors.torch import load_file, save_file

torch.set_num_threads(int(os.environ.get("THREADS", "1")))
CTX = 192  # context tokens of a teacher window (the other 64 are the scored continuation)


def split(work: Path, cache: TeacherCache, limit: int | None = None) -> tuple[list[int], list[int], list[int]]:
    """(train, dev, test) window indices of the cache: dev and test as build_cache.py chose them (split.json),
    train every other window of a document that is not held out."""
    s = json.loads((work / "split.json").read_text())
    pos = {e["id"]: i for i, e in enumerate(cache.entries)}
    dev = [pos[i] for i in s["dev"] if i in pos]
    test = [pos[i] for i in s["test"] if i in pos]
    held = set(dev) | set(test)
    train = [i for i, e in enumerate(cache.entries)
             if i not in held and not is_heldout(e["doc_id"], s["heldout_fraction"])]
    assert all(is_heldout(cache.entries[i]["doc_id"], s["heldout_fraction"]) for i in held)
    return train[:limit] if limit else train, dev, test


def ridge(work: Path, target, cache: TeacherCache, train: list[int], dev: list[int]):
    """The ridge init, fitted once from the cache and saved in WORK/ridge (or $RIDGE_DIR): (adapter, training
    statistics, fit record)."""
    path = Path(os.environ.get("RIDGE_DIR", work / "ridge"))
    if (path / "ridge.safetensors").exists():
        stats = RidgeStats.from_state_dict(load_file(str(path / "stats.safetensors")))
        return load_adapter(path / "ridge.safetensors"), stats, json.loads((path / "fit.json").read_text())
    path.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    adapter, stats = fit_ridge(cache, train, dev, target)
    info = {"seconds": time.perf_counter() - t0, "train_windows": len(train), "train_tokens": stats.count}
    save_adapter(adapter, path / "ridge.safetensors")
    save_file(stats.state_dict(), str(path / "stats.safetensors"))
    (path / "fit.json").write_text(json.dumps(info))
    return adapter, stats, info


def maps_from(adapter, stats, capacity, checkpoint=None, seed=0) -> ResidualMaps:
    """The trainer's residual maps over the ridge adapter, with a checkpoint's weights if given."""
    torch.manual_seed(seed)
    maps = ResidualMaps(adapter, stats, capacity)
    if checkpoint:
        t = load_file(str(checkpoint))
        maps.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("maps.")})
    return maps
