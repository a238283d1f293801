"""Cache, per pydoc_summaries document (eval's EvalConfig defaults: <=512 context tokens, 32 continuation), the
projected KV from the served shipped adapter, and the NLL of full and none.  python build.py START END"""
import sys, time, torch
from pathlib import Path
torch.set_num_threads(2)
from kvbridge.transfer.presets import load_pair
from kvbridge.eval.run import start_local_server
from kvbridge.eval.summaries import EvalConfig, read_records, prepare, continuation_scores, ProjectedSource
from kvbridge.server.client import KVBridgeClient
from kvbridge.transfer import kvcache
a, b = int(sys.argv[1]), int(sys.argv[2])
out = Path("/work/exp15/cache")
source, target = load_pair("small")
running = start_local_server(source, target, "small", None, False)
cfg = EvalConfig()
recs = read_records("/work/shared/data/pydoc_summaries.jsonl")
with KVBridgeClient(running.address, timeout_s=600) as client:
    ps = ProjectedSource(client, target)
    print(client.list_adapters())
    for i in range(a, min(b, len(recs))):
        f = out / f"{i:04d}.pt"
        if f.exists():
            continue
        doc = prepare(recs[i], target, cfg)
        if doc is None:
            print(i, "short"); continue
        t0 = time.time()
        fetched = ps.fetch(doc.text)[0]
        seg = fetched.segment
        assert torch.equal(seg.token_ids, doc.target_ids)
        own = kvcache.extract(target.model, target.spec, doc.target_ids)
        nf, _ = continuation_scores(target, own, doc.continuation)
        nr, _ = continuation_scores(target, seg, doc.continuation)
        none = kvcache.extract(target.model, target.spec, doc.target_ids[:1])
        nn, _ = continuation_scores(target, none, doc.continuation)
        torch.save({"id": doc.record.id, "ids": doc.target_ids, "cont": doc.continuation, "kv": seg.kv.float(),
                    "nll_full": nf, "nll_none": nn, "nll_replace": nr}, f)
        print(i, doc.record.id, doc.doc_tokens, f"full {nf:.1f} none {nn:.1f} replace {nr:.1f}", f"{time.time()-t0:.1f}s", flush=True)
running.stop(1)
