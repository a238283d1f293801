"""One arm of the comparison: train residual maps over the ridge init on WORK/cache for SECONDS of wall time, the best
checkpoint and record in WORK/runs/NAME (or $RUNS_DIR/NAME). arms.sh runs the arms of docs/adapter-training.

  python experiments/adapter-training/run_arm.py NAME OBJECTIVE SECONDS [--rank R --joint --init CKPT --lr LR ...]
"""

import argparse
import json
import os
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("name", help="the arm's folder under runs/")
parser.add_argument("objective", help="attention or kl (adapters.trainer.TrainerConfig.objective)")
parser.add_argument("seconds", type=float, help="wall-time budget")
parser.add_argument("--rank", type=int, default=0, help="rank of the residual MLP (0: linear residual only)")
parser.add_argument("--joint", action="store_true", help="the MLP reads K and V jointly")
parser.add_argument("--no-linear", action="store_true", help="no linear residual")
parser.add_argument("--init", help="a chain: start from another arm's best.safetensors (its capacity must match)")
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--batch", type=int, default=4, help="windows a step")
parser.add_argument("--eval-interval", type=int, default=25, help="steps between dev evaluations")
parser.add_argument("--max-iters", type=int, default=100000)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--train-limit", type=int, help="use only the first N training windows")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of build_cache.py (default: experiments/out/arms)")
a = parser.parse_args()

from common import CTX, maps_from, ridge, split
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import CapacityConfig
from kvbridge.adapters.teacher import TeacherCache
from kvbridge.adapters.trainer import TrainerConfig, train
from kvbridge.transfer.presets import load_pair
from safetensors.torch import load_file

RUNS = Path(os.environ.get("RUNS_DIR", a.work / "runs"))
source, target = load_pair("small", device="cpu")
del source
cache = TeacherCache(a.work / "cache")
tr, dev, test = split(a.work, cache, a.train_limit)
adapter, stats, _ = ridge(a.work, target, cache, tr, dev)
cap = CapacityConfig(linear=not a.no_linear, rank=a.rank, joint=a.joint)
maps = maps_from(adapter, stats, cap)
if a.init:  # a chain: start from another arm's best weights (its capacity must match)
    t = load_file(a.init)
    missing = maps.load_state_dict({k[5:]: v for k, v in t.items() if k.startswith("maps.")}, strict=False)
    print("init from", a.init, missing, flush=True)
probe = RecoveryProbe.from_cache(target, adapter.start_kv, cache, dev, CTX)
cfg = TrainerConfig(objective=a.objective, capacity=cap, lr=a.lr, min_lr=a.lr / 10, warmup_iters=10,
                    max_iters=a.max_iters, max_seconds=a.seconds, batch_windows=a.batch,
                    eval_interval=a.eval_interval, seed=0)
print(cfg, f"train windows {len(tr)} dev {len(dev)}", flush=True)
out = train(maps, adapter.start_kv, target, cache, tr, probe, cfg, CTX, RUNS / a.name, resume=a.resume)
summary = {k: out[k] for k in ("best_iter", "best", "iters", "elapsed_s", "tokens_per_step")}
summary |= {"tokens_per_s": out["iters"] * out["tokens_per_step"] / out["elapsed_s"],
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "adapter_bytes": maps.adapter_bytes(), "train_windows": len(tr)}
(RUNS / a.name / "summary.json").write_text(json.dumps(summary, indent=1))
print(summary, flush=True)
