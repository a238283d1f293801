"""Fit the induction prior's weights per query head by the continuation's NLL, on windows of the adapter's training
corpora (never the eval's pages), instead of setting them from the probe score by hand. This is how the shipped
prior, transfer/suffix/priors/smollm2-135m-instruct-q4_1.safetensors, was made.

Per (layer, query head) four numbers: w1 on the match (the projected key's previous token is the query's token),
w2 more on the longer match (the token before that matches the query's previous token too), c on every projected key
(a per-head trust), d on a projected key of the query's own token (a duplicate). Init: the library's prior
(w1 = w2 = 3 × probe score where the score >= 0.1; c = d = 0). The loss is
the summed NLL of the 32-token continuation after a 512-token context read as `recompute:0.1` (or `replace`), the
recomputed tail fixed (built without the prior, as eval builds it), plus lam × ||theta - init||².

  fit_prior.py build N          N training windows (projected by the served shipped adapter) -> WORK/win
  fit_prior.py train STEPS LAM  -> WORK/prior-LAM.pt (Adam, one window a step; dev NLL every 100 steps)
  fit_prior.py eval START END [PRIOR.pt ...]   build.py's pages: recompute:0.1 / replace with each prior
  fit_prior.py export PRIOR.pt FILE.safetensors  the library's file (InductionPrior.save; transfer/suffix/priors)

WORK is --work (default experiments/out/prior). The shipped prior, from the repository root, with KVBRIDGE_DATA the
folder of pydoc_corpus.txt and kernel_docs_corpus.txt (build 360: 40 dev windows and 320 training windows; the
checkpoint of step 300):

  python experiments/eval-blend/loss-location/fit_prior.py build 360
  python experiments/eval-blend/loss-location/fit_prior.py train 300 0.001
  python experiments/eval-blend/loss-location/fit_prior.py export experiments/out/prior/prior-0.001.pt \
      transfer/suffix/priors/smollm2-135m-instruct-q4_1.safetensors
"""

import argparse
import os
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import pages, recompute_tail, report
from kvbridge.transfer import kvcache
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.suffix.induction import InductionPrior, induction_scores

R = 0.1  # recompute:0.1: the share of the context recomputed at its end
EXPERIMENTS = Path(__file__).resolve().parents[2]
COMMAND = "python experiments/eval-blend/loss-location/fit_prior.py"


def build(out: Path, data: Path, n: int) -> None:
    from kvbridge.adapters.teacher import document_windows, is_heldout, split_documents
    from kvbridge.eval.run import start_local_server
    from kvbridge.eval.summaries import EvalConfig, ProjectedSource, Record, prepare
    from kvbridge.server.client import KVBridgeClient
    source, target = load_pair("small")
    docs = (split_documents(data / "pydoc_corpus.txt", "pydoc")
            + split_documents(data / "kernel_docs_corpus.txt", "kernel_docs"))
    train = [d for d in docs if not is_heldout(d[0], 0.08)]  # the chain's split: never its held-out documents
    windows = document_windows(train, target.tokenizer, 560)
    random.Random(0).shuffle(windows)
    (out / "win").mkdir(parents=True, exist_ok=True)
    running = start_local_server(source, target, "small", None, False)
    cfg = EvalConfig()
    done = 0
    with KVBridgeClient(running.address, timeout_s=600) as client:
        ps = ProjectedSource(client, target)
        for w in windows:
            if done >= n:
                break
            f = out / "win" / f"{done:04d}.pt"
            done += 1
            if f.exists():
                continue
            doc = prepare(Record(w.id, w.text, "-"), target, cfg)
            if doc is None or doc.doc_tokens < 400 or doc.continuation.numel() < 32:
                done -= 1
                continue
            t0 = time.time()
            seg = ps.fetch(doc.text)[0].segment
            ids, kv = doc.target_ids, seg.kv.float()
            k = max(1, round(R * doc.doc_tokens))
            rec = recompute_tail(target, kv, ids, k)
            torch.save({"id": w.id, "ids": ids, "cont": doc.continuation, "kv": kv.to(torch.bfloat16),
                        "tail": rec[:, :, :, -k:].to(torch.bfloat16)}, f)
            print(done - 1, w.id, doc.doc_tokens, f"{time.time() - t0:.1f}s", flush=True)
    running.stop(1)


