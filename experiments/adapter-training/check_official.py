"""Cross-check: the trainer's fast probe against adapters.evaluate.evaluate_recovery on folded linear adapters (the
first N pydoc_summaries documents); each folded adapter is written to WORK/ARM-folded.safetensors.

  python experiments/adapter-training/check_official.py ridge,chain_kl 16
"""

import argparse
import json
import os
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("arms", help="comma-separated arms: ridge, or names under WORK/runs (linear ones)")
parser.add_argument("documents", type=int, help="pydoc_summaries documents to score")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_summaries.jsonl (default: $KVBRIDGE_DATA)")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of build_cache.py and the arms (default: experiments/out/arms)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of pydoc_summaries.jsonl")

from common import maps_from, ridge, split
from kvbridge.adapters.evaluate import evaluate_recovery, prepare_documents
from kvbridge.adapters.io import save_adapter
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
with open(Path(args.data) / "pydoc_summaries.jsonl", encoding="utf-8") as f:
    texts = [json.loads(line)["document"] for line in f]
docs = prepare_documents(texts, source, target, 192, 64, limit=args.documents)
probe = RecoveryProbe.from_documents(source, target, adapter.start_kv, docs, start_token_id(target.tokenizer))
for arm in args.arms.split(","):
    checkpoint = None if arm == "ridge" else work / "runs" / arm / "best.safetensors"
    maps = maps_from(adapter, stats, CapacityConfig(), checkpoint)
    folded = maps.to_adapter(adapter)
    save_adapter(folded, work / f"{arm}-folded.safetensors")
    off = evaluate_recovery(source, target, folded, docs, progress=False)
    mine = probe.recovery(maps)
    print(arm, "official:", off.lines(), "probe:", mine["recovery"], mine["interval"], mine["nll"], flush=True)
