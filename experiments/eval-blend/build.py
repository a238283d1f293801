"""Cache, per pydoc_summaries document (eval's EvalConfig defaults: <=512 context tokens, 32 continuation), the
projected KV from the served shipped adapter, and the NLL of full, none and replace: PAGES/NNNN.pt, one file a page
(index in pydoc_summaries.jsonl), read by variants.py, bias.py and loss-location/. Pages already there are skipped.

  python experiments/eval-blend/build.py 100 180
"""

import argparse
import os
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page (index in pydoc_summaries.jsonl)")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("--data", default=os.environ.get("KVBRIDGE_DATA"),
                    help="folder of pydoc_summaries.jsonl (default: $KVBRIDGE_DATA)")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "pages",
                    help="folder of the cached pages (default: experiments/out/pages)")
args = parser.parse_args()
if not args.data:
    parser.error("--data or KVBRIDGE_DATA: the folder of pydoc_summaries.jsonl")

import torch
from kvbridge.eval.run import start_local_server
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, continuation_scores, prepare, read_records
from kvbridge.server.client import KVBridgeClient
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair

torch.set_num_threads(2)
a, b = args.start, args.end
out = args.pages
out.mkdir(parents=True, exist_ok=True)
source, target = load_pair("small")
running = start_local_server(source, target, "small", None, False)
cfg = EvalConfig()
recs = read_records(str(Path(args.data) / "pydoc_summaries.jsonl"))
with KVBridgeClient(running.address, timeout_s=600) as client:
    ps = ProjectedSource(client, target)
    print(client.list_adapters())
    for i in range(a, min(b, len(recs))):
        f = out / f"{i:04d}.pt"
        if f.exists():
            continue
        doc = prepare(recs[i], target, cfg)
        if doc is None:
            print(i, "short")
            continue
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
        print(i, doc.record.id, doc.doc_tokens, f"full {nf:.1f} none {nn:.1f} replace {nr:.1f}",
              f"{time.time() - t0:.1f}s", flush=True)
running.stop(1)