class Prior(torch.nn.Module):
    def __init__(self, scores: torch.Tensor):
        super().__init__()
        init = torch.where(scores >= 0.1, 3 * scores, torch.zeros_like(scores))
        zero = torch.zeros_like(init)
        self.register_buffer("init", torch.stack((init, init, zero, zero)))  # [4, L, H]
        self.theta = torch.nn.Parameter(self.init.clone())


def nll(target, cache_kv: torch.Tensor, ids: torch.Tensor, cont: torch.Tensor, still: torch.Tensor, theta):
    """Summed NLL of cont[1:] after the cache (ids), read with the prior of terms theta ([4, L, H_q], the library's
    InductionPrior: its attention passes the gradient on to theta) on the keys where `still` (projected)."""
    t = ids.numel()
    cache = kvcache.build_cache(cache_kv[:, :, None].float())
    with InductionPrior(theta).reading(target, ids, still):
        logits = target.model(input_ids=cont[None], position_ids=torch.arange(t, t + cont.numel())[None],
                              cache=cache, use_cache=True).logits[0]
    return F.cross_entropy(logits[:-1].float(), cont[1:], reduction="sum")


def window_case(d, mode: str):
    ids, kv, cont = d["ids"], d["kv"].float(), d["cont"]
    t = ids.numel()
    still = torch.zeros(t, dtype=torch.bool)
    if mode == "replace":
        still[1:] = True
        return kv, ids, cont, still
    k = d["tail"].shape[3]
    still[1:t - k] = True
    return torch.cat((kv[:, :, :, :t - k], d["tail"].float()), 3), ids, cont, still


