"""Recovery of checkpoints of the fine-tunes on documents no step or checkpoint choice saw: the 46 packaged
pydoc_heldout pages (192-token context, 64-token continuation), with 0, 19 (10%) and 38 (20%) context tokens exact
at the end (`recompute:r`'s setting), paired bootstrap against the shipped adapter (zero residual); the figures also
in WORK/ckpt_eval.json (docs/eval-blend/exact-tail/ckpt_eval.json).

  python experiments/eval-blend/exact-tail/ckpt_eval.py tail=WORK/tail/stage-0-kl/last.safetensors \
      plain=WORK/plain/stage-0-kl/last.safetensors
"""

import argparse
import json
import random
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("arms", nargs="*", help="NAME=CHECKPOINT: a train-adapter checkpoint of a fine-tune")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "exact-tail",
                    help="tail.sh's folder: WORK/tail/init/stats.safetensors are the ridge statistics the "
                         "residual maps are whitened with (default: experiments/out/exact-tail)")
args = parser.parse_args()

import torch
from kvbridge.adapters.evaluate import prepare_documents
from kvbridge.adapters.fit import RidgeStats
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from kvbridge.adapters.shipped import SHIPPED_FOLDER
from kvbridge.adapters.train import read_corpus
from kvbridge.transfer.data import data_path
from kvbridge.transfer.presets import load_pair
from safetensors.torch import load_file

torch.set_num_threads(2)
source, target = load_pair("small", device="cpu")
shipped = load_adapter(SHIPPED_FOLDER / "gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors")
shipped = shipped.__class__(**{**shipped.__dict__, **{n: getattr(shipped, n).float() for n in (
    "mix_k", "mix_v", "wk", "bk", "wv", "bv", "start_kv", "tok_table", "wk_tok", "wv_tok")}})
stats = RidgeStats.from_state_dict(load_file(str(args.work / "tail" / "init" / "stats.safetensors")))
texts, _ = read_corpus([str(data_path("pydoc_heldout.jsonl"))])
docs = prepare_documents(texts, source, target, 192, 64, limit=100)
probe = RecoveryProbe.from_documents(source, target, shipped.start_kv, docs, shipped.meta.start_token)
arms = {"shipped": None, **dict(a.split("=", 1) for a in args.arms)}
rows = {}
for name, path in arms.items():
    maps = ResidualMaps(shipped, stats, CapacityConfig())
    if path:
        t = load_file(path)
        maps.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("maps.")})
    for exact in (0, 19, 38):
        rows[name, exact] = probe.per_document(maps, exact=exact)
rng = random.Random(0)
n = len(docs)
samples = [[rng.randrange(n) for _ in range(n)] for _ in range(1000)]


def rec(idx, col):
    none = sum(probe.none[i] for i in idx)
    full = sum(probe.full[i] for i in idx)
    x = sum(col[i] for i in idx)
    return (none - x) / (none - full)


out = {}
for (name, exact), col in rows.items():
    v = rec(range(n), col)
    boot = sorted(rec(s, col) for s in samples)
    line = f"{name:10s} exact {exact:2d}: {v:.4f} [{boot[25]:.4f}, {boot[974]:.4f}]"
    if name != "shipped":
        base = rows["shipped", exact]
        d = sorted(rec(s, col) - rec(s, base) for s in samples)
        line += f"  vs shipped {v - rec(range(n), base):+.4f} [{d[25]:+.4f}, {d[974]:+.4f}]"
    print(line, flush=True)
    out[f"{name}/{exact}"] = [v, boot[25], boot[974]]
args.work.mkdir(parents=True, exist_ok=True)
(args.work / "ckpt_eval.json").write_text(json.dumps(out, indent=1))
