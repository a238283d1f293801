"""Held-out test recovery of finished arms: 48 pydoc_summaries documents (never trained on) and the test windows of
held-out corpus documents (kernel docs and pydoc corpus); rows added to WORK/results.json (docs/adapter-training's
results.json). An arm still training is waited for.

  python experiments/adapter-training/eval_arms.py ridge attn_linear kl_linear chain_kl ...
"""

import argparse
import json
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("arms", nargs="+", help="ridge, or names under WORK/runs")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_summaries.jsonl (default: $KVBRIDGE_DATA)")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of build_cache.py and the arms (default: experiments/out/arms)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of pydoc_summaries.jsonl")

from common import CTX, maps_from, ridge, split
from kvbridge.adapters.evaluate import prepare_documents
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import CapacityConfig
from kvbridge.adapters.teacher import TeacherCache
from kvbridge.transfer.presets import load_pair

work = args.work
source, target = load_pair("small", device="cpu")
cache = TeacherCache(work / "cache")
tr, dev, test = split(work, cache)
adapter, stats, fit = ridge(work, target, cache, tr, dev)
start = start_token_id(target.tokenizer)
with open(Path(args.data) / "pydoc_summaries.jsonl", encoding="utf-8") as f:
    texts = [json.loads(line)["document"] for line in f]
t0 = time.perf_counter()
docs = prepare_documents(texts, source, target, 192, 64, limit=48)
kernel_test = [i for i in test if cache.entries[i]["doc_id"].startswith("kernel")]
pydoc_test = [i for i in test if cache.entries[i]["doc_id"].startswith("pydoc")]
probes = {"pydoc_summaries": RecoveryProbe.from_documents(source, target, adapter.start_kv, docs, start),
          "kernel_test": RecoveryProbe.from_cache(target, adapter.start_kv, cache, kernel_test, CTX),
          "pydoc_corpus_test": RecoveryProbe.from_cache(target, adapter.start_kv, cache, pydoc_test, CTX)}
print("probes built in", round(time.perf_counter() - t0), "s", {k: len(p.items) for k, p in probes.items()},
      flush=True)
results_path = work / "results.json"
results = json.loads(results_path.read_text()) if results_path.exists() else {}
for arm in args.arms:
    if arm == "ridge":
        maps, summ = maps_from(adapter, stats, CapacityConfig()), {"elapsed_s": fit["seconds"], "adapter_bytes": None}
    else:
        while not (work / "runs" / arm / "summary.json").exists():  # an arm still training
            time.sleep(10)
        summ = json.loads((work / "runs" / arm / "summary.json").read_text())
        a = summ["args"]
        cap = CapacityConfig(linear=not a["no_linear"], rank=a["rank"], joint=a["joint"])
        maps = maps_from(adapter, stats, cap, work / "runs" / arm / "best.safetensors")
    row = {"summary": summ, "adapter_bytes": maps.adapter_bytes()}
    for name, p in probes.items():
        r = p.recovery(maps)
        row[name] = r
        print(f"{arm:28s} {name:18s} recovery {r['recovery']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
              f" NLL none {r['nll']['none']:.3f} full {r['nll']['full']:.3f} proj {r['nll']['projected']:.3f}",
              flush=True)
    results[arm] = row
    results_path.write_text(json.dumps(results, indent=1))
