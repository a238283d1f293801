"""Score a trained context map (train.py's OUT/best.safetensors) as `kvbridge eval rouge` scores an adapter, through
the same in-process server: the work folder's ridge adapter is the server's adapter, and its projection's map
(`adapter.map_tokens`) is replaced by the context map, untiled (the branch reads neighbouring tokens; a tile
boundary would cut them). Everything else — alignment, the start token's exact KV, RoPE, modes, measures — is the
harness's. Arguments after `--` go to `kvbridge eval rouge` (--adapter is set here).

    .venv/bin/python experiments/context-map/eval.py --work WORK/w3000 --maps WORK/ctx-w4r64 -- \
        --data data/pydoc_summaries.jsonl --exclude EXCLUDE --limit 100 --max-doc-tokens 256 \
        --modes full,none,replace/noprior --out WORK/eval-ctx-w4r64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="the data-need run's work folder (ridge/)")
    parser.add_argument("--maps", type=Path, required=True, help="train.py's --out folder")
    parser.add_argument("--checkpoint", default="best.safetensors")
    parser.add_argument("--data", type=Path, default=HERE.parents[1] / "data")
    args = parser.parse_args(own)

    import torch
    from context_maps import ContextMaps
    from kvbridge import cli
    from kvbridge.adapters import adapter as adapter_module
    from kvbridge.adapters.trainer import _load
    from train import load

    made = json.loads((args.maps / "args.json").read_text())
    _, _, _, _, _, _, ridge, stats = load(args.work, int(made["windows"]), args.data)
    maps = ContextMaps(ridge, stats, window=int(made["window"]), rank=int(made["rank"]), scale=float(made["scale"]),
                       first_lag=int(made.get("first_lag", 0)))
    _load(args.maps / args.checkpoint, maps, None)
    maps.eval()

    def map_tokens(adapter, xk, xv, accumulate_fp32=True, target_ids=None):
        with torch.no_grad():
            return maps(xk.float(), xv.float(), target_ids)

    adapter_module.map_tokens = map_tokens
    adapter_module.cpu_tile_tokens = lambda adapter, segment: 1 << 30  # one tile: the branch reads neighbours
    return cli.main(["eval", "rouge", *rest, "--adapter", str(args.work / "ridge" / "ridge.safetensors")])


if __name__ == "__main__":
    sys.exit(main())
