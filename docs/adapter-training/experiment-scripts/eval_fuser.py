"""Held-out recovery of a fuser on N pydoc_summaries documents (own K/V in fp32, plus the wrong-document control:
each document's own cache fused with the next document's source features).
   python eval_fuser.py RUN_OR_FILE N"""
import json, random, sys
sys.path.insert(0, "/work/exp13")
from common import *
from kvbridge.adapters.evaluate import prepare_documents, bootstrap_recovery
from kvbridge.adapters.fuser import FuserConfig, FuserMaps, load_fuser
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.trainer import RecoveryProbe, context_kv
from kvbridge.transfer.segment import KVSegment
source, target = load_pair("small", device="cpu")
arg, n = sys.argv[1], int(sys.argv[2])
if arg.endswith(".safetensors"):
    maps, record = load_fuser(arg)
else:
    cache = TeacherCache(EXP / "cache")
    tr, dev, test = split(cache)
    adapter, stats, _ = ridge(target, cache, tr[:200], dev)
    maps = FuserMaps.from_ridge(adapter, stats, FuserConfig(rank=int(sys.argv[3]) if len(sys.argv) > 3 else 64))
    t = load_file(str(EXP / "runs" / arg / "best.safetensors"))
    maps.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("maps.")})
texts = [json.loads(l)["document"] for l in open("/work/shared/data/pydoc_summaries.jsonl")]
docs = prepare_documents(texts, source, target, 192, 64, limit=n)
probe = RecoveryProbe.from_documents(source, target, None, docs, start_token_id(target.tokenizer), own=True)
r = probe.recovery(maps, wrong=True)
print(json.dumps(r, indent=1), flush=True)
json.dump(r, open(EXP / f"eval_fuser_{Path(arg).stem}_{n}.json", "w"), indent=1)
