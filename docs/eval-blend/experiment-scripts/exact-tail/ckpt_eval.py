"""Recovery of checkpoints of the fine-tunes on documents no step or checkpoint choice saw: the 46 packaged
pydoc_heldout pages (192-token context, 64-token continuation), with 0, 19 (10%) and 38 (20%) context tokens
exact at the end (`recompute:r`'s setting), paired bootstrap against the shipped adapter (zero residual)."""
import json, random, sys
import torch
torch.set_num_threads(2)
from kvbridge.adapters.evaluate import prepare_documents
from kvbridge.adapters.fit import RidgeStats
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from kvbridge.adapters.trainer import RecoveryProbe
from kvbridge.adapters.train import read_corpus
from kvbridge.transfer.data import data_path
from kvbridge.transfer.presets import load_pair
from safetensors.torch import load_file

source, target = load_pair("small", device="cpu")
shipped = load_adapter("/work/main/adapters/shipped/gemma-3-270m-q4_k_m--smollm2-135m-instruct-q4_1--chain.safetensors")
shipped = shipped.__class__(**{**shipped.__dict__, **{n: getattr(shipped, n).float() for n in (
    "mix_k", "mix_v", "wk", "bk", "wv", "bv", "start_kv", "tok_table", "wk_tok", "wv_tok")}})
stats = RidgeStats.from_state_dict(load_file("/work/exp16/work/init/stats.safetensors"))
texts, _ = read_corpus([str(data_path("pydoc_heldout.jsonl"))])
docs = prepare_documents(texts, source, target, 192, 64, limit=100)
probe = RecoveryProbe.from_documents(source, target, shipped.start_kv, docs, shipped.meta.start_token)
arms = {"shipped": None, **{name: path for name, path in (a.split("=") for a in sys.argv[1:])}}
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
    none = sum(probe.none[i] for i in idx); full = sum(probe.full[i] for i in idx); x = sum(col[i] for i in idx)
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
json.dump(out, open("/work/exp16/ckpt_eval.json", "w"), indent=1)
