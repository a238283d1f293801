"""The scalable adapter trainer: minibatches of cached teacher windows, a residual on the ridge map, warmup + cosine,
held-out recovery every eval_interval with the best checkpoint kept, resume by a flag, deterministic under a seed.

Objectives (`TrainerConfig.objective`):
  attention  layer-local: for every target layer, the target's own queries of the window attend once to the
             projected context K/V (own K/V after the context) and once to its own K/V; the loss is the squared
             difference of the two attention outputs after the layer's o_proj, divided by the own output's mean
             power, averaged over layers and query positions 1..T-1. No backprop through the model.
  kl         end to end: start + context as a projected cache, the continuation prefilled by the frozen target;
             cross-entropy of its next-token distribution against the teacher's top-k (renormalised) minus the
             teacher's entropy, i.e. KL over the teacher's top-k, on the positions evaluate.py scores.
  ce         end to end, as kl, but the cross-entropy of the true continuation tokens: the objective of the learned
             fuser (fuser.py), whose goal is to beat the target's own prefill, the KL's optimum.
  answer     end to end on answer windows (answer_windows.py: a document of 256 to 2,048 tokens, an instruction
             after it and the target's own greedy answer): the document as a projected cache, the instruction and
             the answer prefilled by the frozen target, KL over the teacher's top-k at the answer positions.
  decision   answer's KL plus a hinge on the answer's greedy decisions (losses.decision_hinge): at each answer
             position the student must rank the teacher's token first by the teacher's own margin (at most 1 nat),
             the positions weighted by the answer tokens after them: what greedy decoding reads, not the mass.
  onpolicy   on the same windows, on-policy distillation: the student (the target over the projected document)
             answers greedily, the teacher (the target over its own prefill of the document) scores that answer, KL
             over the teacher's top-k at the student's answer positions (losses.onpolicy_loss): what is trained is
             where the student's own answers leave the teacher's, not the teacher's path alone.

The dev score that picks the best checkpoint (`select`): "recovery" (the recovery probe's, below) or "fidelity" (an
answer probe's, answer_probe.py: the mean of ROUGE-L against the target's own answer and top-1 agreement over it);
"last" keeps the last step whatever the probes say (they still report).
With an answer probe, every evaluation reports its measures whatever `select` is.

`exact_tail` (kl, ce): in half the steps, the last k context tokens (k drawn from 1..round(exact_tail * C)) are not
projected but prefilled by the target over the projected rest, with the continuation, as `recompute:r` and
`blend:r` do in use; the loss stays on the continuation. A map trained only with the continuation right after the
projected tokens spends itself on the last tokens, which selective recompute replaces anyway; with exact tails it
also learns what the continuation reads further back. The dev score is then the mean of the recovery with no exact
tail and with round(exact_tail * C / 2) exact tokens.

`maps` is a projection (residual.ResidualMaps: the context's K/V come from the source alone) or a fuser
(fuser.FuserMaps: the target's own K/V of the context plus a residual from the source).

The map's context cache is map_kv.py's (its input built as `adapter.project` builds it), the objectives losses.py's,
the dev recovery recovery_probe.py's (scoring.py's recovery, as evaluate.py reports it for an adapter); this module is
the loop: config, schedule, batches, evaluation, checkpoints. Under torchrun (distributed.py) every rank runs the loop:
each step's batch is split by rank and the gradients summed; rank 0 scores the dev windows and writes the files.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from kvbridge.adapters.answer_probe import AnswerProbe
from kvbridge.adapters.answering import stop_ids
from kvbridge.adapters.distributed import (
    barrier,
    check_same,
    from_main,
    is_main,
    reduce_gradients,
    shard,
    summed,
    world_size,
)
from kvbridge.adapters.fuser import FuserMaps
from kvbridge.adapters.losses import (
    AttentionGeometry,
    answer_loss,
    attention_loss,
    ce_loss,
    decision_loss,
    kl_loss,
    onpolicy_loss,
)
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from kvbridge.adapters.teacher import TeacherCache
from kvbridge.adapters.work_folder import check_inputs
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.tensor_files import json_field, read_metadata, read_tensors, save_tensors
from tqdm import tqdm

OBJECTIVES = ("attention", "kl", "ce", "answer", "decision", "onpolicy")
ANSWER_OBJECTIVES = ("answer", "decision", "onpolicy")  # trained on answer windows
SELECT = ("recovery", "fidelity", "last")
QUERIES = ("continuation", "all")


@dataclass(frozen=True)
class TrainerConfig:
    objective: str = "attention"  # see OBJECTIVES
    queries: str = "continuation"  # attention matching: the continuation's queries (as in use) or every position's
    capacity: CapacityConfig = CapacityConfig()
    lr: float = 1e-3  # Adam step in units of the target's own K/V std (residual.py), so 1e-3 is gentle
    min_lr: float = 1e-4  # the cosine's floor
    warmup_iters: int = 20
    max_iters: int = 400
    max_seconds: float = 0.0  # > 0: stop at this wall time and run the schedule on max(it/max_iters, t/max_seconds)
    batch_windows: int = 4  # windows per step
    grad_clip: float = 1.0
    weight_decay: float = 0.0  # decays the residual towards the ridge map
    eval_interval: int = 50
    patience: int = 0  # > 0: stop after this many evaluations without a better dev recovery
    exact_tail: float = 0.0  # kl/ce: the largest share of the context prefilled exactly at its end (see above)
    select: str = "recovery"  # the dev score that picks the best checkpoint: see SELECT
    decision_weight: float = 1.0  # decision: the hinge's weight beside the answer KL (losses.decision_loss)
    seed: int = 0

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.select not in SELECT:
            raise ValueError(f"select must be one of {SELECT}, got {self.select!r}")
        if self.queries not in QUERIES:
            raise ValueError(f"queries must be one of {QUERIES}, got {self.queries!r}")
        if isinstance(self.capacity, dict):  # from a saved checkpoint's JSON
            object.__setattr__(self, "capacity", CapacityConfig(**self.capacity))
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < min_lr <= lr, got min_lr {self.min_lr}, lr {self.lr}")
        if self.max_iters < 1 or self.batch_windows < 1 or self.eval_interval < 1:
            raise ValueError("max_iters, batch_windows and eval_interval must be >= 1")
        if not 0 <= self.warmup_iters < self.max_iters:
            raise ValueError(f"warmup_iters must be in [0, max_iters), got {self.warmup_iters}")
        if self.grad_clip <= 0 or self.max_seconds < 0 or self.weight_decay < 0 or self.patience < 0:
            raise ValueError("grad_clip must be > 0; max_seconds, weight_decay and patience >= 0")
        if not 0 <= self.exact_tail < 1:
            raise ValueError(f"exact_tail must be in [0, 1), got {self.exact_tail}")
        if not self.decision_weight > 0:
            raise ValueError(f"decision_weight must be > 0, got {self.decision_weight}")
        if self.exact_tail and self.objective == "attention":
            raise ValueError("exact_tail is for the end-to-end objectives (kl, ce); attention matching scores "
                             "the target's own queries over the projected context, which have no exact tail")


def _as_written(saved: dict) -> dict | None:
    """A checkpoint's config as this version writes it (fields added since take their defaults); None if it is not
    one this version reads."""
    try:
        return json.loads(json.dumps(asdict(TrainerConfig(**saved))))
    except (TypeError, ValueError):
        return None


# the train-adapter option behind a config field (chain.ChainConfig.stage_configs), named when a resume is refused
OPTION_OF = {"max_iters": " (--stages)", "warmup_iters": " (--stages)", "lr": " (--stage-lr)",
             "min_lr": " (--stage-lr)", "batch_windows": " (--batch-windows)", "exact_tail": " (--exact-tail)",
             "select": " (--keep)", "decision_weight": " (--decision-weight)", "seed": " (--seed)"}


def _state(path: Path) -> dict:
    """A checkpoint's state (its metadata), read without its tensors."""
    try:
        return json_field(path, read_metadata(path), "state")
    except ValueError as exc:
        raise ValueError(f"{exc}: it is not a kvbridge trainer checkpoint; remove {path.parent} or use another "
                         "--work") from None


