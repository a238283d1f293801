"""Train a context map (kvbridge.adapters.context.ContextMaps, adapter format 4) with the kl stage of `train-adapter
--trainer chain`, from the ridge fit and on the teacher windows of a data-need run (experiments/data-need/curve.sh:
WORK/w3000, 3,000 windows, ridge of 100, token rank 64), with that run's schedule and batches (seed 0, lr 3e-3 ->
3e-4, 10 warm-up steps, 4 windows a step, dev recovery every 25): its record.json is the paired baseline (the same
windows in the same order; only the map differs). Writes OUT/{best,last}.safetensors and OUT/record.json; a rerun
resumes. With --first-lag 1 the same run as `train-adapter --trainer chain --train-windows 3000 --ridge-windows 100
--token-rank 64 --stages kl:1000 --context-window N --context-rank R --work WORK`, whose stage folder
(stage-0-kl-contextNrR) takes OUT's files.

    .venv/bin/python experiments/context-map/train.py --work WORK/w3000 --out WORK/ctx-w4r64 \
        --window 4 --rank 64 --steps 1000
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))


def load(work: Path, windows: int, data: Path, ridge_windows: int = 100, token_rank: int = 64):
    """The pair, teacher cache, dev/train indices and ridge fit of a `--trainer chain` work folder (nothing is
    recomputed when the folder is complete), through the chain's own steps: the teacher cache and the ridge fit record
    what they were made from (adapters/work_folder.py), and a folder made from another corpus or with other options
    is refused by the option's name."""
    import torch
    from kvbridge.adapters.chain import ChainConfig, kv_windows, select_windows, valid_windows
    from kvbridge.adapters.chain_start import read_start, ridge_start, start_inputs
    from kvbridge.adapters.distributed import build_teacher_cache
    from kvbridge.adapters.pairs import start_token_id
    from kvbridge.adapters.teacher import TeacherConfig
    from kvbridge.adapters.work_folder import corpus_digest
    from kvbridge.transfer.presets import load_pair

    torch.set_num_threads(2)
    source, target = load_pair("small", device="cpu")
    config = ChainConfig(stages=(("kl", 1),), train_windows=windows, ridge_windows=ridge_windows,
                         token_rank=token_rank, teacher=TeacherConfig(queries=False))  # as a kl-only chain's
    files = [data / "pydoc_corpus.txt", data / "kernel_docs_corpus.txt"]
    dev, train_w = select_windows(files, target.tokenizer, config)
    valid = valid_windows(config, train_w, target.tokenizer)
    corpus = corpus_digest(files)
    inputs = start_inputs(config, corpus, dev, valid[:config.ridge_windows])
    saved = read_start(work, config, inputs)  # (refused before any teacher window when made for other inputs)
    cache, _ = build_teacher_cache(work / "teacher", source, target, dev + train_w, config.teacher,
                                   start_token_id(target.tokenizer), progress=False,
                                   kv_ids=kv_windows(config, dev, valid),
                                   corpus={"files": corpus, "doc_chars": config.doc_chars})
    pos = {e["id"]: i for i, e in enumerate(cache.entries)}
    dev_idx = [pos[w.id] for w in dev if w.id in pos]
    train_idx = [pos[w.id] for w in train_w if w.id in pos]  # (those of `valid`: the ridge reads the first ones)
    ridge, stats, _ = ridge_start(work, saved, inputs, cache, train_idx, dev_idx, target, config, progress=False)
    return source, target, config, cache, dev_idx, train_idx, ridge, stats


def _macs(maps) -> int:
    """The branch's multiply-adds per target token over every layer: its filter and two GEMMs."""
    return sum(p.numel() for name, p in maps.named_parameters() if name in ("ctx_g", "ctx_a", "ctx_b"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="a data-need run's work folder (teacher/, ridge/)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--windows", type=int, default=3000)
    parser.add_argument("--window", type=int, default=4, help="tokens the branch reads (1: no context)")
    parser.add_argument("--first-lag", type=int, default=0, choices=(0, 1),
                        help="1: the branch reads only the tokens before (lags 1..window), not the token itself")
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--scale", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--factored", action="store_true",
                        help="the cheaper branch of factored.py (the first GEMM before the filter)")
    parser.add_argument("--data", type=Path, default=ROOT / "data")
    args = parser.parse_args(argv)

    import torch
    from kvbridge.adapters.chain import DEFAULT_EVAL_INTERVAL, DEFAULT_LR
    from kvbridge.adapters.context import ContextConfig, ContextMaps
    from kvbridge.adapters.recovery_probe import RecoveryProbe
    from kvbridge.adapters.trainer import TrainerConfig, train

    _, target, config, cache, dev_idx, train_idx, ridge, stats = load(args.work, args.windows, args.data)
    torch.manual_seed(config.seed)
    kind = ContextMaps
    if args.factored:
        from factored import FactoredContextMaps as kind
    maps = kind(ridge, stats, ContextConfig(window=args.window, rank=args.rank, scale=args.scale,
                                            first_lag=args.first_lag))
    probe = RecoveryProbe.from_cache(target, ridge.start_kv, cache, dev_idx, config.teacher.context_tokens)
    lr = DEFAULT_LR["kl"]
    tc = TrainerConfig(objective="kl", lr=lr, min_lr=lr / 10, warmup_iters=10, max_iters=args.steps,
                       batch_windows=config.batch_windows, eval_interval=DEFAULT_EVAL_INTERVAL["kl"], seed=0)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "args.json").write_text(json.dumps({k: str(v) for k, v in vars(args).items()}
                                                   | {"branch_macs_per_token": _macs(maps)}))
    out = train(maps, ridge.start_kv, target, cache, train_idx, probe, tc, config.teacher.context_tokens, args.out,
                resume=True, progress=True)
    print(json.dumps({"best_iter": out["best_iter"], "best": out["best"], "iters": out["iters"],
                      "elapsed_s": round(out["elapsed_s"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
