"""The learned fuser (adapters.fuser) trained by the cross-entropy of the continuation on WORK/cache, the ridge init
fitted on its first 200 training windows; the best checkpoint and record in WORK/runs/NAME (or $RUNS_DIR/NAME).
`train-adapter --trainer fuser` runs the same recipe from one command.

  python experiments/adapter-training/run_fuser.py fuser_r64 2400 --eval-interval 20
"""

import argparse
import json
import os
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("name", help="the run's folder under runs/")
parser.add_argument("seconds", type=float, help="wall-time budget")
parser.add_argument("--rank", type=int, default=64)
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--batch", type=int, default=4, help="windows a step")
parser.add_argument("--wd", type=float, default=0.0, help="weight decay")
parser.add_argument("--eval-interval", type=int, default=20, help="steps between dev evaluations")
parser.add_argument("--max-iters", type=int, default=100000)
parser.add_argument("--resume", action="store_true")
parser.add_argument("--train-limit", type=int, help="use only the first N training windows")
parser.add_argument("--work", type=Path, default=Path(__file__).resolve().parents[1] / "out" / "arms",
                    help="work folder of build_cache.py (default: experiments/out/arms)")
a = parser.parse_args()

import torch
from common import CTX, ridge, split
from kvbridge.adapters.fuser import FuserConfig, FuserMaps
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.teacher import TeacherCache
from kvbridge.adapters.trainer import TrainerConfig, train
from kvbridge.transfer.presets import load_pair

RUNS = Path(os.environ.get("RUNS_DIR", a.work / "runs"))
source, target = load_pair("small", device="cpu")
del source
cache = TeacherCache(a.work / "cache")
tr, dev, test = split(a.work, cache, a.train_limit)
adapter, stats, _ = ridge(a.work, target, cache, tr[:200], dev)
torch.manual_seed(0)
maps = FuserMaps.from_ridge(adapter, stats, FuserConfig(rank=a.rank))
probe = RecoveryProbe.from_cache(target, adapter.start_kv, cache, dev, CTX)
cfg = TrainerConfig(objective="ce", lr=a.lr, min_lr=a.lr / 10, warmup_iters=10, max_iters=a.max_iters,
                    max_seconds=a.seconds, batch_windows=a.batch, eval_interval=a.eval_interval, seed=0,
                    weight_decay=a.wd)
print(cfg, f"train windows {len(tr)} dev {len(dev)}", flush=True)
out = train(maps, adapter.start_kv, target, cache, tr, probe, cfg, CTX, RUNS / a.name, resume=a.resume)
summary = {k: out[k] for k in ("best_iter", "best", "iters", "elapsed_s", "tokens_per_step")}
summary |= {"tokens_per_s": out["iters"] * out["tokens_per_step"] / out["elapsed_s"],
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "trainable_bytes": maps.trainable_bytes(), "train_windows": len(tr)}
(RUNS / a.name / "summary.json").write_text(json.dumps(summary, indent=1))
print(summary, flush=True)