def check_resume(out_dir: str | Path, config: TrainerConfig, inputs: dict | None = None,
                 state: dict | None = None) -> None:
    """Raise ValueError, naming what differs, when out_dir holds a checkpoint (last.safetensors, or its `state` when
    given) written under another config or, with `inputs` (work_folder.py: what the stage starts from and reads),
    for other inputs. Nothing to resume: nothing to check."""
    out = Path(out_dir)
    path = out / "last.safetensors"
    if state is None:
        if not path.exists():
            return
        state = _state(path)
    wanted = json.loads(json.dumps(asdict(config)))
    saved = _as_written(state["config"])
    if saved != wanted:
        differ = ", ".join(f"{k}{OPTION_OF.get(k, '')} {saved.get(k)!r} there, {v!r} here" for k, v in wanted.items()
                           if saved.get(k) != v) if saved is not None else "not a config this version reads"
        raise ValueError(f"{path} was written under another config ({differ}); resume needs the same: use another "
                         f"--work or remove {out}")
    if inputs is not None:
        check_inputs(state.get("inputs"), inputs, out.parent, out, f"stage {config.objective}")


def exact_tail_tokens(config: TrainerConfig, it: int, context_tokens: int) -> int:
    """Exact context tokens at step `it` (a function of the seed and `it`, so a resumed run draws the same): 0 in
    half the steps, else uniform in 1..round(exact_tail * context_tokens)."""
    most = round(config.exact_tail * context_tokens)
    if most < 1:
        return 0
    rng = random.Random(config.seed * 1_000_003 + it)
    return 0 if rng.random() < 0.5 else rng.randint(1, most)


