"""Held-out test recovery of every finished arm: 48 pydoc_summaries documents (never trained on) and the test
windows of held-out corpus documents (kernel docs and pydoc corpus); plus a cross-check of the fast probe against
adapters.evaluate.evaluate_recovery on folded linear adapters."""
import json, sys, time
sys.path.insert(0, "/work/exp13")
from common import *
from kvbridge.adapters.evaluate import prepare_documents, evaluate_recovery
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.trainer import RecoveryProbe

arms = sys.argv[1:]
source, target = load_pair("small", device="cpu")
cache = TeacherCache(EXP / "cache")
split_ids = json.loads((EXP / "split.json").read_text())
tr, dev, test = split(cache)
adapter, stats, fit = ridge(target, cache, tr, dev)
start = start_token_id(target.tokenizer)
texts = [json.loads(l)["document"] for l in open("/work/shared/data/pydoc_summaries.jsonl")]
t0 = time.perf_counter()
docs = prepare_documents(texts, source, target, 192, 64, limit=48)
probes = {"pydoc_summaries": RecoveryProbe.from_documents(source, target, adapter.start_kv, docs, start),
          "kernel_test": RecoveryProbe.from_cache(target, adapter.start_kv, cache,
                                                  [i for i in test if cache.entries[i]["doc_id"].startswith("kernel")], CTX),
          "pydoc_corpus_test": RecoveryProbe.from_cache(target, adapter.start_kv, cache,
                                                        [i for i in test if cache.entries[i]["doc_id"].startswith("pydoc")], CTX)}
print("probes built in", round(time.perf_counter() - t0), "s", {k: len(p.items) for k, p in probes.items()}, flush=True)
results = json.loads((EXP / "results.json").read_text()) if (EXP / "results.json").exists() else {}
for arm in arms:
    if arm == "ridge":
        maps, summ = maps_from(adapter, stats, CapacityConfig()), {"elapsed_s": fit["seconds"], "adapter_bytes": None}
    else:
        while not (EXP / "runs" / arm / "summary.json").exists():  # an arm still training
            time.sleep(10)
        summ = json.loads((EXP / "runs" / arm / "summary.json").read_text())
        a = summ["args"]
        cap = CapacityConfig(linear=not a["no_linear"], rank=a["rank"], joint=a["joint"])
        maps = maps_from(adapter, stats, cap, EXP / "runs" / arm / "best.safetensors")
    row = {"summary": summ, "adapter_bytes": maps.adapter_bytes()}
    for name, p in probes.items():
        r = p.recovery(maps)
        row[name] = r
        print(f"{arm:28s} {name:18s} recovery {r['recovery']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"
              f" NLL none {r['nll']['none']:.3f} full {r['nll']['full']:.3f} proj {r['nll']['projected']:.3f}", flush=True)
    results[arm] = row
    (EXP / "results.json").write_text(json.dumps(results, indent=1))
