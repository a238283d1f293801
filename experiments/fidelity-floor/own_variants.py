"""How far the target's own answer moves under input changes a user would not notice: for each document, the answer
`kvbridge eval rouge` calls `full` (the target's own prefill of the document cut to --max-doc-tokens, the evaluation's
instruction, greedy, one line) against the target's own answer to

  drop-last     the same document one token shorter (its last token dropped)
  lead-newline  the same document after one newline ("\\n" + text, cut as the evaluation cuts it)

scored as the evaluation scores fidelity (ROUGE-L of the variant's answer against `full`'s, rouge-score, Porter
stemming), with greedy agreement (the share of `full`'s first 24 answer tokens the variant has at the same place) and
the place of the first differing token; bootstrap 95% intervals over documents. No projection: the target's own
cache throughout (in the dtype eval rouge loads it in), so what moves the answer is the input alone: the measure's
own spread for this target.

    .venv/bin/python experiments/fidelity-floor/own_variants.py --data data/pydoc_summaries.jsonl --limit 100 \\
        --max-doc-tokens 256 --out own_variants.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

VARIANTS = ("drop-last", "lead-newline")

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--data", required=True, type=Path, help="a JSONL of records (eval rouge's --data)")
parser.add_argument("--limit", type=int, default=100, help="the first N records (default 100)")
parser.add_argument("--max-doc-tokens", type=int, default=256)
parser.add_argument("--out", type=Path, required=True, help="JSON: per document the answers, and the summary")
args = parser.parse_args()

import torch  # noqa: E402 - after the arguments: --help stays fast
from kvbridge.adapters.answering import greedy_agreement, instruction_ids, rouge  # noqa: E402
from kvbridge.adapters.scoring import bootstrap_mean  # noqa: E402
from kvbridge.eval.prior_answers import own_answer  # noqa: E402
from kvbridge.eval.records import read_records  # noqa: E402
from kvbridge.eval.summaries import EvalConfig, prepare  # noqa: E402
from kvbridge.transfer.presets import load_pair  # noqa: E402

torch.set_num_threads(2)
_, target = load_pair("small", source_weights=False)  # as eval rouge loads it
config = EvalConfig(max_doc_tokens=args.max_doc_tokens)
prompt = instruction_ids(target, config.instruction)


def answer(ids: torch.Tensor) -> tuple[list[int], str]:
    tokens = own_answer(target, ids, prompt, config.max_new_tokens).tolist()  # as `full` answers in eval rouge
    return tokens, target.tokenizer.decode(tokens, skip_special_tokens=True).strip()


rows = []
for record in read_records(args.data)[:args.limit]:
    doc = prepare(record, target, config)
    if doc is None:
        continue
    moved = prepare(dataclasses.replace(record, document="\n" + record.document), target, config)
    full_ids, full_text = answer(doc.target_ids)
    row = {"id": record.id, "full": full_text}
    for name, ids in (("drop-last", doc.target_ids[:-1]), ("lead-newline", moved.target_ids)):
        ids_v, text_v = answer(ids)
        first = next((i for i, (a, b) in enumerate(zip(full_ids, ids_v)) if a != b), min(len(full_ids), len(ids_v)))
        row[name] = {"answer": text_v, "fidelity": rouge(full_text, text_v)["rougeL"],
                     "greedy": greedy_agreement(ids_v, full_ids), "first_difference": first,
                     "identical": ids_v == full_ids}
    rows.append(row)
    print(f"{len(rows):3d} {record.id}: " + ", ".join(f"{v} {row[v]['fidelity']:.2f}" for v in VARIANTS), flush=True)

summary = {}
print(f"\n{len(rows)} documents of {args.data} at {args.max_doc_tokens} tokens, the target's own cache\n")
print("| variant | fidelity ROUGE-L vs `full` | greedy agreement | identical answers | first token differs |")
print("|---|---|---|---|---|")
for name in VARIANTS:
    fid = bootstrap_mean([r[name]["fidelity"] for r in rows])
    greedy_share = bootstrap_mean([r[name]["greedy"] for r in rows if r[name]["greedy"] is not None])
    same = sum(r[name]["identical"] for r in rows)
    first = sum(r[name]["first_difference"] == 0 and not r[name]["identical"] for r in rows)
    summary[name] = {"fidelity": fid, "greedy": greedy_share, "identical": same, "first_token_differs": first}
    print(f"| {name} | {fid[0]:.3f} [{fid[1]:.3f}, {fid[2]:.3f}] | {greedy_share[0]:.3f} [{greedy_share[1]:.3f}, "
          f"{greedy_share[2]:.3f}] | {same} of {len(rows)} | {first} of {len(rows)} |")
args.out.write_text(json.dumps({"documents": rows, "summary": summary, "max_doc_tokens": args.max_doc_tokens,
                                "data": str(args.data)}, indent=1))
