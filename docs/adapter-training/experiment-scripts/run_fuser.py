"""The learned fuser: python run_fuser.py NAME SECONDS [--rank 64 --lr 3e-3 --batch 4 --wd 0]"""
import argparse, json, sys, time
sys.path.insert(0, "/work/exp13")
from common import *
from kvbridge.adapters.fuser import FuserConfig, FuserMaps
from kvbridge.adapters.trainer import RecoveryProbe, TrainerConfig, train

ap = argparse.ArgumentParser()
ap.add_argument("name"); ap.add_argument("seconds", type=float)
ap.add_argument("--rank", type=int, default=64); ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--batch", type=int, default=4); ap.add_argument("--wd", type=float, default=0.0)
ap.add_argument("--eval-interval", type=int, default=20); ap.add_argument("--max-iters", type=int, default=100000)
ap.add_argument("--resume", action="store_true"); ap.add_argument("--train-limit", type=int)
a = ap.parse_args()
RUNS = Path(os.environ.get("RUNS_DIR", EXP / "runs"))
source, target = load_pair("small", device="cpu")
del source
cache = TeacherCache(EXP / "cache")
tr, dev, test = split(cache, a.train_limit)
adapter, stats, _ = ridge(target, cache, tr[:200], dev)
torch.manual_seed(0)
maps = FuserMaps.from_ridge(adapter, stats, FuserConfig(rank=a.rank))
probe = RecoveryProbe.from_cache(target, adapter.start_kv, cache, dev, CTX)
cfg = TrainerConfig(objective="ce", lr=a.lr, min_lr=a.lr / 10, warmup_iters=10, max_iters=a.max_iters,
                    max_seconds=a.seconds, batch_windows=a.batch, eval_interval=a.eval_interval, seed=0,
                    weight_decay=a.wd)
print(cfg, f"train windows {len(tr)} dev {len(dev)}", flush=True)
out = train(maps, adapter.start_kv, target, cache, tr, probe, cfg, CTX, RUNS / a.name, resume=a.resume)
summary = {k: out[k] for k in ("best_iter", "best", "iters", "elapsed_s", "tokens_per_step")}
summary |= {"tokens_per_s": out["iters"] * out["tokens_per_step"] / out["elapsed_s"], "args": vars(a),
            "trainable_bytes": maps.trainable_bytes(), "train_windows": len(tr)}
(RUNS / a.name / "summary.json").write_text(json.dumps(summary, indent=1))
print(summary, flush=True)
