"""Which of the target's own decisions a cache changes: for each document, `full`'s answer (the target's own prefill
of the document cut to --max-doc-tokens, the evaluation's instruction, greedy, one line; as `kvbridge eval rouge`
answers it) read teacher-forced over

  replace/noprior  the adapter's projection of the document (what vLLM serves)
  lead-newline     the target's own cache of the document after one newline (a change no user would notice)

At every answer position the target's own margin (the log-prob of its token over the best other one, over its own
cache) and whether the other cache's argmax is that token. A teacher-forced answer's first disagreement is where the
greedy answer over that cache first leaves `full`'s (the tokens before it are the same), so the table says which
decisions the answers users read turn on: the share of positions the cache flips, by the size of the target's own
margin there, and the margin at the first flip. No training or tuning step reads it.

    .venv/bin/python experiments/fidelity-floor/decisions.py --data data/pydoc_summaries.jsonl --limit 100 \\
        --max-doc-tokens 256 --out decisions.json [--adapter FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

CACHES = ("replace/noprior", "lead-newline")
BUCKETS = (0.25, 1.0, 2.0, 4.0)  # nats: the target's own margin, bucketed at these bounds

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", type=Path, help="a JSONL of records (eval rouge's --data)")
parser.add_argument("--limit", type=int, default=100, help="the first N records (default 100)")
parser.add_argument("--max-doc-tokens", type=int, default=256)
parser.add_argument("--adapter", default=None, help="an adapter file (default: the shipped one)")
parser.add_argument("--out", type=Path, required=True, help="JSON: per document the margins and flips, and the table")
parser.add_argument("--table-only", action="store_true", help="print the table of an existing --out again, and keep it")
args = parser.parse_args()
if args.data is None and not args.table_only:
    parser.error("--data is required (but for --table-only)")

import statistics  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402 - after the arguments: --help stays fast
from kvbridge.adapters.answering import instruction_ids  # noqa: E402
from kvbridge.adapters.scoring import (  # noqa: E402
    bootstrap_draws,
    bootstrap_mean,
    continuation_logits,
    interval95,
)
from kvbridge.eval.prior_answers import own_answer  # noqa: E402
from kvbridge.eval.records import read_records  # noqa: E402
from kvbridge.eval.run import start_local_server  # noqa: E402
from kvbridge.eval.summaries import EvalConfig, ProjectedSource, prepare  # noqa: E402
from kvbridge.server.client import KVBridgeClient  # noqa: E402
from kvbridge.transfer import kvcache  # noqa: E402
from kvbridge.transfer.presets import load_pair  # noqa: E402

torch.set_num_threads(2)
config = EvalConfig(max_doc_tokens=args.max_doc_tokens)


def forced(target, cache, prompt: torch.Tensor, answer: torch.Tensor) -> torch.Tensor:
    """Log-probs [A, V] at the answer's positions, the answer teacher-forced after the prompt over `cache`."""
    with torch.no_grad():
        logits = continuation_logits(target, cache, torch.cat((prompt, answer)))[0]
    return logits[prompt.numel() - 1:prompt.numel() - 1 + answer.numel()].float().log_softmax(-1)


def bucket(margin: float) -> int:
    return sum(margin >= b for b in BUCKETS)


def labels() -> list[str]:
    bounds = (0.0, *BUCKETS, float("inf"))
    return [f"[{lo:g}, {hi:g})" for lo, hi in zip(bounds, bounds[1:])]


