"""Give the induction heads the match their projected keys blur: recompute:0.1, and at the given query heads
(layer:q,q;layer:q; default the induction query heads of the two induction KV heads 17.1 and 18.2) a bias B added to
the attention score of every projected key whose previous token is the query's own token (the match an induction head
looks for; the generator knows the document's tokens exactly), B2 more where the token before that also matches
the query's previous token, B3 more where a third does (variant s{B}g{B2}h{B3}). Recomputed and exact keys get no
bias. Where: while scoring the continuation (s) or also while the tail is recomputed (a). Reference: the keys of the
KV heads of those query heads exact (the oracle). heads "auto:T": every query head with probe score >= T, the bias
scaled by the score. On the pages build.py cached.

  python experiments/eval-blend/loss-location/induct_bias.py 100 140 s2,s4,a2,s2g2 "17:3,4,5;18:6,7"
"""

import argparse
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("variants", help="comma-separated s{B}[g{B2}[h{B3}]] or a{B}...")
parser.add_argument("heads", nargs="?", default="17:3,4,5;18:6,7", help="LAYER:Q,Q;LAYER:Q or auto:THRESHOLD")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
import torch.nn.functional as F
from common import pages, recompute_tail, report, seg_of
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import accepts_custom_masks, eager_attention, switched_attention
from kvbridge.transfer.presets import load_pair
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

torch.set_num_threads(2)
_, target = load_pair("small")
a, b = args.start, args.end
VARIANTS = args.variants.split(",")
HQ, HKV = target.model.config.num_attention_heads, target.spec.num_kv_heads
GROUP = HQ // HKV
HEAD_ARG = args.heads
INDUCT = "kvb_induct"


def induction_scores():
    """[L, HQ]: the attention a token of a repeated random 64-token sequence gives the token after its first
    occurrence (induction.py's probe, per query head)."""
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(100, 20000, (4, 64), generator=g)
    with torch.no_grad(), eager_attention(target.model):
        att = target.model(input_ids=torch.cat((seq, seq), 1), output_attentions=True).attentions
    q = torch.arange(64, 127)
    return torch.stack([a[:, :, q, q - 63].float().mean(dim=(0, 2)) for a in att])


if HEAD_ARG.startswith("auto"):  # auto:THRESHOLD: every query head scoring at least that, its bias scaled by its score
    SCORES = induction_scores()
    thr = float(HEAD_ARG.partition(":")[2] or 0.1)
    HEADS = {la: [q for q in range(HQ) if SCORES[la, q] >= thr] for la in range(SCORES.shape[0])}
    HEADS = {la: qs for la, qs in HEADS.items() if qs}
    WEIGHT = {(la, q): float(SCORES[la, q]) for la, qs in HEADS.items() for q in qs}
    print("heads", {la: [(q, round(WEIGHT[la, q], 2)) for q in qs] for la, qs in HEADS.items()})
else:
    HEADS = {int(la): [int(q) for q in qs.split(",")] for la, qs in (part.split(":") for part in HEAD_ARG.split(";"))}
    WEIGHT = {(la, q): 1.0 for la, qs in HEADS.items() for q in qs}
STATE = {"bias": 0.0, "bias2": 0.0, "bias3": 0.0, "qtok": None, "qprev": None, "qprev2": None, "prev": None,
         "prev2": None, "prev3": None, "far": (1, 0)}


def biased_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    heads = HEADS.get(module.layer_idx, [])
    if not heads or STATE["bias"] == 0.0 or STATE["qtok"] is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    bsz, nq, q, _ = query.shape
    kl = key.shape[2]
    assert q == STATE["qtok"].numel(), (q, STATE["qtok"].numel())
    key, value = repeat_kv(key, nq // key.shape[1]), repeat_kv(value, nq // value.shape[1])
    if attention_mask is None:
        allowed = torch.ones(q, kl, dtype=torch.bool).tril(kl - q)
        mask = torch.zeros(q, kl).masked_fill(~allowed, float("-inf"))[None, None]
    elif attention_mask.dtype == torch.bool:
        mask = torch.zeros(attention_mask.shape).masked_fill(~attention_mask, float("-inf"))
    else:
        mask = attention_mask.float()
    mask = mask.expand(bsz, nq, q, kl).clone()
    lo, hi = STATE["far"]
    match = (STATE["prev"][None, lo:hi] == STATE["qtok"][:, None]).float()  # [q, hi - lo]
    match2 = match * (STATE["prev2"][None, lo:hi] == STATE["qprev"][:, None])
    match3 = match2 * (STATE["prev3"][None, lo:hi] == STATE["qprev2"][:, None])
    for h in heads:
        mask[:, h, :, lo:hi] += WEIGHT[module.layer_idx, h] * (STATE["bias"] * match + STATE["bias2"] * match2
                                                               + STATE["bias3"] * match3)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask.to(query.dtype), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(INDUCT, biased_attention)
AttentionMaskInterface.register(INDUCT, sdpa_mask)  # the masks sdpa gets
accepts_custom_masks(INDUCT)  # the tail's recompute passes its own mask through it (the bias of the `a` variants)


def score(x, ids, cont, k, bias=0.0, bias2=0.0, bias3=0.0, in_tail=False):
    """recompute:0.1's NLL of cont after x (the bias also while the tail is recomputed if in_tail)."""
    t = ids.numel()
    STATE.update(bias=bias if in_tail else 0.0, bias2=bias2 if in_tail else 0.0, bias3=bias3 if in_tail else 0.0,
                 qtok=ids[t - k:], qprev=ids[t - k - 1:-1], qprev2=ids[t - k - 2:-2])
    cache = recompute_tail(target, x, ids, k)
    STATE.update(bias=bias, bias2=bias2, bias3=bias3, qtok=cont, qprev=torch.cat((ids[-1:], cont[:-1])),
                 qprev2=torch.cat((ids[-2:], cont[:-2])))
    return continuation_scores(target, seg_of(target, cache, ids), cont)[0]


rows = []
names = ["rec", "exact"] + VARIANTS
with switched_attention(target.model, INDUCT):
    for stem, d in pages(args.pages, a, b):
        ids, kv, cont = d["ids"], d["kv"], d["cont"]
        t = ids.numel()
        k = max(1, round(0.1 * (t - 1)))
        row = {"full": d["nll_full"], "none": d["nll_none"]}
        own = kvcache.extract(target.model, target.spec, ids).kv.float()
        STATE.update(prev=torch.cat((torch.tensor([-1]), ids[:-1])),
                     prev2=torch.cat((torch.tensor([-1, -1]), ids[:-2])),
                     prev3=torch.cat((torch.tensor([-1, -1, -1]), ids[:-3])), far=(1, t - k))

        row["rec"] = score(kv, ids, cont, k)
        x = kv.clone()
        for la, qs in HEADS.items():
            for h in {q // GROUP for q in qs}:
                x[la, 0, h] = own[la, 0, h]
        row["exact"] = score(x, ids, cont, k)
        for v in VARIANTS:
            b1, _, rest = v[1:].partition("g")
            b2, _, b3 = rest.partition("h")
            row[v] = score(kv, ids, cont, k, float(b1), float(b2 or 0), float(b3 or 0), in_tail=v[0] == "a")
        STATE.update(bias=0.0, qtok=None)
        rows.append(row)
        print(stem, " ".join(f"{v}={row[v]:.1f}" for v in ["full", "none"] + names), flush=True)
report(rows, names)
