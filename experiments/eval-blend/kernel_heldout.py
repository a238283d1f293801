"""The held-out documents of the second training corpus as `eval rouge` records: kernel_docs_corpus.txt cut as the
chain adapter cuts it, the documents it holds out (blake2b of the id < 0.08: no adapter's or the fitted prior's
training step saw them). A document's "dev" field says whether the chain could have sampled a dev window from it
(chose its best step there). There is no reference summary ("-"): read NLL recovery, not ROUGE vs reference.

  python experiments/eval-blend/kernel_heldout.py "$KVBRIDGE_DATA/kernel_docs_corpus.txt" kernel_heldout.jsonl
"""

import argparse
import json

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("corpus", help="kernel_docs_corpus.txt")
parser.add_argument("out", help="the records (JSONL) to write")
args = parser.parse_args()

from kvbridge.adapters.chain import ChainConfig
from kvbridge.adapters.teacher import is_heldout, split_documents

config = ChainConfig()  # the chain's split, as the shipped adapter was trained
held = [(i, text) for i, text in split_documents(args.corpus, "kernel", config.doc_chars)
        if is_heldout(i, config.heldout_fraction)]
with open(args.out, "w", encoding="utf-8") as f:
    for i, text in held:
        f.write(json.dumps({"id": i, "document": text, "summary": "-", "dev": is_heldout(i, 0.5, salt="dev")}) + "\n")
print(f"{len(held)} held-out documents -> {args.out}")
