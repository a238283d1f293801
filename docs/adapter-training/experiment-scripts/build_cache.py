"""Teacher cache for issue 13: held-out dev/test windows first, then shuffled training windows."""
import json, random, sys, torch
torch.set_num_threads(1)
from kvbridge.transfer.presets import load_pair
from kvbridge.adapters.teacher import *
from kvbridge.adapters.pairs import start_token_id

ROOT = "/work/exp13/cache"
HELDOUT = 0.08
s, t = load_pair("small", device="cpu")
cfg = TeacherConfig(context_tokens=192, continuation_tokens=64, topk=32)
windows = {}
for path, name in (("/work/shared/data/pydoc_corpus.txt", "pydoc"), ("/work/shared/data/kernel_docs_corpus.txt", "kernel")):
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
json.dump({"dev": [w.id for w in dev], "test": [w.id for w in test],
           "train_total": len(train), "heldout_fraction": HELDOUT}, open("/work/exp13/split.json", "w"), indent=1)
print("dev", len(dev), "test", len(test), "train available", len(train), flush=True)
cache = TeacherCache(ROOT)
print(cache.build(s, t, dev + test + train[: int(sys.argv[1])], cfg, start_token_id(t.tokenizer)), flush=True)