def get_lr(config: TrainerConfig, it: int, progress: float) -> float:
    """Linear warmup over warmup_iters, then cosine from lr to min_lr as `progress` goes 0 -> 1."""
    if it < config.warmup_iters:
        return config.lr * (it + 1) / (config.warmup_iters + 1)
    coeff = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return config.min_lr + coeff * (config.lr - config.min_lr)

# ------------------------------------------------------------------------------------------------------- the loop

def batch_indices(seed: int, batch_windows: int, it: int, n: int) -> list[int]:
    """Windows (of n) of step `it`: epoch-wise permutations seeded by (seed, epoch) — a function of `it` alone, so a
    resumed run draws what an uninterrupted one would, and a run's draws are known before it starts
    (chain.windows_read)."""
    out = []
    for slot in range(it * batch_windows, (it + 1) * batch_windows):
        epoch, pos = divmod(slot, n)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        out.append(int(torch.randperm(n, generator=g)[pos]))
    return out


def _save(path: Path, maps: ResidualMaps, optimizer, state: dict) -> None:
    tensors = {f"maps.{k}": v.detach().contiguous() for k, v in maps.state_dict().items()}
    if optimizer is not None:
        names = {id(p): n for n, p in maps.named_parameters()}
        for group in optimizer.param_groups:
            for p in group["params"]:
                for k, v in optimizer.state.get(p, {}).items():
                    tensors[f"opt.{names[id(p)]}.{k}"] = torch.as_tensor(v).detach().clone().contiguous()
    save_tensors(path, tensors, metadata={"state": json.dumps(state)})


def _load(path: Path, maps: ResidualMaps, optimizer) -> dict:
    state = _state(path)
    tensors = read_tensors(path)[0]
    maps.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("maps.")})
    if optimizer is not None:
        params = dict(maps.named_parameters())
        for name, p in params.items():
            st = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"opt.{name}.")}
            if st:
                optimizer.state[p] = st
    return state


