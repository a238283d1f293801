"""How much of an induction head's key is the identity of the tokens around it? The target's own (un-rotated) keys of
the heads named on the command line, collected from its prefill of 512-token windows of the two training corpora
(N windows), fitted by additive lookup tables  key ≈ μ + A[token j-1] + B[token j] (+ C[token j-2]) (backfitting,
each table entry shrunk towards 0 by LAM pseudo-counts); R² on the tuning pages 100-139 of pydoc_summaries (own
prefill, the eval's tokenisation). A ridge map of 20 pages' embeddings reached 0.675 with the projected key
(prevtok.py); near-exact keys (R² about 0.95) are what the loss-location table says would be needed.

  python experiments/eval-blend/loss-location/key_lookup.py [N=600] [heads=18.2,17.1]
"""

import argparse
import os
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("n", type=int, nargs="?", default=600, help="training windows")
parser.add_argument("heads", nargs="?", default="18.2,17.1", help="LAYER.KV_HEAD, comma-separated")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_corpus.txt, kernel_docs_corpus.txt and pydoc_summaries.jsonl "
                         "(default: $KVBRIDGE_DATA)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of the corpora and pydoc_summaries.jsonl")

import torch
from kvbridge.eval.summaries import EvalConfig, prepare, read_records
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
data = Path(args.data)
N = args.n
HEADS = [tuple(int(x) for x in s.split(".")) for s in args.heads.split(",")]
LAM = 4.0
_, target = load_pair("small")
tok = target.tokenizer


def keys(ids: torch.Tensor) -> dict:
    kv = kvcache.extract(target.model, target.spec, ids).kv.float()
    pos = torch.arange(ids.numel())
    return {(la, h): target.rope.unrotate(kv[la, 0, h][None], la, pos)[0] for la, h in HEADS}


def windows():
    for name in ("pydoc_corpus.txt", "kernel_docs_corpus.txt"):
        text = (data / name).read_text(encoding="utf-8")
        ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"])
        for s in range(0, ids.numel() - 512, 512):
            yield ids[s:s + 512]


def collect(seqs):
    out = {hd: [] for hd in HEADS}
    toks = []
    for ids in seqs:
        k = keys(ids)
        for hd in HEADS:
            out[hd].append(k[hd][2:])
        toks.append(torch.stack((ids[2:], ids[1:-1], ids[:-2]), 1))  # cur, prev, prev2
    return {hd: torch.cat(v) for hd, v in out.items()}, torch.cat(toks)


train_seqs = [w for _, w in zip(range(N), (w for i, w in enumerate(windows()) if i % 3 == 0))]
Ytr, Ttr = collect(train_seqs)
recs = read_records(data / "pydoc_summaries.jsonl")
test_seqs = [d.target_ids for d in (prepare(recs[i], target, EvalConfig()) for i in range(100, 140)) if d is not None]
Yte, Tte = collect(test_seqs)
V = len(tok)
print(f"train tokens {Ttr.shape[0]}, test tokens {Tte.shape[0]}", flush=True)


def r2(y, p):
    return float(1 - ((y - p) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())


def fit(y, t, cols, iters=6):
    mu = y.mean(0)
    tabs = {c: torch.zeros(V, y.shape[1]) for c in cols}
    for _ in range(iters):
        for c in cols:
            res = y - mu - sum(tabs[o][t[:, o]] for o in cols if o != c)
            s = torch.zeros(V, y.shape[1]).index_add_(0, t[:, c], res)
            n = torch.zeros(V).index_add_(0, t[:, c], torch.ones(t.shape[0]))
            tabs[c] = s / (n + LAM)[:, None]
    return lambda tt: mu + sum(tabs[c][tt[:, c]] for c in cols)


for hd in HEADS:
    for cols, nm in (([1], "prev"), ([0], "cur"), ([0, 1], "cur+prev"), ([0, 1, 2], "cur+prev+prev2")):
        f = fit(Ytr[hd], Ttr, cols)
        fit_r2, test_r2 = r2(Ytr[hd], f(Ttr)), r2(Yte[hd], f(Tte))
        print(f"L{hd[0]}h{hd[1]} {nm:16s} R2 train {fit_r2:.3f} test {test_r2:.3f}", flush=True)
