"""Per-page correction of the projected KV from the tokens recompute made exact (test-time calibration): a mean
shift, a per-channel affine map or a ridge map, fitted on the recomputed tail of recompute:0.1 and applied to the
projected head; the oracle shift (the true per-page mean error) for reference. On the pages build.py cached.

  python experiments/eval-blend/loss-location/calib.py 100 140
"""

import argparse
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("start", type=int, help="first page")
parser.add_argument("end", type=int, help="one past the last page")
parser.add_argument("--pages", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "pages",
                    help="build.py's folder (default: experiments/out/pages)")
args = parser.parse_args()

import torch
from common import pages, report, seg_of
from kvbridge.eval.summaries import continuation_scores
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.suffix.reuse import prefill_after

torch.set_num_threads(2)
_, target = load_pair("small")
rope = target.rope


def unrot(kv, pos):  # kv [L, 2, H, T, D] -> the keys un-rotated
    out = kv.clone()
    out[:, 0] = rope.unrotate_all(kv[:, 0].float(), pos)
    return out


def rot(kv, pos):
    out = kv.clone()
    out[:, 0] = rope.rotate_all(kv[:, 0].float(), pos)
    return out


def fit_correction(p, e, kind, lam):
    """p, e: [L, 2, H, k, D] projected and exact (un-rotated) at the same tokens. Returns fn(x) -> corrected."""
    if kind == "shift":
        mu = (e - p).mean(3, keepdim=True)
        return lambda x, a=lam: x + a * mu
    if kind == "affine":  # per channel: e ~ s*p + b, s shrunk toward 1 with weight lam
        pm, em = p.mean(3, keepdim=True), e.mean(3, keepdim=True)
        pc, ec = p - pm, e - em
        s = (((pc * ec).sum(3, keepdim=True) + lam * (pc * pc).sum(3, keepdim=True))
             / ((1 + lam) * (pc * pc).sum(3, keepdim=True) + 1e-6))
        return lambda x: em + s * (x - pm)
    if kind == "lin":  # per layer, kv, head: e - p ~ (p - pm) W + c, ridge lam * trace-scaled
        pm = p.mean(3, keepdim=True)
        pc = p - pm
        r = e - p
        rm = r.mean(3, keepdim=True)
        G = pc.transpose(-1, -2) @ pc  # [L, 2, H, D, D]
        tr = G.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None]
        W = torch.linalg.solve(G + lam * tr * torch.eye(G.shape[-1]), pc.transpose(-1, -2) @ (r - rm))
        return lambda x: x + rm + (x - pm) @ W
    raise ValueError(kind)


rows = []
variants = (["replace", "rec", "oracle_shift_replace", "oracle_shift_rec"]
            + [f"{kind}:{lam}" for kind, lam in [("shift", 1.0), ("shift", 0.5), ("affine", 1.0), ("affine", 4.0),
                                                 ("lin", 1.0), ("lin", 10.0)]]
            + ["shift:1.0+2pass"])
t0 = time.time()
for stem, d in pages(args.pages, args.start, args.end):
    ids, kv, cont = d["ids"], d["kv"], d["cont"]
    n = ids.numel() - 1
    T = n + 1
    pos = torch.arange(T)
    k = max(1, round(0.1 * n))
    row = {"full": d["nll_full"], "none": d["nll_none"], "replace": d["nll_replace"]}
    own = kvcache.extract(target.model, target.spec, ids).kv.float()
    head = seg_of(target, kv, ids).slice(0, T - k)
    tail = prefill_after(target, head, ids[T - k:]).kv.float()
    rec_kv = torch.cat((kv[:, :, :, :T - k], tail), 3)
    row["rec"], _ = continuation_scores(target, seg_of(target, rec_kv, ids), cont)
    U = unrot(kv, pos)
    Uown = unrot(own, pos)
    Urec = unrot(rec_kv, pos)
    mu = (Uown[..., 1:, :] - U[..., 1:, :]).mean(3, keepdim=True)
    x = U.clone()
    x[..., 1:, :] += mu
    row["oracle_shift_replace"], _ = continuation_scores(target, seg_of(target, rot(x, pos), ids), cont)
    x = Urec.clone()
    x[..., 1:T - k, :] += mu
    row["oracle_shift_rec"], _ = continuation_scores(target, seg_of(target, rot(x, pos), ids), cont)
    p_t, e_t = U[..., T - k:, :], Urec[..., T - k:, :]
    for v in variants[4:]:
        kind, _, rest = v.partition(":")
        lam = float(rest.split("+")[0])
        fn = fit_correction(p_t, e_t, kind, lam)
        x = Urec.clone()
        x[..., 1:T - k, :] = fn(U[..., 1:T - k, :])
        newkv = rot(x, pos)
        if v.endswith("+2pass"):
            h2 = seg_of(target, newkv, ids).slice(0, T - k)
            t2 = prefill_after(target, h2, ids[T - k:]).kv.float()
            newkv = torch.cat((newkv[:, :, :, :T - k], t2), 3)
        row[v], _ = continuation_scores(target, seg_of(target, newkv, ids), cont)
    rows.append(row)
    print(stem, " ".join(f"{v}={row[v]:.1f}" for v in ["full", "none"] + variants), f"{time.time() - t0:.0f}s",
          flush=True)

report(rows, variants)
