"""Held-out recovery of a fuser on N pydoc_summaries documents (own K/V in fp32), with the wrong-document control
(each document's own cache fused with the next document's source features); the result also in
WORK/eval_fuser_RUN_N.json.

  python experiments/adapter-training/eval_fuser.py fuser_r64 100        (a run of run_fuser.py)
  python experiments/adapter-training/eval_fuser.py FUSER.safetensors 100  (a file of train-adapter --trainer fuser)
"""

import argparse
import json
import os
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("run", help="a run name under WORK/runs, or a fuser .safetensors file")
parser.add_argument("documents", type=int, help="pydoc_summaries documents to score")
parser.add_argument("rank", type=int, nargs="?", default=64, help="the run's fuser rank (a run name only)")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_summaries.jsonl (default: $KVBRIDGE_DATA)")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of build_cache.py and the runs (default: experiments/out/arms)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of pydoc_summaries.jsonl")

from common import ridge, split
from kvbridge.adapters.evaluate import prepare_documents
from kvbridge.adapters.fuser import FuserConfig, FuserMaps, load_fuser
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.teacher import TeacherCache
from kvbridge.transfer.presets import load_pair
from safetensors.torch import load_file

work, n = args.work, args.documents
source, target = load_pair("small", device="cpu")
if args.run.endswith(".safetensors"):
    maps, record = load_fuser(args.run)
else:
    cache = TeacherCache(work / "cache")
    tr, dev, test = split(work, cache)
    adapter, stats, _ = ridge(work, target, cache, tr[:200], dev)
    maps = FuserMaps.from_ridge(adapter, stats, FuserConfig(rank=args.rank))
    t = load_file(str(work / "runs" / args.run / "best.safetensors"))
    maps.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("maps.")})
with open(Path(args.data) / "pydoc_summaries.jsonl", encoding="utf-8") as f:
    texts = [json.loads(line)["document"] for line in f]
docs = prepare_documents(texts, source, target, 192, 64, limit=n)
probe = RecoveryProbe.from_documents(source, target, None, docs, start_token_id(target.tokenizer), own=True)
r = probe.recovery(maps, wrong=True)
print(json.dumps(r, indent=1), flush=True)
work.mkdir(parents=True, exist_ok=True)
(work / f"eval_fuser_{Path(args.run).stem}_{n}.json").write_text(json.dumps(r, indent=1))
