"""The identity adapter of a model onto itself: K and V maps are the identity, layer j reads layer j, and the start
token's KV is the model's own. Projecting a model's KV through it reproduces that KV to float tolerance, so the
whole transfer path (store, alignment, un-rotate, map, rotate, wire, cache) can be checked for exactness."""

from __future__ import annotations

import torch
from kvbridge.adapters.adapter import Adapter, AdapterMeta, model_record
from kvbridge.adapters.pairs import start_kv, start_token_id
from kvbridge.transfer.models import LoadedModel


def identity_adapter(lm: LoadedModel) -> Adapter:
    spec = lm.spec
    if lm.tokenizer is None:
        raise ValueError(f"{spec.name!r} has no tokenizer: the identity adapter needs its start token")
    start = start_token_id(lm.tokenizer)
    d = spec.num_kv_heads * spec.head_dim
    n = spec.num_layers
    record = model_record(spec)
    meta = AdapterMeta(source=record, target=record, layer_map="identity", start_token=start,
                       metrics={"note": "identity: exact by construction"})
    eye = torch.eye(d).expand(n, d, d).clone()  # [L, d, d]
    return Adapter(meta=meta, layer_map=torch.arange(n)[:, None], mix_k=torch.ones(n, 1), mix_v=torch.ones(n, 1),
                   wk=eye, bk=torch.zeros(n, d), wv=eye.clone(), bv=torch.zeros(n, d),
                   start_kv=start_kv(lm, start).cpu())
