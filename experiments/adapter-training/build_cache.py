"""Teacher cache for the first comparison (issue 13): held-out dev/test windows first, then N shuffled training
windows, in WORK/cache; the dev/test split in WORK/split.json.

  python experiments/adapter-training/build_cache.py 516 --data DATA
"""

import argparse
import json
import os
import random
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("train_windows", type=int, help="training windows to cache after the 88 dev and test windows")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_corpus.txt and kernel_docs_corpus.txt (default: $KVBRIDGE_DATA)")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of the arms (default: experiments/out/arms)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of pydoc_corpus.txt and kernel_docs_corpus.txt")

import torch
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.teacher import TeacherCache, TeacherConfig, document_windows, is_heldout, split_documents
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(1)
HELDOUT = 0.08
data = Path(args.data)
args.work.mkdir(parents=True, exist_ok=True)
s, t = load_pair("small", device="cpu")
cfg = TeacherConfig(context_tokens=192, continuation_tokens=64, topk=32)
windows = {}
for path, name in ((data / "pydoc_corpus.txt", "pydoc"), (data / "kernel_docs_corpus.txt", "kernel")):
    windows[name] = document_windows(split_documents(path, name), t.tokenizer, cfg.window_tokens)
    print(name, len(windows[name]), "windows", flush=True)


def part(ws, held, dev=None):
    out = [w for w in ws if is_heldout(w.doc_id, HELDOUT) == held]
    if dev is not None:
        out = [w for w in out if is_heldout(w.doc_id, 0.5, salt="dev") == dev]
    return out


rng = random.Random(0)
dev = rng.sample(part(windows["pydoc"], True, True), 12) + rng.sample(part(windows["kernel"], True, True), 12)
test = rng.sample(part(windows["kernel"], True, False), 48) + rng.sample(part(windows["pydoc"], True, False), 16)
train = part(windows["pydoc"], False) + part(windows["kernel"], False)
rng.shuffle(train)
split = {"dev": [w.id for w in dev], "test": [w.id for w in test], "train_total": len(train),
         "heldout_fraction": HELDOUT}
(args.work / "split.json").write_text(json.dumps(split, indent=1))
print("dev", len(dev), "test", len(test), "train available", len(train), flush=True)
cache = TeacherCache(args.work / "cache")
print(cache.build(s, t, dev + test + train[: args.train_windows], cfg, start_token_id(t.tokenizer)), flush=True)
