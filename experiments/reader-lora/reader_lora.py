"""Reader LoRA: the target taught to read the projection, not the projection taught to look like the target's KV.

Every change tried so far moved the map (the adapter) and left fidelity where it was (docs/answers.md,
docs/fidelity-ceiling.md). This asks the other side: a low-rank update of the target's attention projections (q, k,
v, o of every layer; rank R; B starts at zero, so step 0 is the plain target), active only while the target reads a
projected document, trained so that its answer over the projection is its own answer over its own prefill. The
projected KV is the shipped adapter's (`replace`, no prior: what vLLM serves); the target's own weights, the map and
the `full` answers (the reference of fidelity) never change. vLLM serves per-request LoRA adapters, so a reader
adapter is something a deployment could run.

Training windows: the prior fit's answer windows (eval/prior_answers.py: ~512-token windows of the adapter's
training corpora, never its held-out documents; the instruction one of the answer windows' training wordings, a dev
window's DEV_INSTRUCTION; the target's own greedy one-line answer), projected by an in-process server. The loss:
KL(teacher || student) over the teacher's top 32 and the rest (adapters.losses.topk_kl) at the answer's positions,
the teacher the target over its own prefill, the student the target with the reader adapter over the projection.
The checkpoint of the lowest dev answer KL is kept.

Held out: records --first .. --first + --limit of --eval-data (pydoc pages 0-99: no training or tuning step saw them),
cut to --max-doc-tokens, the evaluation's instruction (never trained on), greedy, one line, as `kvbridge eval rouge`
answers: fidelity ROUGE-L against `full`'s answer, greedy agreement, top-1 agreement over `full`'s answer
teacher-forced; for the projection read by the plain target and by the reader adapter, and the wrong-document control
(the page before's projection, read by the reader adapter).

    .venv/bin/python experiments/reader-lora/reader_lora.py --data data --work WORK --out reader.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import time
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", type=Path, required=True, help="the folder of the adapter's training corpora")
parser.add_argument("--work", type=Path, required=True, help="the answer windows' folder (built on demand)")
parser.add_argument("--windows", type=int, default=440, help="dev + training windows")
parser.add_argument("--dev", type=int, default=40)
parser.add_argument("--steps", type=int, default=400)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--rank", type=int, default=8)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--modules", default="q_proj,k_proj,v_proj,o_proj")
parser.add_argument("--dev-every", type=int, default=50)
parser.add_argument("--eval-data", type=Path, default=None, help="default: DATA/pydoc_summaries.jsonl")
parser.add_argument("--first", type=int, default=0)
parser.add_argument("--limit", type=int, default=100)
parser.add_argument("--max-doc-tokens", type=int, default=256)
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args()

import torch  # noqa: E402 - after the arguments: --help stays fast
from kvbridge.adapters.answering import greedy, greedy_agreement, instruction_ids, rouge, stop_ids  # noqa: E402
from kvbridge.adapters.losses import topk_kl  # noqa: E402
from kvbridge.adapters.scoring import bootstrap_mean, continuation_logits  # noqa: E402
from kvbridge.adapters.shipped import find_shipped  # noqa: E402
from kvbridge.eval.prior_answers import AnswerWindows, own_answer  # noqa: E402
from kvbridge.eval.prior_fit import Recipe  # noqa: E402
from kvbridge.eval.records import read_records  # noqa: E402
from kvbridge.eval.run import start_local_server  # noqa: E402
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, prepare  # noqa: E402
from kvbridge.server.client import KVBridgeClient  # noqa: E402
from kvbridge.transfer.presets import load_pair  # noqa: E402
from kvbridge.transfer.segment import KVSegment  # noqa: E402
from kvbridge.transfer.suffix.reuse import prefill_after  # noqa: E402

torch.set_num_threads(2)
TOP_K = 32


class ReaderLoRA(torch.nn.Module):
    """base(x) + scale · B(A(x)) while `on`; base alone otherwise (B starts at zero)."""

    def __init__(self, base: torch.nn.Linear, rank: int):
        super().__init__()
        self.base, self.on, self.scale = base, False, 1.0 / rank
        gen = torch.Generator().manual_seed(base.in_features * 131 + base.out_features)
        self.a = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=gen) / math.sqrt(base.in_features))
        self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x):
        y = self.base(x)
        if self.on:
            y = y + self.scale * ((x.to(self.a.dtype) @ self.a.T) @ self.b.T).to(y.dtype)
        return y


def attach(target, rank: int, names: list[str]) -> list[ReaderLoRA]:
    for p in target.model.parameters():
        p.requires_grad_(False)
    added = []
    for layer in target.model.model.layers:
        for name in names:
            lora = ReaderLoRA(getattr(layer.self_attn, name), rank)
            setattr(layer.self_attn, name, lora)
            added.append(lora)
    return added


@contextlib.contextmanager
def reading(loras: list[ReaderLoRA], on: bool):
    for m in loras:
        m.on = on
    try:
        yield
    finally:
        for m in loras:
            m.on = False


def projected_segment(target, window: dict) -> KVSegment:
    ids = window["ids"]
    return KVSegment(kv=window["kv"].float(), token_ids=ids, positions=torch.arange(ids.numel()),
                     model=target.spec.identity, rotated=True)


def answer_logp(target, cache: KVSegment, window: dict) -> torch.Tensor:
    """Log-probs [A, V] at the answer's positions, the instruction and the answer read after `cache`."""
    q = window["prompt"].numel()
    logits = continuation_logits(target, cache, torch.cat((window["prompt"], window["answer"])))[0]
    return logits[q - 1:q - 1 + window["answer"].numel()].float().log_softmax(-1)


