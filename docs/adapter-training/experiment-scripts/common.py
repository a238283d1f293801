"""Shared setup of the issue-13 experiments: models, the cache split, the ridge init."""
import json, os, time
from pathlib import Path
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
from kvbridge.transfer.presets import load_pair
from kvbridge.adapters.teacher import TeacherCache, is_heldout
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps, fit_ridge
from kvbridge.adapters.fit import RidgeStats
from kvbridge.adapters.io import save_adapter, load_adapter
from safetensors.torch import save_file, load_file

EXP = Path("/work/exp13")
CTX = 192


def split(cache: TeacherCache, limit: int | None = None):
    s = json.loads((EXP / "split.json").read_text())
    pos = {e["id"]: i for i, e in enumerate(cache.entries)}
    dev = [pos[i] for i in s["dev"] if i in pos]
    test = [pos[i] for i in s["test"] if i in pos]
    held = set(dev) | set(test)
    train = [i for i, e in enumerate(cache.entries) if i not in held and not is_heldout(e["doc_id"], s["heldout_fraction"])]
    assert all(is_heldout(cache.entries[i]["doc_id"], s["heldout_fraction"]) for i in held)
    return train[:limit] if limit else train, dev, test


def ridge(target, cache, train, dev):
    """The ridge init, fitted once from the cache and saved (adapter + training statistics)."""
    path = Path(os.environ.get("RIDGE_DIR", EXP / "ridge"))
    if (path / "ridge.safetensors").exists():
        stats = RidgeStats.from_state_dict(load_file(str(path / "stats.safetensors")))
        return load_adapter(path / "ridge.safetensors"), stats, json.loads((path / "fit.json").read_text())
    path.mkdir(exist_ok=True)
    t0 = time.perf_counter()
    adapter, stats = fit_ridge(cache, train, dev, target)
    info = {"seconds": time.perf_counter() - t0, "train_windows": len(train), "train_tokens": stats.count}
    save_adapter(adapter, path / "ridge.safetensors")
    save_file(stats.state_dict(), str(path / "stats.safetensors"))
    (path / "fit.json").write_text(json.dumps(info))
    return adapter, stats, info


def maps_from(adapter, stats, capacity, checkpoint=None, seed=0):
    torch.manual_seed(seed)
    maps = ResidualMaps(adapter, stats, capacity)
    if checkpoint:
        t = load_file(str(checkpoint))
        maps.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("maps.")})
    return maps
