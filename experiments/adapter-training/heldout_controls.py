"""Held-out figures of a trained adapter: recovery on the first N pydoc_summaries documents (adapters.evaluate, with
the wrong-document control), plus a 'tokens of this document, source KV of another' control that shows how much of
the recovery the source's KV carries beyond the target's own token identity; the figures also in FILE.evalN.json.
With --write they go into the file's metadata (metrics.recovery_heldout), as in the shipped adapter.

  python experiments/adapter-training/heldout_controls.py ADAPTER.safetensors 100 [--write]
"""

import argparse
import dataclasses
import json
import os
import random
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("adapter", help="an adapter file of train-adapter")
parser.add_argument("documents", type=int, help="pydoc_summaries documents to score")
parser.add_argument("--write", action="store_true", help="write the figures into the adapter file's metadata")
parser.add_argument("--teacher-reused-s", type=int,
                    help="with --write: the seconds of an earlier run whose teacher cache this run reused")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_summaries.jsonl (default: $KVBRIDGE_DATA)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of pydoc_summaries.jsonl")

import torch
from kvbridge.adapters.adapter import map_tokens
from kvbridge.adapters.evaluate import evaluate_recovery, prepare_documents
from kvbridge.adapters.io import load_adapter, save_adapter
from kvbridge.adapters.map_kv import project_window
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.scoring import continuation_nll
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.segment import KVSegment

torch.set_num_threads(2)
path, n = args.adapter, args.documents
source, target = load_pair("small", device="cpu")
adapter = load_adapter(path)
with open(Path(args.data) / "pydoc_summaries.jsonl", encoding="utf-8") as f:
    texts = [json.loads(line)["document"] for line in f]
docs = prepare_documents(texts, source, target, 192, 64, limit=n)
r = evaluate_recovery(source, target, adapter, docs, progress=False)
for line in r.lines():
    print(line, flush=True)


class Maps:  # the folded adapter as the trainer's maps (float32)
    def __call__(self, xk, xv, ids):
        return map_tokens(adapter, xk.float(), xv.float(), target_ids=ids)


maps = Maps()
probe = RecoveryProbe.from_documents(source, target, adapter.start_kv.float(), docs, adapter.meta.start_token)
own = probe.per_document(maps)
mixed = []
with torch.no_grad():
    for i, it in enumerate(probe.items):
        src = probe.items[(i + 1) % len(probe.items)]
        k, v = project_window(maps, probe.start_kv, src.xk, src.xv, it.start_mask, target, it.context_ids)
        seg = KVSegment(kv=torch.stack((k, v), dim=1), token_ids=it.context_ids,
                        positions=torch.arange(it.context_ids.numel()), model=target.spec.identity, rotated=True)
        mixed.append(float(continuation_nll(target, seg, it.continuation, 0)))
rows = list(zip(probe.none, probe.full, own, mixed))


def rec(sample, col):
    none, full, x = (sum(r[i] for r in sample) for i in (0, 1, col))
    return (none - x) / (none - full)


rng = random.Random(0)
samples = [[rng.choice(rows) for _ in rows] for _ in range(1000)]
out = {}
for name, col in (("probe_projected", 2), ("own_tokens_other_source", 3)):
    boot = sorted(rec(s, col) for s in samples)
    out[name] = [rec(rows, col), boot[25], boot[974]]
diff = sorted(rec(s, 2) - rec(s, 3) for s in samples)
out["source_share"] = [rec(rows, 2) - rec(rows, 3), diff[25], diff[974]]
print(json.dumps(out), flush=True)
result = None
if isinstance(r.recovery, dict):
    result = {"nll": r.nll, "projected": [r.recovery["projected"], *r.interval["projected"]],
              "wrong": [r.recovery["wrong"], *r.interval["wrong"]], "controls": out}
print(json.dumps(result), flush=True)
Path(path + f".eval{n}.json").write_text(
    json.dumps({"recovery": r.recovery, "interval": r.interval, "nll": r.nll, "controls": out}, indent=1))
if args.write:
    meta = adapter.meta
    metrics = dict(meta.metrics)
    metrics["recovery_heldout"] = {
        "note": f"value, then the bootstrap 95% interval; the first {n} documents of pydoc_summaries.jsonl "
                "(192-token context, 64-token continuation), none in the training corpus; "
                + ("'recovery' above: the 46 packaged pydoc_heldout.jsonl documents, as train-adapter printed it; "
                   if "recovery" in metrics else "")
                + "own_tokens_other_source: this document's target tokens with the next document's source KV (what "
                "token identity alone gives through this adapter); source_share: projected minus that, paired",
        f"pydoc_summaries_{n}_docs": result}
    training = dict(meta.training)
    if args.teacher_reused_s is not None:  # the teacher cache came from an earlier run of the same windows
        training["record"] = dict(training["record"], teacher_cache_reused_s=args.teacher_reused_s)
    save_adapter(dataclasses.replace(adapter, meta=dataclasses.replace(meta, metrics=metrics, training=training)), path)
    print("written", path)
