"""Score a trained context map (train.py's OUT/best.safetensors) through `kvbridge eval rouge`: the maps fold into a
format-4 adapter (OUT/adapter.safetensors, float32; the projection reads the tokens before each tile), which the
harness's server loads like any adapter file. Arguments after `--` go to `kvbridge eval rouge` (--adapter is set
here).

    .venv/bin/python experiments/context-map/eval.py --work WORK/w3000 --maps WORK/ctx-lag1-w8r64 -- \
        --data data/pydoc_summaries.jsonl --exclude EXCLUDE --limit 100 --max-doc-tokens 256 \
        --modes full,none,replace/noprior --out WORK/eval-ctx-lag1-w8r64
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

    from kvbridge import cli
    from kvbridge.adapters.context import ContextConfig, ContextMaps
    from kvbridge.adapters.io import save_adapter
    from kvbridge.adapters.trainer import _load
    from train import load

    made = json.loads((args.maps / "args.json").read_text())
    _, _, _, _, _, _, ridge, stats = load(args.work, int(made["windows"]), args.data)
    config = ContextConfig(window=int(made["window"]), rank=int(made["rank"]), scale=float(made["scale"]),
                           first_lag=int(made.get("first_lag", 0)))
    if made.get("factored") != "True":
        maps = ContextMaps(ridge, stats, config)
        _load(args.maps / args.checkpoint, maps, None)
        path = save_adapter(maps.to_adapter(ridge), args.maps / "adapter.safetensors")
        return cli.main(["eval", "rouge", *rest, "--adapter", str(path)])
    # factored.py's branch has no adapter format: the ridge adapter serves, its map replaced (one tile: the branch
    # reads the tokens before)
    import torch
    from factored import FactoredContextMaps
    from kvbridge.adapters import adapter as adapter_module

    maps = FactoredContextMaps(ridge, stats, config)
    _load(args.maps / args.checkpoint, maps, None)
    maps.eval()

    def map_tokens(adapter, xk, xv, accumulate_fp32=True, target_ids=None, halo=0):
        with torch.no_grad():
            return maps(xk.float(), xv.float(), target_ids)

    adapter_module.map_tokens = map_tokens
    adapter_module.cpu_tile_tokens = lambda adapter, segment: 1 << 30
    return cli.main(["eval", "rouge", *rest, "--adapter", str(args.work / "ridge" / "ridge.safetensors")])


if __name__ == "__main__":
    sys.exit(main())