def train(maps: ResidualMaps, start_kv: torch.Tensor, target: LoadedModel, cache: TeacherCache,
          train_idx: list[int | None], dev: RecoveryProbe | None, config: TrainerConfig, context_tokens: int,
          out_dir: str | Path, resume: bool = False, progress: bool = True, until: int | None = None,
          answers: AnswerProbe | None = None, teacher=None, inputs: dict | None = None) -> dict:
    """Train `maps` in place; the best (by the dev score `config.select`, else the last) weights are loaded back at
    the end. `cache` holds the objective's windows (answer windows for "answer" and "onpolicy"); `answers` scores dev
    fidelity; `teacher` (onpolicy; tests): a window -> the teacher's cache of its document, else the target's own.
    Writes out_dir/{last,best}.safetensors and record.json (each row: the mean and every step's training loss since
    the last one); returns the record. `until`: leave after the checkpoint at that iteration, as an interrupted run
    would (for testing resume). Under torchrun: collective; `dev` and `answers` are read on rank 0 only (the others may
    pass None). `inputs`: what the stage starts from and reads (chain.py's; work_folder.py), recorded in its
    checkpoints: a resume for other inputs is refused by name."""
    if world_size() > config.batch_windows:
        raise ValueError(f"{world_size()} ranks share each step's {config.batch_windows} windows: every rank needs at "
                         "least one (raise the batch, --batch-windows, or start fewer processes)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    for p in target.model.parameters():
        p.requires_grad_(False)
    if config.objective == "attention" and isinstance(maps, FuserMaps):
        raise ValueError("a fuser trains end to end (objective 'ce'); attention matching is for projections")
    geometry = AttentionGeometry(target) if config.objective == "attention" else None
    if geometry is not None or isinstance(maps, FuserMaps):
        cache.require_kv(train_idx, f"the {config.objective} stage of a {type(maps).__name__}")
    if geometry is not None and "q" not in cache.load(train_idx[0]):
        raise ValueError(f"attention matching reads the target's queries, and the teacher cache {cache.root} was "
                         "built without them (TeacherConfig.queries)")
    optimizer = torch.optim.AdamW(maps.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=config.weight_decay)
    state = {"iter": 0, "best": -math.inf, "best_iter": -1, "elapsed_s": 0.0, "stale": 0, "record": [],
             "config": asdict(config)} | ({} if inputs is None else {"inputs": inputs})
    if resume and (out / "last.safetensors").exists():
        check_resume(out, config, inputs, _state(out / "last.safetensors"))
        state = _load(out / "last.safetensors", maps, optimizer)
        if inputs is not None:
            state["inputs"] = inputs  # (a checkpoint of an older kvbridge records none)
    check_same(maps.state_dict(), f"maps at the start of {out.name}")
    if is_main() and config.select == "fidelity" and answers is None:
        raise ValueError("select 'fidelity' chooses checkpoints on an answer probe; none was given")
    if is_main() and config.select == "recovery" and dev is None and answers is not None:
        raise ValueError("select 'recovery' chooses checkpoints on a recovery probe; only an answer probe was given")
    metric = "dev_fidelity" if config.select == "fidelity" else "dev_recovery"
    scored = from_main(dev is not None or answers is not None)  # rank 0 scores the dev windows
    # (-1: a window the teacher cache left out; None: an answer window answered with nothing)
    first = next(i for i in train_idx if i is not None and i >= 0)
    tokens_per_step = config.batch_windows * cache.load(first)["ids"].numel()  # target tokens per step
    if config.objective == "onpolicy":  # the student answers as the windows' teacher did (answer_windows.py)
        made = json.loads(cache.index_path.read_text())["config"]
        onpolicy = {"max_new_tokens": made["max_answer_tokens"], "stop": stop_ids(target), "topk": made["topk"],
                    "teacher": teacher}
    it, began = state["iter"], time.perf_counter() - state["elapsed_s"]

    def evaluate(step_losses: list[float]) -> bool:
        row = {"iter": it, "elapsed_s": round(time.perf_counter() - began, 2),
               "train_loss": sum(step_losses) / len(step_losses) if step_losses else float("nan"),
               "step_losses": step_losses, "lr": state.get("lr", 0.0), "tokens": it * tokens_per_step}
        improved = True
        if scored and is_main() and dev is not None:
            r = dev.recovery(maps)
            row |= {"dev_recovery": r["recovery"], "dev_interval": r["interval"]}
            if config.exact_tail:  # the score: the mean of no exact tail and the middle of the range trained on
                tail = round(config.exact_tail * context_tokens / 2)
                r_tail = dev.recovery(maps, exact=tail)
                row |= {"dev_recovery_replace": r["recovery"], f"dev_recovery_exact_{tail}": r_tail["recovery"],
                        "dev_recovery": (r["recovery"] + r_tail["recovery"]) / 2}
                row.pop("dev_interval")
        if scored and is_main() and answers is not None:
            a = answers.score(maps)
            row |= {"dev_fidelity": a["fidelity"], "dev_rougeL": a["rougeL"], "dev_top1": a["top1"],
                    "dev_greedy": a["greedy"], "dev_answer_kl": a["kl"]}
        row = from_main(row)  # rank 0's clock and dev scores
        if scored and config.select != "last":
            improved = row[metric] > state["best"]
        state["record"].append(row)
        if improved:
            state.update(best=row.get(metric, 0.0), best_iter=it, stale=0)
            if is_main():
                _save(out / "best.safetensors", maps, None, {k: v for k, v in state.items() if k != "record"})
        else:
            state["stale"] += 1
        if is_main():
            (out / "record.json").write_text(json.dumps(state["record"], indent=1))
        return config.patience > 0 and state["stale"] >= config.patience

    bar = tqdm(total=config.max_iters, initial=it, desc=f"train {config.objective}", disable=not progress)
    losses: list[float] = []
    stop = config.patience > 0 and state["stale"] >= config.patience  # resumed after it stopped early: stays stopped
    while it < config.max_iters and not stop:
        if it % config.eval_interval == 0 and not (state["record"] and state["record"][-1]["iter"] == it):
            stop = evaluate(losses)
            losses = []
            state.update(iter=it, elapsed_s=time.perf_counter() - began)
            if is_main():
                _save(out / "last.safetensors", maps, optimizer, state)
            if stop or (until is not None and it >= until):
                stop = True
                break
        elapsed = time.perf_counter() - began
        if config.max_seconds:
            elapsed = from_main(elapsed)  # one clock for every rank's schedule and stop
        if config.max_seconds and elapsed >= config.max_seconds:
            break
        frac = it / config.max_iters
        if config.max_seconds:
            frac = max(frac, elapsed / config.max_seconds)
        warm = config.warmup_iters
        lr = get_lr(config, it, (frac * config.max_iters - warm) / (config.max_iters - warm))
        for group in optimizer.param_groups:
            group["lr"] = lr
        state["lr"] = lr  # the step's rate, for the record
        # the global batch; this rank's share of it:
        batch = batch_indices(config.seed, config.batch_windows, it, len(train_idx))
        picked = [train_idx[i] for i in shard(batch)]
        if any(i is not None and i < 0 for i in picked):  # (-1: a window the teacher cache left out)
            raise RuntimeError(f"step {it} draws a training window the teacher cache does not hold")
        windows = [cache.load(i) for i in picked if i is not None]  # (None: an empty answer adds nothing)
        if config.objective == "attention":
            loss = sum(attention_loss(maps, start_kv, w, target, geometry, context_tokens, config.queries)
                       for w in windows)
            loss = loss / len(batch)
        elif not windows:  # every window drawn here answered with nothing: a step of no gradient
            loss = sum(p.sum() for p in maps.parameters() if p.requires_grad) * 0.0
        elif config.objective == "answer":
            loss = answer_loss(maps, start_kv, windows, target) * (len(windows) / len(batch))
        elif config.objective == "decision":
            loss = decision_loss(maps, start_kv, windows, target, config.decision_weight) * (
                len(windows) / len(batch))
        elif config.objective == "onpolicy":
            loss = onpolicy_loss(maps, start_kv, windows, target, **onpolicy) * (len(windows) / len(batch))
        else:
            loss = (kl_loss if config.objective == "kl" else ce_loss)(
                maps, start_kv, windows, target, context_tokens, exact_tail_tokens(config, it, context_tokens))
            if len(windows) < len(batch):  # a mean over this rank's windows -> its part of the batch's mean
                loss = loss * (len(windows) / len(batch))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        reduce_gradients(maps.parameters())  # the global batch's gradient on every rank
        torch.nn.utils.clip_grad_norm_(maps.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(summed(loss.detach()))
        it += 1
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.1e}",
                        tok_s=f"{it * tokens_per_step / max(time.perf_counter() - began, 1e-9):.0f}")
    bar.close()
    if not stop and not (state["record"] and state["record"][-1]["iter"] == it):
        evaluate(losses)
        state.update(iter=it, elapsed_s=time.perf_counter() - began)
        if is_main():
            _save(out / "last.safetensors", maps, optimizer, state)
    check_same(maps.state_dict(), f"maps at the end of {out.name}")
    barrier()  # rank 0's files are written
    if scored and until is None:
        _load(out / "best.safetensors", maps, None)
    return {"record": state["record"], "best_iter": state["best_iter"], "best": state["best"],
            "iters": it, "elapsed_s": time.perf_counter() - began, "tokens_per_step": tokens_per_step}

