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

`exact_tail` (kl, ce): in half the steps, the last k context tokens (k drawn from 1..round(exact_tail * C)) are not
projected but prefilled by the target over the projected rest, with the continuation, as `recompute:r` and
`blend:r` do in use; the loss stays on the continuation. A map trained only with the continuation right after the
projected tokens spends itself on the last tokens, which selective recompute replaces anyway; with exact tails it
also learns what the continuation reads further back. The dev score is then the mean of the recovery with no exact
tail and with round(exact_tail * C / 2) exact tokens.

`maps` is a projection (residual.ResidualMaps: the context's K/V come from the source alone) or a fuser
(fuser.FuserMaps: the target's own K/V of the context plus a residual from the source).

Recovery (`RecoveryProbe`) is evaluate.py's: (NLL_none - NLL_projected) / (NLL_none - NLL_full) over the pooled
continuation tokens, bootstrap 95% interval over documents; the maps' input is built as `adapter.project` builds it.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from kvbridge.adapters.adapter import has_text_source
from kvbridge.adapters.evaluate import EvalDocument
from kvbridge.adapters.fuser import FuserMaps
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from kvbridge.adapters.teacher import TeacherCache, capture_attention, source_features
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from safetensors.torch import load_file, save_file
from tqdm import tqdm

OBJECTIVES = ("attention", "kl", "ce")
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
    seed: int = 0

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
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
        if self.exact_tail and self.objective == "attention":
            raise ValueError("exact_tail is for the end-to-end objectives (kl, ce); attention matching scores "
                             "the target's own queries over the projected context, which have no exact tail")


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


# ------------------------------------------------------------------------------------------------ projected windows

def project_window(maps: ResidualMaps, start_kv: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor,
                   start_mask: torch.Tensor, target: LoadedModel, ids: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """What `adapter.project` computes, differentiable. xk, xv: [L_s, T, d_s]; start_mask, ids: [T] (target ids:
    the token features); start_kv: [L_t, 2, H_t, D_t] (keys un-rotated) -> keys (rotated at 0..T-1), values:
    [L_t, H_t, T, D_t]."""
    spec = target.spec
    yk, yv = maps(xk, xv, ids)  # [L_t, T, d_t]
    lt, t, _ = yk.shape
    k = yk.view(lt, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    v = yv.view(lt, t, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
    m = start_mask.to(k.device)[None, None, :, None]
    k = torch.where(m, start_kv[:, 0, :, None, :], k)
    v = torch.where(m, start_kv[:, 1, :, None, :], v)
    return target.rope.rotate_all(k, torch.arange(t)), v


def context_kv(maps, start_kv: torch.Tensor, xk: torch.Tensor, xv: torch.Tensor, start_mask: torch.Tensor,
               target: LoadedModel, ids: torch.Tensor, own_k: torch.Tensor | None = None,
               own_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache a map gives for start + context: projected (ResidualMaps) or fused with the target's own K/V
    (FuserMaps; own_k, own_v needed) -> keys (rotated), values [L_t, H_t, T, D_t]."""
    if isinstance(maps, FuserMaps):
        if own_k is None or own_v is None:
            raise ValueError("a fuser needs the target's own K/V of the context")
        return maps.fuse(xk, xv, own_k, own_v, target, keep=start_mask)
    return project_window(maps, start_kv, xk, xv, start_mask, target, ids)


class AttentionGeometry:
    """Per target layer: the attention scale and o_proj weight, read once from the model's own modules."""

    def __init__(self, target: LoadedModel):
        ids = torch.tensor([0, 1])
        with torch.no_grad(), capture_attention(target.model) as rec:
            target.model(input_ids=ids[None].to(target.device))
        layers = range(target.spec.num_layers)
        self.scaling = [float(rec[j][0].scaling) for j in layers]
        self.o_proj = torch.stack([rec[j][0].o_proj.weight.detach().float() for j in layers])  # [L_t, hid, H_q*D]


def attention_outputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, geometry: AttentionGeometry,
                      first: int = 0) -> torch.Tensor:
    """q: [L_t, H_q, T_q, D] at positions first..T-1; k, v: [L_t, H_t, T, D] -> causal attention through
    o_proj: [L_t, T_q, hidden]."""
    lt, hq, t, d = q.shape
    mask = torch.ones(t, k.shape[2], dtype=torch.bool).tril(diagonal=first)  # [T_q, T]
    out = torch.stack([F.scaled_dot_product_attention(q[j:j + 1], k[j:j + 1], v[j:j + 1], attn_mask=mask,
                                                      scale=geometry.scaling[j], enable_gqa=True)[0]
                       for j in range(lt)])  # [L_t, H_q, T_q, D]
    out = out.transpose(1, 2).reshape(lt, t, hq * d)
    return torch.bmm(out, geometry.o_proj.transpose(1, 2))


def attention_loss(maps, start_kv, window: dict, target: LoadedModel, geometry: AttentionGeometry,
                   context_tokens: int, queries: str = "continuation") -> torch.Tensor:
    k_p, v_p = project_window(maps, start_kv, window["xk"], window["xv"], window["start_mask"], target, window["ids"])
    k_own, v_own = window["k"].float(), window["v"].float()
    t = k_own.shape[2]
    ctx = torch.zeros(t, dtype=torch.bool)
    ctx[1:1 + context_tokens] = True  # the positions a projected cache replaces (the start token is exact)
    m = ctx[None, None, :, None]
    k_mix, v_mix = torch.where(m, k_p, k_own), torch.where(m, v_p, v_own)
    first = 1 + context_tokens if queries == "continuation" else 1
    q = window["q"][:, :, first:].float()  # [L_t, H_q, T - first, D]; causal from position `first` on
    with torch.no_grad():
        own = attention_outputs(q, k_own, v_own, geometry, first)  # [L_t, T - first, hidden]
        power = own.pow(2).sum(-1).mean(-1)  # [L_t]
    got = attention_outputs(q, k_mix, v_mix, geometry, first)
    return ((got - own).pow(2).sum(-1).mean(-1) / power).mean()


def continuation_logp(maps, start_kv, windows: list[dict], target: LoadedModel, context_tokens: int,
                      exact: int = 0) -> torch.Tensor:
    """Log-probs [B, N-1, V] the target gives the continuation's next tokens over the map's context cache; with
    `exact` > 0 the cache holds start + the context's first C - exact tokens, and the last `exact` are prefilled
    with the continuation (selective recompute's setting)."""
    if not 0 <= exact < context_tokens:
        raise ValueError(f"exact must be in [0, {context_tokens}) context tokens, got {exact}")
    p = 1 + context_tokens - exact  # tokens in the map's cache
    segments = []
    for w in windows:
        own = (w["k"][:, :, :p], w["v"][:, :, :p]) if isinstance(maps, FuserMaps) else (None, None)
        k, v = context_kv(maps, start_kv, w["xk"][:, :p], w["xv"][:, :p], w["start_mask"][:p], target,
                          w["ids"][:p], *own)
        segments.append(KVSegment(kv=torch.stack((k, v), dim=1), token_ids=w["ids"][:p],
                                  positions=torch.arange(p), model=target.spec.identity, rotated=True))
    cache = kvcache.to_cache(segments, target.model, target.spec)
    rest = torch.stack([w["ids"][p:] for w in windows]).to(target.device)  # [B, exact + N]
    pos = torch.arange(p, p + rest.shape[1], device=target.device)[None].expand_as(rest)
    logits = target.model(input_ids=rest, position_ids=pos, cache=cache).logits[:, exact:-1]
    return logits.float().log_softmax(-1)


def kl_loss(maps, start_kv, windows: list[dict], target: LoadedModel, context_tokens: int, exact: int = 0
            ) -> torch.Tensor:
    """KL(teacher top-k || student) per scored position, averaged over the batch's positions."""
    logp = continuation_logp(maps, start_kv, windows, target, context_tokens, exact)
    top_logp = torch.stack([w["top_logp"] for w in windows])  # [B, N-1, k]
    top_idx = torch.stack([w["top_idx"] for w in windows])
    p = top_logp.log_softmax(-1)  # renormalised over the top-k
    student = logp.gather(-1, top_idx.to(logp.device))
    return (p.exp() * (p - student)).sum(-1).mean()


def ce_loss(maps, start_kv, windows: list[dict], target: LoadedModel, context_tokens: int, exact: int = 0
            ) -> torch.Tensor:
    """Cross-entropy of the true continuation tokens 1..N-1, averaged over the batch's positions."""
    logp = continuation_logp(maps, start_kv, windows, target, context_tokens, exact)
    truth = torch.stack([w["ids"][2 + context_tokens:] for w in windows]).to(logp.device)  # [B, N-1]
    return -logp.gather(-1, truth[..., None]).mean()


# --------------------------------------------------------------------------------------------------------- recovery

@dataclass
class ProbeItem:
    xk: torch.Tensor  # [L_s, 1 + C, d_s] source features of start + context
    xv: torch.Tensor
    start_mask: torch.Tensor  # [1 + C]
    context_ids: torch.Tensor  # [1 + C] start + context target ids
    continuation: torch.Tensor  # [N]
    k: torch.Tensor | None = None  # [L_t, H_t, 1 + C, D_t] the target's own K (rotated) / V of start + context:
    v: torch.Tensor | None = None  # what a fuser adds to


class RecoveryProbe:
    """Held-out recovery of a map, fast: source features and the full / none NLLs are computed once."""

    def __init__(self, target: LoadedModel, start_kv: torch.Tensor, items: list[ProbeItem]):
        if len(items) < 2:
            raise ValueError(f"a recovery probe needs at least 2 documents, got {len(items)}")
        self.target, self.start_kv, self.items = target, start_kv, items
        self.full, self.none = [], []
        with torch.no_grad():
            for it in items:
                self.full.append(self._plain(torch.cat((it.context_ids, it.continuation)), it.context_ids.numel()))
                self.none.append(self._plain(torch.cat((it.context_ids[:1], it.continuation)), 1))
        self.tokens = sum(it.continuation.numel() - 1 for it in items)

    def _plain(self, ids: torch.Tensor, prefix: int) -> float:
        logits = self.target.model(input_ids=ids[None].to(self.target.device)).logits[0, prefix:]
        return float(F.cross_entropy(logits[:-1].float(), ids[prefix + 1:].to(logits.device), reduction="sum"))

    @classmethod
    def from_documents(cls, source: LoadedModel, target: LoadedModel, start_kv, docs: list[EvalDocument],
                       start_token: int, own: bool = False) -> "RecoveryProbe":
        """own: also keep the target's own K/V of every context (for a fuser)."""
        items = []
        for d in docs:
            xk, xv = source_features(source, d.source.ids, d.alignment.source_index)
            ids = torch.cat((torch.tensor([start_token]), d.target_context))
            mask = (~has_text_source(d.alignment.kind)) & (ids == start_token)
            k = v = None
            if own:
                seg = kvcache.extract(target.model, target.spec, ids)
                k, v = seg.keys.float().cpu(), seg.values.float().cpu()
            items.append(ProbeItem(xk, xv, mask, ids, d.continuation, k, v))
        return cls(target, start_kv, items)

    @classmethod
    def from_cache(cls, target: LoadedModel, start_kv, cache: TeacherCache, indices: list[int],
                   context_tokens: int) -> "RecoveryProbe":
        c, items = context_tokens, []
        for i in indices:
            w = cache.load(i)
            items.append(ProbeItem(w["xk"][:, :1 + c].float(), w["xv"][:, :1 + c].float(), w["start_mask"][:1 + c],
                                   w["ids"][:1 + c], w["ids"][1 + c:], w["k"][:, :, :1 + c].float(),
                                   w["v"][:, :, :1 + c].float()))
        return cls(target, start_kv, items)

    @torch.no_grad()
    def per_document(self, maps, shift: int = 0, exact: int = 0) -> list[float]:
        """Summed continuation NLL per document. shift > 0: the wrong-document control, document i's context
        cache built from document (i + shift)'s source features (a fuser keeps document i's own K/V). exact > 0:
        the context's last `exact` tokens are prefilled by the target with the continuation (`recompute:r`)."""
        out = []
        n = len(self.items)
        for i, it in enumerate(self.items):
            src = self.items[(i + shift) % n]
            if src.xk.shape != it.xk.shape:
                raise ValueError("the wrong-document control needs contexts of one length")
            p = it.context_ids.numel() - exact
            if not 1 < p <= it.context_ids.numel():
                raise ValueError(f"exact must leave start + one context token projected, got {exact}")
            own = (it.k[:, :, :p], it.v[:, :, :p]) if it.k is not None else (None, None)
            k, v = context_kv(maps, self.start_kv, src.xk[:, :p], src.xv[:, :p], it.start_mask[:p], self.target,
                              src.context_ids[:p], *own)
            seg = KVSegment(kv=torch.stack((k, v), dim=1), token_ids=it.context_ids[:p], positions=torch.arange(p),
                            model=self.target.spec.identity, rotated=True)
            out.append(self._cached(seg, torch.cat((it.context_ids[p:], it.continuation)), exact))
        return out

    def _cached(self, seg: KVSegment, rest: torch.Tensor, scored_from: int = 0) -> float:
        """NLL of rest[scored_from + 1:] with `rest` prefilled over the cache `seg`."""
        cache = kvcache.to_cache(seg, self.target.model, self.target.spec)
        t = seg.num_tokens
        pos = torch.arange(t, t + rest.numel(), device=self.target.device)[None]
        logits = self.target.model(input_ids=rest[None].to(self.target.device), position_ids=pos,
                                   cache=cache).logits[0, scored_from:]
        return float(F.cross_entropy(logits[:-1].float(), rest[scored_from + 1:].to(logits.device), reduction="sum"))

    def recovery(self, maps, seed: int = 0, wrong: bool = False, exact: int = 0) -> dict:
        """Recovery with a bootstrap 95% interval over documents; wrong: also the wrong-document control and the
        paired difference (own document minus wrong document) with its interval. exact: the context's last
        `exact` tokens prefilled by the target (see per_document)."""
        got = self.per_document(maps, exact=exact)
        columns = [self.none, self.full, got] + ([self.per_document(maps, shift=1, exact=exact)] if wrong else [])
        rows = list(zip(*columns))

        def rec(sample, col=2):
            none, full, x = (sum(r[i] for r in sample) for i in (0, 1, col))
            return (none - x) / (none - full)

        rng = random.Random(seed)
        samples = [[rng.choice(rows) for _ in rows] for _ in range(1000)]
        boot = sorted(rec(s) for s in samples)
        out = {"recovery": rec(rows), "interval": (boot[25], boot[974]), "documents": len(rows),
               "nll": {n: sum(r[i] for r in rows) / self.tokens for i, n in enumerate(("none", "full", "projected"))}}
        if wrong:
            boot_w = sorted(rec(s, 3) for s in samples)
            diff = sorted(rec(s) - rec(s, 3) for s in samples)
            out |= {"wrong": rec(rows, 3), "wrong_interval": (boot_w[25], boot_w[974]),
                    "own_minus_wrong": rec(rows) - rec(rows, 3), "own_minus_wrong_interval": (diff[25], diff[974])}
        return out


# ------------------------------------------------------------------------------------------------------- the loop

def _batch_indices(config: TrainerConfig, it: int, n: int) -> list[int]:
    """Windows of step `it`: epoch-wise permutations seeded by (seed, epoch) — a function of `it` alone, so a
    resumed run draws what an uninterrupted one would."""
    out = []
    for slot in range(it * config.batch_windows, (it + 1) * config.batch_windows):
        epoch, pos = divmod(slot, n)
        g = torch.Generator().manual_seed(config.seed * 1_000_003 + epoch)
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
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"state": json.dumps(state)})
    tmp.replace(path)


def _load(path: Path, maps: ResidualMaps, optimizer) -> dict:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        state = json.loads(f.metadata()["state"])
    tensors = load_file(str(path))
    maps.load_state_dict({k[5:]: v for k, v in tensors.items() if k.startswith("maps.")})
    if optimizer is not None:
        params = dict(maps.named_parameters())
        for name, p in params.items():
            st = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.startswith(f"opt.{name}.")}
            if st:
                optimizer.state[p] = st
    return state


def train(maps: ResidualMaps, start_kv: torch.Tensor, target: LoadedModel, cache: TeacherCache,
          train_idx: list[int], dev: RecoveryProbe | None, config: TrainerConfig, context_tokens: int,
          out_dir: str | Path, resume: bool = False, progress: bool = True, until: int | None = None) -> dict:
    """Train `maps` in place; the best (by dev recovery, else the last) weights are loaded back at the end.
    Writes out_dir/{last,best}.safetensors and record.json; returns the record. `until`: leave after the
    checkpoint at that iteration, as an interrupted run would (for testing resume)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    for p in target.model.parameters():
        p.requires_grad_(False)
    if config.objective == "attention" and isinstance(maps, FuserMaps):
        raise ValueError("a fuser trains end to end (objective 'ce'); attention matching is for projections")
    geometry = AttentionGeometry(target) if config.objective == "attention" else None
    if geometry is not None and "q" not in cache.load(train_idx[0]):
        raise ValueError(f"attention matching reads the target's queries, and the teacher cache {cache.root} was "
                         "built without them (TeacherConfig.queries)")
    optimizer = torch.optim.AdamW(maps.parameters(), lr=config.lr, betas=(0.9, 0.99), weight_decay=config.weight_decay)
    state = {"iter": 0, "best": -math.inf, "best_iter": -1, "elapsed_s": 0.0, "stale": 0, "record": [],
             "config": asdict(config)}
    if resume and (out / "last.safetensors").exists():
        state = _load(out / "last.safetensors", maps, optimizer)
        if state["config"] != json.loads(json.dumps(asdict(config))):
            raise ValueError(f"{out}/last.safetensors was written under another config; resume needs the same")
    tokens_per_step = config.batch_windows * cache.load(train_idx[0])["ids"].numel()  # target tokens per step
    it, began = state["iter"], time.perf_counter() - state["elapsed_s"]

    def evaluate(train_loss: float) -> bool:
        row = {"iter": it, "elapsed_s": round(time.perf_counter() - began, 2), "train_loss": train_loss,
               "lr": state.get("lr", 0.0), "tokens": it * tokens_per_step}
        improved = True
        if dev is not None:
            r = dev.recovery(maps)
            row |= {"dev_recovery": r["recovery"], "dev_interval": r["interval"]}
            if config.exact_tail:  # the score: the mean of no exact tail and the middle of the range trained on
                tail = round(config.exact_tail * context_tokens / 2)
                r_tail = dev.recovery(maps, exact=tail)
                row |= {"dev_recovery_replace": r["recovery"], f"dev_recovery_exact_{tail}": r_tail["recovery"],
                        "dev_recovery": (r["recovery"] + r_tail["recovery"]) / 2}
                row.pop("dev_interval")
            improved = row["dev_recovery"] > state["best"]
        state["record"].append(row)
        if improved:
            state.update(best=row.get("dev_recovery", 0.0), best_iter=it, stale=0)
            _save(out / "best.safetensors", maps, None, {k: v for k, v in state.items() if k != "record"})
        else:
            state["stale"] += 1
        (out / "record.json").write_text(json.dumps(state["record"], indent=1))
        return config.patience > 0 and state["stale"] >= config.patience

    bar = tqdm(total=config.max_iters, initial=it, desc=f"train {config.objective}", disable=not progress)
    losses: list[float] = []
    stop = False
    while it < config.max_iters and not stop:
        if it % config.eval_interval == 0 and not (state["record"] and state["record"][-1]["iter"] == it):
            stop = evaluate(sum(losses) / len(losses) if losses else float("nan"))
            losses = []
            state.update(iter=it, elapsed_s=time.perf_counter() - began)
            _save(out / "last.safetensors", maps, optimizer, state)
            if stop or (until is not None and it >= until):
                stop = True
                break
        elapsed = time.perf_counter() - began
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
        windows = [cache.load(i) for i in _batch_indices(config, it, len(train_idx)) for i in [train_idx[i]]]
        if config.objective == "attention":
            loss = sum(attention_loss(maps, start_kv, w, target, geometry, context_tokens, config.queries)
                       for w in windows)
            loss = loss / len(windows)
        else:
            loss = (kl_loss if config.objective == "kl" else ce_loss)(
                maps, start_kv, windows, target, context_tokens, exact_tail_tokens(config, it, context_tokens))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(maps.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        it += 1
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.1e}",
                        tok_s=f"{it * tokens_per_step / max(time.perf_counter() - began, 1e-9):.0f}")
    bar.close()
    if not stop and not (state["record"] and state["record"][-1]["iter"] == it):
        evaluate(sum(losses) / len(losses) if losses else float("nan"))
        state.update(iter=it, elapsed_s=time.perf_counter() - began)
        _save(out / "last.safetensors", maps, optimizer, state)
    if dev is not None and until is None:
        _load(out / "best.safetensors", maps, None)
    return {"record": state["record"], "best_iter": state["best_iter"], "best": state["best"],
            "iters": it, "elapsed_s": time.perf_counter() - began, "tokens_per_step": tokens_per_step}