def main() -> None:
    if args.table_only:
        saved = json.loads(args.out.read_text())
        saved["summary"] = summarise(saved["documents"], saved["max_doc_tokens"], saved["adapter"])
        args.out.write_text(json.dumps(saved, indent=1))
        return
    source, target = load_pair("small")
    prompt = instruction_ids(target, config.instruction)
    rows = []
    running = start_local_server(source, target, "small", args.adapter, False)
    try:
        with KVBridgeClient(running.address, timeout_s=600) as client:
            projected = ProjectedSource(client, target)
            for record in read_records(args.data)[:args.limit]:
                doc = prepare(record, target, config)
                if doc is None:
                    continue
                moved = prepare(dataclasses.replace(record, document="\n" + record.document), target, config)
                answer = own_answer(target, doc.target_ids, prompt, config.max_new_tokens)
                if answer.numel() == 0:
                    continue
                own = forced(target, kvcache.extract(target.model, target.spec, doc.target_ids), prompt, answer)
                top2 = own.topk(2, -1).values
                row = {"id": record.id, "margins": (top2[:, 0] - top2[:, 1]).tolist(),
                       "own_agrees": (own.argmax(-1) == answer).tolist()}
                caches = {"replace/noprior": projected.fetch(doc.text)[0].segment,
                          "lead-newline": kvcache.extract(target.model, target.spec, moved.target_ids)}
                for name, cache in caches.items():
                    row[name] = (forced(target, cache, prompt, answer).argmax(-1) == answer).tolist()
                rows.append(row)
                print(f"{len(rows):3d} {record.id}: {len(row['margins'])} answer tokens, flipped "
                      + ", ".join(f"{n} {row[n].count(False)}" for n in CACHES), flush=True)
    finally:
        running.stop(1)
    summary = summarise(rows, args.max_doc_tokens, args.adapter)
    args.out.write_text(json.dumps({"data": str(args.data), "max_doc_tokens": args.max_doc_tokens,
                                    "adapter": args.adapter, "buckets": labels(), "summary": summary,
                                    "documents": rows,
                                    "cpu_capability": torch.backends.cpu.get_cpu_capability()}, indent=1))


def pooled(per_doc: list[tuple[int, int]]) -> tuple[float, float, float]:
    """(flips / positions over all documents, and its 95% interval by resampling documents)."""
    flips, n = (np.asarray(v, dtype=np.float64) for v in zip(*per_doc))
    idx = bootstrap_draws(len(flips))
    return (float(flips.sum() / n.sum()), *interval95(flips[idx].sum(-1) / n[idx].sum(-1)))


def summarise(rows: list[dict], max_doc_tokens: int, adapter: str | None) -> dict:
    """Per margin bucket: the share of `full`'s answer positions in it and each cache's flip rate there (positions
    pooled, the interval by resampling documents), and where each cache's first flip falls."""
    names, out = labels(), {}
    positions = [(r, i) for r in rows for i in range(len(r["margins"]))]
    print(f"\n{len(rows)} documents at {max_doc_tokens} tokens, {len(positions)} answer positions of `full`; "
          f"adapter {adapter or 'shipped'}\n")
    print("| the target's own margin (nats) | share of positions | " + " | ".join(f"{n}: flipped" for n in CACHES)
          + " | " + " | ".join(f"{n}: its first flip here" for n in CACHES) + " |")
    print("|---" * (2 + 2 * len(CACHES)) + "|")
    firsts = {n: [] for n in CACHES}
    for n in CACHES:
        for r in rows:
            first = next((i for i, ok in enumerate(r[n]) if not ok), None)
            if first is not None:
                firsts[n].append(bucket(r["margins"][first]))
    for b, name in enumerate(names):
        here = [(r, i) for r, i in positions if bucket(r["margins"][i]) == b]
        row = {"share": len(here) / len(positions)}
        cells = []
        for n in CACHES:
            per_doc = {}
            for r, i in here:
                per_doc.setdefault(r["id"], []).append(0 if r[n][i] else 1)
            rate, lo, hi = pooled([(sum(v), len(v)) for v in per_doc.values()]) if here else (0.0, 0.0, 0.0)
            row[n] = {"flipped": rate, "interval": (lo, hi), "first_flips": firsts[n].count(b)}
            cells.append(f"{rate:.3f} [{lo:.3f}, {hi:.3f}]" if here else "-")
        out[name] = row
        print(f"| {name} | {row['share']:.3f} | " + " | ".join(cells) + " | "
              + " | ".join(f"{row[n]['first_flips']} of {len(firsts[n])}" for n in CACHES) + " |")
    for n in CACHES:
        flips = sum(not ok for r in rows for ok in r[n])
        at = [next((i for i, ok in enumerate(r[n]) if not ok), len(r[n])) for r in rows]
        out[n] = {"flipped": flips / len(positions), "answers_with_a_flip": len(firsts[n]), "documents": len(rows),
                  "first_flip_median": statistics.median(at), "first_flip_mean": bootstrap_mean(at)}
        print(f"{n}: {flips} of {len(positions)} positions flipped ({flips / len(positions):.3f}); "
              f"{len(firsts[n])} of {len(rows)} answers leave `full`'s; the first flip at answer token "
              f"{out[n]['first_flip_mean'][0]:.1f} on average (median {out[n]['first_flip_median']:g})")
    return out


if __name__ == "__main__":
    main()
