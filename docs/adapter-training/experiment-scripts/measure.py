import time, torch
torch.set_num_threads(2)
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer import kvcache
from kvbridge.adapters.teacher import *
from kvbridge.adapters.pairs import start_token_id, pair_text
t0=time.time(); s, t = load_pair("small", device="cpu"); print("load", time.time()-t0)
docs = split_documents("/work/shared/data/kernel_docs_corpus.txt", "kernel")
print("docs", len(docs))
ws = document_windows(docs[:3], t.tokenizer, 256)
cfg = TeacherConfig()
st = start_token_id(t.tokenizer)
for w in ws[:3]:
    p = pair_text(w.text, s.tokenizer, t.tokenizer)
    t0=time.time(); kvcache.extract(s.model, s.spec, p.source_ids); a=time.time()-t0
    t0=time.time()
    with torch.no_grad(): t.model(input_ids=p.target_ids[None][:, :257])
    b=time.time()-t0
    t0=time.time(); d=teacher_window(s, t, w.text, cfg, st); c=time.time()-t0
    print(f"source fwd {a:.3f}s  target fwd {b:.3f}s  teacher window {c:.3f}s", p.source_ids.numel(), p.target_ids.numel())
print({k: (tuple(v.shape), v.dtype) for k, v in d.items()})
print("bytes", sum(v.numel()*v.element_size() for v in d.values()))
# target fwd+bwd for KL: 64 continuation tokens with 193 cache
seg = kvcache.extract(t.model, t.spec, d["ids"][:193])
kv = seg.kv.clone().requires_grad_(True)
from kvbridge.transfer.segment import KVSegment
for B in (1, 4):
    segs=[KVSegment(kv=kv, token_ids=seg.token_ids, positions=seg.positions, model=seg.model, rotated=True)]*B
    t0=time.time()
    cache = kvcache.to_cache(segs, t.model, t.spec)
    out = t.model(input_ids=d["ids"][193:][None].expand(B, -1), position_ids=torch.arange(193,257)[None].expand(B,-1), cache=cache).logits
    out.float().log_softmax(-1)[..., 0].sum().backward()
    print(f"KL fwd+bwd B={B}: {time.time()-t0:.3f}s")