def train(out: Path, steps: int, lam: float) -> None:
    _, target = load_pair("small")
    for p in target.model.parameters():
        p.requires_grad_(False)
    prior = Prior(induction_scores(target))
    files = sorted((out / "win").glob("*.pt"))
    dev, tr = files[:40], files[40:]
    print(f"{len(tr)} training windows, {len(dev)} dev", flush=True)
    opt = torch.optim.Adam(prior.parameters(), lr=0.03)
    rng = random.Random(0)
    cached = {}

    def load(f):
        if f not in cached:
            cached[f] = torch.load(f, weights_only=True)
        return cached[f]

    def dev_nll(theta):
        with torch.no_grad():
            return [sum(float(nll(target, *window_case(load(f), m), theta)) for f in dev) for m in ("rec", "replace")]

    print("dev init", dev_nll(prior.init), "zero", dev_nll(torch.zeros_like(prior.init)), flush=True)
    t0 = time.time()
    run = 0.0
    for step in range(1, steps + 1):
        f = rng.choice(tr)
        mode = "rec" if rng.random() < 0.7 else "replace"
        loss = nll(target, *window_case(load(f), mode), prior.theta) / 31
        reg = lam * ((prior.theta - prior.init) ** 2).sum()
        opt.zero_grad()
        (loss + reg).backward()
        opt.step()
        run = 0.98 * run + 0.02 * float(loss) if step > 1 else float(loss)
        if step % 100 == 0 or step == steps:
            print(f"step {step} loss {run:.3f} reg {float(reg):.4f} dev {dev_nll(prior.theta.detach())} "
                  f"{time.time() - t0:.0f}s", flush=True)
            torch.save({"theta": prior.theta.detach(), "init": prior.init, "step": step}, out / f"prior-{lam}.pt")
    th = prior.theta.detach()
    for i, name in enumerate(("w1", "w2", "c", "d")):
        big = (th[i] - prior.init[i]).abs().flatten().topk(8)
        print(name, [(int(j) // th.shape[2], int(j) % th.shape[2], round(float(th[i].flatten()[j]), 2))
                     for j in big.indices])


def evaluate(pages_folder: Path, a: int, b: int, priors: list[str]) -> None:
    _, target = load_pair("small")
    init = Prior(induction_scores(target)).init
    thetas = {"none": torch.zeros_like(init), "lib": init}
    thetas.update({Path(p).stem: torch.load(p, weights_only=True)["theta"] for p in priors})
    rows = []
    for stem, d in pages(pages_folder, a, b):
        ids, kv, cont = d["ids"], d["kv"], d["cont"]
        t = ids.numel()
        k = max(1, round(R * (t - 1)))
        case = {"rec": (recompute_tail(target, kv, ids, k), ids, cont), "replace": (kv, ids, cont)}
        row = {"full": d["nll_full"], "none": d["nll_none"]}
        for m, (x, i_, c_) in case.items():
            still = torch.zeros(t, dtype=torch.bool)
            still[1:t - k if m == "rec" else t] = True
            for name, th in thetas.items():
                with torch.no_grad():
                    row[f"{m}/{name}"] = float(nll(target, x, i_, c_, still, th))
        rows.append(row)
        print(stem, " ".join(f"{n}={v:.1f}" for n, v in row.items()), flush=True)
    names = [f"{m}/{n}" for m in ("rec", "replace") for n in thetas]
    report(rows, names, ref=lambda name: name.split("/")[0] + "/lib")


def export(checkpoint: str, path: str) -> None:
    from kvbridge.adapters.shipped import SHIPPED_FOLDER
    _, target = load_pair("small")
    saved = torch.load(checkpoint, weights_only=True)
    adapter = sorted(SHIPPED_FOLDER.glob("*.safetensors"))[0].stem
    lam = Path(checkpoint).stem.rpartition("-")[2]
    steps = int(saved["step"])
    InductionPrior(saved["theta"].float(), origin=Path(path).name).save(path, {
        "target": {"name": target.name, "config_hash": target.spec.identity.config_hash},
        "adapter": adapter, "steps": steps, "lam": float(lam),
        "fitted_on": "windows of pydoc_corpus.txt and kernel_docs_corpus.txt, the chain's training documents "
                     "(blake2b split, 8% held out never used); 320 windows, 40 dev windows",
        "command": f"from the repository root, KVBRIDGE_DATA the folder of pydoc_corpus.txt and "
                   f"kernel_docs_corpus.txt: {COMMAND} build 360 && {COMMAND} train {steps} {lam} && "
                   f"{COMMAND} export experiments/out/prior/prior-{lam}.pt FILE"})
    print("wrote", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    work = argparse.ArgumentParser(add_help=False)
    work.add_argument("--work", type=Path, default=EXPERIMENTS / "out" / "prior",
                      help="folder of the windows and checkpoints (default: experiments/out/prior)")
    p = sub.add_parser("build", parents=[work], help="N training windows, projected by the served shipped adapter")
    p.add_argument("n", type=int)
    p.add_argument("--data", type=Path, default=os.environ.get("KVBRIDGE_DATA"),
                   help="folder of pydoc_corpus.txt and kernel_docs_corpus.txt (default: $KVBRIDGE_DATA)")
    p = sub.add_parser("train", parents=[work], help="STEPS Adam steps at regularisation LAM -> WORK/prior-LAM.pt")
    p.add_argument("steps", type=int)
    p.add_argument("lam", type=float)
    p = sub.add_parser("eval", help="recompute:0.1 and replace on build.py's pages with each prior")
    p.add_argument("start", type=int)
    p.add_argument("end", type=int)
    p.add_argument("priors", nargs="*", help="checkpoints of train")
    p.add_argument("--pages", type=Path, default=EXPERIMENTS / "out" / "pages",
                   help="build.py's folder (default: experiments/out/pages)")
    p = sub.add_parser("export", help="a checkpoint as the library's prior file (InductionPrior.save)")
    p.add_argument("checkpoint")
    p.add_argument("file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    if args.what == "build":
        if not args.data:
            parser.error("build: --data or KVBRIDGE_DATA: the folder of pydoc_corpus.txt and kernel_docs_corpus.txt")
        build(args.work, Path(args.data), args.n)
    elif args.what == "train":
        train(args.work, args.steps, args.lam)
    elif args.what == "eval":
        evaluate(args.pages, args.start, args.end, args.priors)
    else:
        export(args.checkpoint, args.file)


if __name__ == "__main__":
    main()
