"""Cross-check: the fast probe vs adapters.evaluate.evaluate_recovery on folded linear adapters (16 docs)."""
import json, sys
sys.path.insert(0, "/work/exp13")
from common import *
from kvbridge.adapters.evaluate import prepare_documents, evaluate_recovery
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.trainer import RecoveryProbe
source, target = load_pair("small", device="cpu")
cache = TeacherCache(EXP / "cache")
tr, dev, test = split(cache)
adapter, stats, fit = ridge(target, cache, tr, dev)
texts = [json.loads(l)["document"] for l in open("/work/shared/data/pydoc_summaries.jsonl")]
docs = prepare_documents(texts, source, target, 192, 64, limit=int(sys.argv[2]))
probe = RecoveryProbe.from_documents(source, target, adapter.start_kv, docs, start_token_id(target.tokenizer))
for arm in sys.argv[1].split(","):
    maps = maps_from(adapter, stats, CapacityConfig(), None if arm == "ridge" else EXP / "runs" / arm / "best.safetensors")
    folded = maps.to_adapter(adapter)
    save_adapter(folded, EXP / f"{arm}-folded.safetensors")
    off = evaluate_recovery(source, target, folded, docs, progress=False)
    mine = probe.recovery(maps)
    print(arm, "official:", off.lines(), "probe:", mine["recovery"], mine["interval"], mine["nll"], flush=True)