def teachers(target, windows, indices: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    with torch.no_grad():
        for i in indices:
            w = windows[i]
            if w["answer"].numel() == 0:
                continue
            own = prefill_after(target, None, w["ids"])
            out[i] = answer_logp(target, own, w).topk(TOP_K, -1)
    return out


def window_kl(target, windows, teacher, i: int) -> torch.Tensor:
    top = teacher[i]
    return topk_kl(answer_logp(target, projected_segment(target, windows[i]), windows[i]), top.values, top.indices)


def dev_kl(target, loras, windows, teacher, dev: list[int]) -> float:
    with torch.no_grad(), reading(loras, True):
        return sum(float(window_kl(target, windows, teacher, i)) for i in dev) / len(dev)


def train(target, loras, windows) -> dict:
    recipe_dev = list(range(args.dev))
    t0 = time.perf_counter()
    teacher = teachers(target, windows, list(range(args.windows)))
    dev = [i for i in recipe_dev if i in teacher]
    pool = [i for i in range(args.dev, args.windows) if i in teacher]
    print(f"teacher: {len(teacher)} windows with an answer ({time.perf_counter() - t0:.0f} s); "
          f"{len(pool)} training, {len(dev)} dev", flush=True)
    params = [p for m in loras for p in (m.a, m.b)]
    opt = torch.optim.Adam(params, lr=args.lr)
    rng = random.Random(0)
    best = (dev_kl(target, loras, windows, teacher, dev), 0, [p.detach().clone() for p in params])
    history = [{"step": 0, "dev_kl": best[0]}]
    print(f"step 0: dev answer KL {best[0]:.4f}", flush=True)
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = [pool[rng.randrange(len(pool))] for _ in range(args.batch)]
        with reading(loras, True):
            loss = sum(window_kl(target, windows, teacher, i) for i in batch) / len(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.dev_every == 0 or step == args.steps:
            kl = dev_kl(target, loras, windows, teacher, dev)
            history.append({"step": step, "dev_kl": kl, "train_loss": float(loss.detach())})
            print(f"step {step}: train {float(loss.detach()):.4f} dev answer KL {kl:.4f} "
                  f"({(time.perf_counter() - t0) / step:.2f} s a step)", flush=True)
            if kl < best[0]:
                best = (kl, step, [p.detach().clone() for p in params])
    with torch.no_grad():
        for p, kept in zip(params, best[2]):
            p.copy_(kept)
    return {"history": history, "kept_step": best[1], "kept_dev_kl": best[0], "windows": len(pool),
            "dev_windows": len(dev)}


def evaluate(source, target, loras) -> dict:
    config = EvalConfig(max_doc_tokens=args.max_doc_tokens)
    prompt = instruction_ids(target, config.instruction)
    stop = stop_ids(target)
    records = read_records(args.eval_data or args.data / "pydoc_summaries.jsonl")[args.first:args.first + args.limit]
    rows, before = [], None
    running = start_local_server(source, target, "small", None, False)
    try:
        with KVBridgeClient(running.address, timeout_s=600) as client, torch.no_grad():
            fetcher = ProjectedSource(client, target)
            for record in records:
                doc = prepare(record, target, config)
                if doc is None:
                    continue
                full = own_answer(target, doc.target_ids, prompt, config.max_new_tokens).tolist()
                projected = fetcher.fetch(doc.text)[0].segment
                row = {"id": record.id, "full": full}
                caches = {"plain": (projected, False), "reader": (projected, True)}
                if before is not None:
                    caches["reader, the page before's projection"] = (before, True)
                for name, (cache, on) in caches.items():
                    with reading(loras, on):
                        answer, _ = greedy(target, cache, prompt, config.max_new_tokens, stop, one_line=True)
                        forced = {"answer": torch.tensor(full), "prompt": prompt}
                        top1 = (float((answer_logp(target, cache, forced).argmax(-1) == forced["answer"])
                                      .float().mean()) if full else None)
                    text = target.tokenizer.decode(answer, skip_special_tokens=True).strip()
                    ref = target.tokenizer.decode(full, skip_special_tokens=True).strip()
                    row[name] = {"answer": answer, "text": text, "rouge_l": rouge(ref, text)["rougeL"],
                                 "greedy": greedy_agreement(answer, full), "top1": top1}
                before = projected
                rows.append(row)
                print(f"{len(rows):3d} {record.id}: " + ", ".join(f"{n} {row[n]['rouge_l']:.2f}" for n in caches),
                      flush=True)
    finally:
        running.stop(1)
    summary = {}
    for name in ("plain", "reader", "reader, the page before's projection"):
        here = [r for r in rows if name in r]
        summary[name] = {m: bootstrap_mean([r[name][m] for r in here if r[name][m] is not None])
                         for m in ("rouge_l", "greedy", "top1")}
    paired = [r["reader"]["rouge_l"] - r["plain"]["rouge_l"] for r in rows]
    summary["reader - plain, fidelity (paired)"] = bootstrap_mean(paired)
    summary["reader - plain, top-1 (paired)"] = bootstrap_mean([r["reader"]["top1"] - r["plain"]["top1"]
                                                                for r in rows if r["plain"]["top1"] is not None])
    for k, v in summary.items():
        print(k, json.dumps(v))
    return {"summary": summary, "documents": rows}


def main() -> None:
    source, target = load_pair("small")
    adapter = find_shipped(source.spec, target.spec)
    recipe = Recipe(windows=args.windows, dev=args.dev, objective="answer")
    windows = AnswerWindows(recipe, args.data, args.work, source, target, adapter)
    t0 = time.perf_counter()
    windows.build(set(range(args.windows)))
    print(f"windows built ({time.perf_counter() - t0:.0f} s)", flush=True)
    loras = attach(target, args.rank, args.modules.split(","))
    trained = train(target, loras, windows)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "train": trained,
              "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    args.out.write_text(json.dumps(result, indent=1))
    result["eval"] = evaluate(source, target, loras)
    args.out.write_text(json.dumps(result, indent=1))
    torch.save({n: p for n, p in target.model.named_parameters() if p.requires_grad}, args.out.with_suffix(".pt"))


if __name__ == "__main__":
    main()
