"""The induction prior: what a projected cache's keys blur at the target's induction heads, put back from the tokens.

An induction head finds the earlier occurrence of the current token and attends to the token after it: its key at
position j must name the token at j - 1 precisely enough that, among hundreds of keys, the right one wins the
softmax. A cross-model projection is a little wrong everywhere, and at these heads that costs most: on the small pair,
after `recompute:0.1`, the keys of the target's two induction heads made exact recover +0.04 of the +0.13 still
missing (docs/eval-blend, "Where recompute:0.1 loses the rest"), and no input a projection has predicts them well
enough (key R² 0.42-0.76 where about 0.95 is needed). The generator, though, knows every token of the document
exactly. So while the target reads a cache with projected tokens in it, each induction query head h adds

    weight_h · (bias · [token(j-1) = token(query)] + bias2 · [that, and token(j-2) = token(query - 1)])

to its attention score of every *projected* key j (never to keys the target computed itself: those are exact).
weight_h is head h's induction score (`induction_scores`: a repeated random sequence; the attention a token of the
repeat gives the token after its first occurrence), heads below `threshold` get nothing (`InductionPrior.probed`;
chosen on tuning pages 100-139, docs/eval-blend, "The induction prior"). A *fitted* prior has its own numbers per
query head for those two terms and two more (every projected key; a projected key of the query's own token), fitted
by the continuation's NLL on windows of the adapter's training corpora; `InductionPrior.for_model` takes the one
that ships for the model (`priors/`, matched by config hash) and probes where none does.

`InductionPrior.reading(lm, token_ids, projected)` is a context manager: within it, every forward of `lm` over a
cache whose first N positions hold `token_ids` (N = len(token_ids)), the ones where `projected` is True projected,
runs with the prior. It tracks the tokens each forward appends (prefill, decode), so one block can cover a prefill
and a whole `generate`; a forward whose position_ids name tokens the cache already holds recomputes them in place
(`reuse.recompute_selected`: blend's forward), and reads the rest of the cache with the prior the same way.
Batch size 1. Within the block the layers with a biased head run SDPA (flash-attention cannot take a per-head bias);
the others run the model's own attention (flash-attention stays on there). A forward reads no value back to the host:
the tables live on the model's device and whether each forward's queries follow the cache (or recompute tokens it
holds) is checked once, when the block ends (a ValueError then).
"""

from __future__ import annotations

import functools
import json
import sys
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from kvbridge.transfer.attention import (
    GROUPED_SDPA,
    SDPA_NAMES,
    accepts_custom_masks,
    custom_mask_fallback,
    eager_attention,
    switched_attention,
    takes_custom_mask,
)
from kvbridge.transfer.kvcache import decoder_layers
from kvbridge.transfer.models import LoadedModel
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION = "kvbridge_induction_prior"  # the attention implementation a model runs while it reads with a prior
STATE = "_kvbridge_induction_read"  # the attribute of each attention module that holds its model's _ReadState
PROBE_TOKENS = 64  # length of the random sequence the probe repeats
PROBE_SEQUENCES = 4
PRIORS = Path(__file__).resolve().parent / "priors"  # the fitted priors that ship with kvbridge
UNWRAPPED = ("flex_attention",)  # own attentions whose masks the prior cannot read: SDPA everywhere (`ATTENTION`)

_scores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model module -> {seed: [L, H_q] scores}
_lock = threading.Lock()


@torch.no_grad()
def induction_scores(lm: LoadedModel, seed: int = 0) -> torch.Tensor:
    """[L, H_q] float32 on the CPU: per query head, the mean attention a token of a repeated random sequence gives the
    token after the first occurrence of itself (1.0: a perfect induction head). Cached per model."""
    with _lock:
        known = _scores.get(lm.model, {}).get(seed)
    if known is not None:
        return known
    vocab = lm.spec.vocab_size
    low = min(100, vocab // 4)  # past the special tokens a tokenizer puts first
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(low, min(vocab, 20000), (PROBE_SEQUENCES, PROBE_TOKENS), generator=g)
    n = PROBE_TOKENS
    device = next(lm.model.parameters()).device
    with eager_attention(lm.model):
        out = lm.model(input_ids=torch.cat((seq, seq), 1).to(device), output_attentions=True, logits_to_keep=1)
    q = torch.arange(n, 2 * n - 1)  # the repeat's tokens (but its last) ...
    k = q - n + 1  # ... and the token after each one's first occurrence
    scores = torch.stack([a[:, :, q, k].float().mean(dim=(0, 2)).cpu() for a in out.attentions])  # [L, H_q]
    with _lock:
        _scores.setdefault(lm.model, {})[seed] = scores
    return scores


TERMS = ("match", "match2", "projected", "duplicate")  # the rows of InductionPrior.terms


@dataclass(frozen=True)
class InductionPrior:
    """Per query head, what is added to the attention score of a *projected* key j (TERMS, rows of `terms`):
    match: the token at j - 1 is the query's token; match2: on top, the token at j - 2 is the query's previous token;
    projected: every projected key (how much the head trusts projected keys against exact ones); duplicate: the
    token at j is the query's own token."""

    terms: torch.Tensor  # [4, L, H_q] float32 (TERMS); a head whose four are 0 reads as the model does
    origin: str = "given"  # what made it: "probe ...", or the fitted file it came from
    _placed: dict = field(default_factory=dict, init=False, compare=False, repr=False)  # device -> `placed`

    def __post_init__(self):
        t = self.terms
        if t.ndim != 3 or t.shape[0] != len(TERMS) or not t.is_floating_point() or not bool(t.isfinite().all()):
            raise ValueError(f"InductionPrior.terms must be a finite float [{len(TERMS)}, layers, query heads] "
                             f"tensor ({', '.join(TERMS)}), got {t.dtype} {tuple(t.shape)}")

    @classmethod
    def from_weights(cls, weights: torch.Tensor, bias: float = 3.0, bias2: float = 3.0, origin: str = "given"
                     ) -> InductionPrior:
        """The prior of weights [L, H_q] >= 0: bias × weight on the match, bias2 × weight more on the longer match."""
        if weights.ndim != 2 or not weights.is_floating_point() or bool((weights < 0).any()):
            raise ValueError(f"induction prior weights must be a float [layers, query heads] tensor >= 0, got "
                             f"{weights.dtype} {tuple(weights.shape)}")
        if not (bias >= 0 and bias2 >= 0):
            raise ValueError(f"InductionPrior biases must be >= 0, got {bias}, {bias2}")
        w = weights.float()
        return cls(torch.stack((bias * w, bias2 * w, torch.zeros_like(w), torch.zeros_like(w))), origin)

    @classmethod
    def probed(cls, lm: LoadedModel, threshold: float = 0.1, bias: float = 3.0, bias2: float = 3.0
               ) -> InductionPrior:
        """The prior on `lm`'s query heads whose induction score is at least `threshold`, weighted by it."""
        if not 0 < threshold <= 1:
            raise ValueError(f"the induction threshold must be in (0, 1], got {threshold}")
        scores = induction_scores(lm)
        return cls.from_weights(torch.where(scores >= threshold, scores, torch.zeros_like(scores)), bias, bias2,
                                origin=f"probe (score >= {threshold}, bias {bias} + {bias2})")

    @classmethod
    def for_model(cls, lm: LoadedModel, folder: Path | None = None) -> InductionPrior:
        """The prior fitted for `lm` that ships with kvbridge (`priors/`, matched by config hash), else `probed`."""
        path = find_fitted(lm, folder)
        return cls.load(path) if path is not None else cls.probed(lm)

    def save(self, path: str | Path, meta: dict) -> None:
        """A safetensors file: the terms and a JSON "kvbridge_prior" entry (`meta`: the target, how it was fitted)."""
        save_file({"terms": self.terms.float().contiguous()}, str(path),
                  metadata={"kvbridge_prior": json.dumps(meta, sort_keys=True)})

    @classmethod
    def load(cls, path: str | Path) -> InductionPrior:
        path = Path(path)
        with safe_open(str(path), "pt") as f:
            if "kvbridge_prior" not in (f.metadata() or {}) or "terms" not in f.keys():
                raise ValueError(f"{path} is not an induction prior file (no kvbridge_prior metadata or terms)")
            return cls(f.get_tensor("terms").float(), origin=path.name)

    def from_layer(self, first: int) -> InductionPrior:
        """The prior on layers `first`.. only: where a pass made the first layers' KV the target's own."""
        if first <= 0:
            return self
        terms = self.terms.clone()
        terms[:, :first] = 0
        return InductionPrior(terms, f"{self.origin}, from layer {first}")

    def placed(self, device: torch.device) -> dict[int, torch.Tensor]:
        """{layer: [H_q, 4] float32 terms (TERMS) on `device`} for the layers with a biased head; made once per
        device (a forward then copies nothing)."""
        device = torch.device(device)
        with _lock:
            placed = self._placed.get(device)
            if placed is None:
                placed = self._placed[device] = {layer: self.terms[:, layer].T.contiguous().to(device)
                                                 for layer in self.heads}
        return placed

    @property
    def heads(self) -> dict[int, list[int]]:
        """{layer: [query heads]} that get the prior."""
        out: dict[int, list[int]] = {}
        for layer, head in (self.terms != 0).any(0).nonzero().tolist():
            out.setdefault(layer, []).append(head)
        return out

    @contextmanager
    def reading(self, lm: LoadedModel, token_ids: torch.Tensor, projected: torch.Tensor) -> Iterator[None]:
        """Within the block, `lm`'s forwards over a cache that starts with `token_ids` ([N] int64) run with the prior
        on the positions where `projected` ([N] bool) is True. The model's own attention comes back after."""
        if self.terms.shape[1:] != (lm.spec.num_layers, lm.model.config.num_attention_heads):
            raise ValueError(f"an induction prior for {tuple(self.terms.shape[1:])} (layers, query heads) cannot "
                             f"read with {lm.name!r}: {lm.spec.num_layers} layers, "
                             f"{lm.model.config.num_attention_heads} query heads")
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()
        projected = torch.as_tensor(projected, dtype=torch.bool).cpu()
        if token_ids.ndim != 1 or projected.shape != token_ids.shape:
            raise ValueError(f"reading needs token_ids and projected of one shape [N], got "
                             f"{tuple(token_ids.shape)} and {tuple(projected.shape)}")
        if not projected.any() or not bool((self.terms != 0).any()):
            yield
            return
        model = lm.model
        modules = [layer.self_attn for layer in decoder_layers(model)]
        name = prior_attention(model.config._attn_implementation)
        with switched_attention(model, name):  # holds the model's switch lock: one reading per model at a time
            if any(hasattr(module, STATE) for module in modules):
                raise RuntimeError(f"{lm.name!r} is already reading with an induction prior (one block at a time)")
            state = _ReadState(self, token_ids, projected, next(model.parameters()).device)
            handle = model.register_forward_pre_hook(state.before_forward, with_kwargs=True)
            for module in modules:
                setattr(module, STATE, state)
            try:
                yield
            finally:
                handle.remove()
                for module in modules:
                    delattr(module, STATE)
            state.check()  # the block's one host sync: every forward's queries were where the prior can read them


def find_fitted(lm: LoadedModel, folder: Path | None = None) -> Path | None:
    """The fitted prior file in `folder` (default: the shipped `priors/`) for exactly `lm` (config hash), or None."""
    folder = PRIORS if folder is None else Path(folder)
    for path in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("kvbridge_prior", "{}"))
        if meta.get("target", {}).get("config_hash") == lm.spec.identity.config_hash:
            return path
    return None


def bias_tables(ids: torch.Tensor, projected: torch.Tensor, query: torch.Tensor, at: torch.Tensor | None,
                past: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward's tables, on the queries' device, reading no value on the host.
    ids: [N'] (N' >= past) the cache's tokens; projected: [N] bool, which of the first N positions are projected;
    query: [Q] the forward's tokens; at: [Q] their positions (None: past.., they follow the cache); keys 0..past+Q-1
    (the cache's, then the queries' own, which are exact: no term lands on them).
    -> (seen [K] the token of each key, tables [4, Q, K] float32 (TERMS), ok: [] bool, whether every query follows
    the cache or recomputes, at its position, a token the cache holds)."""
    device = query.device
    q, keys = query.numel(), past + query.numel()
    seen = torch.cat((ids[:past].to(device), query))  # [K]
    appended = torch.arange(past, keys, device=device)  # [Q]
    at = appended if at is None else at.to(device)
    inside = at.clamp(0, keys - 1)  # [Q] an index that exists, whatever `at` holds (checked by `ok`)
    ok = ((at == appended) | ((at >= 0) & (at < past) & (seen[inside] == query))).all()
    prev = F.pad(seen[:-1], (1, 0), value=-1)  # [K] token before each key
    prev2 = F.pad(seen[:-2], (2, 0), value=-1)[:keys]  # [K] token two before
    q_prev = torch.where(inside > 0, seen[(inside - 1).clamp(min=0)], -1)  # [Q] the token before each query
    m = min(projected.numel(), past)
    open_ = torch.zeros(keys, dtype=torch.bool, device=device)  # [K] projected keys of the cache
    open_[:m] = projected[:m].to(device)
    match = (prev[None, :] == query[:, None]) & open_[None, :]  # [Q, K]
    match2 = match & (prev2[None, :] == q_prev[:, None])
    duplicate = (seen[None, :] == query[:, None]) & open_[None, :]
    tables = torch.stack((match, match2, open_[None, :].expand(q, keys), duplicate)).float()  # [4, Q, K]
    return seen, tables, ok


def open_mask(attention_mask: torch.Tensor | None, q: int, k: int, device: torch.device,
              window: int | None = None) -> torch.Tensor:
    """[Q, K] float32: 0 where a query may attend to a key, -inf elsewhere. attention_mask: [1, 1, Q, K] bool
    (True: attend) or float (0: attend), as SDPA and eager take it; None (plain causal over keys that end at the
    queries: what SDPA leaves to is_causal and flash-attention always), or flash-attention's [1, K'] padding mask;
    in those two forms a sliding `window` (the layer's `sliding_window`) is applied here."""
    if attention_mask is None or attention_mask.dim() == 2:
        allowed = torch.ones(q, k, dtype=torch.bool, device=device).tril(k - q)
        if window:
            allowed = allowed.triu(k - q - window + 1)  # key position > query position - window
        if attention_mask is not None:
            allowed = allowed & attention_mask[0, -k:].to(device=device, dtype=torch.bool)[None, :]
    elif attention_mask.dtype == torch.bool:
        allowed = attention_mask[0, 0]
    else:
        allowed = attention_mask[0, 0] == 0
    return torch.zeros(q, k, device=device).masked_fill_(~allowed, float("-inf"))


class _ReadState:
    """The tokens in the cache (context, then what each forward appends) and the bias tables of the forward that
    runs, which `_attend` adds at the prior's heads; all on the model's device, so a forward reads no value back."""

    def __init__(self, prior: InductionPrior, token_ids: torch.Tensor, projected: torch.Tensor, device: torch.device):
        self.ids = token_ids.to(device)  # [N'] the cache's tokens so far
        self.projected = projected.to(device)  # [N] which of the first N positions are projected
        self.biased = prior.placed(device)  # layer -> [H_q, 4] terms (TERMS), some != 0, on the model's device
        self.tables: torch.Tensor | None = None  # [4, Q, past + Q] of the forward that runs (TERMS)
        # per forward, what every layer of it shares: the tables as [4, Q*K] over the last K keys (a sliding
        # layer's cache holds fewer), and the [Q, K] 0/-inf form of each attention mask the layers get
        self.shared: dict[tuple, torch.Tensor] = {}
        self.checks: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []  # per forward: (ok, past, positions)

    def before_forward(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            raise ValueError("the induction prior needs input_ids (it reads the query tokens), not inputs_embeds")
        if ids.shape[0] != 1:
            raise ValueError(f"the induction prior reads one sequence at a time, got a batch of {ids.shape[0]}")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        past = int(cache.get_seq_length()) if cache is not None else 0  # a Python int: the cache's shape
        if past > self.ids.numel():
            raise ValueError(f"the cache holds {past} tokens but the induction prior knows {self.ids.numel()}")
        given = kwargs.get("position_ids")
        at = None if given is None else given[0]
        if at is not None and at.shape != ids[0].shape:
            raise ValueError(f"the induction prior needs one position per query token, got {tuple(at.shape)} "
                             f"positions for {ids.shape[1]} tokens")
        self.ids, self.tables, ok = bias_tables(self.ids, self.projected, ids[0].to(self.ids.device), at, past)
        self.checks.append((ok, past, at))  # read once, when the block ends: no host sync per forward
        self.shared = {}
        return None

    def check(self) -> None:
        """ValueError if a forward of the block neither followed the cache nor recomputed tokens it holds."""
        if not self.checks:
            return
        oks = torch.stack([ok for ok, _, _ in self.checks]).cpu()
        if bool(oks.all()):
            return
        _, past, at = self.checks[int((~oks).nonzero()[0, 0])]
        raise ValueError(f"the induction prior reads queries that follow the cache ({past} tokens) or recompute "
                         f"tokens it holds, at their positions; got {at.numel()} tokens at positions "
                         f"{at.tolist()[:8]}...")

    def flat_tables(self, keys: int) -> torch.Tensor:
        """[4, Q * keys] float32: the tables over the last `keys` keys."""
        tables = self.shared.get(("tables", keys))
        if tables is None:
            tables = self.tables[:, :, self.tables.shape[2] - keys:].reshape(len(TERMS), -1)
            self.shared[("tables", keys)] = tables
        return tables

    def closed(self, attention_mask: torch.Tensor | None, q: int, k: int, device: torch.device,
               window: int | None) -> torch.Tensor:
        """`open_mask`, made once per mask a forward passes its layers (the model holds each while the forward
        runs, so its memory names it)."""
        key = ("mask", None if attention_mask is None else (attention_mask.data_ptr(), attention_mask.dtype,
                                                             tuple(attention_mask.stride())), q, k, device, window)
        base = self.shared.get(key)
        if base is None:
            base = self.shared[key] = open_mask(attention_mask, q, k, device, window)
        return base


def _own_attention(inner: str, module: nn.Module):
    """The attention function of implementation `inner` (eager lives in the model's own module)."""
    if inner == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[inner]


def _attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, inner: str = GROUPED_SDPA,
            **kwargs):
    """The attention of a model reading with a prior: at the heads' layers, SDPA with the prior's bias; elsewhere
    the model's own implementation `inner` (flash-attention stays on where there is nothing to add)."""
    # query: [1, H_q, Q, D]; key, value: [1, H_kv, K, D]; attention_mask: [1, 1, Q, K] bool/float, [1, K] or None
    state = getattr(module, STATE, None)
    terms = state.biased.get(module.layer_idx) if state is not None else None
    if terms is None:
        return _own_attention(inner, module)(module, query, key, value, attention_mask, scaling=scaling,
                                             dropout=dropout, **kwargs)
    if kwargs.get("softcap") or kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"the induction prior cannot bias layer {module.layer_idx}: its attention has a softcap, "
                         "sinks or a position bias")
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"the induction prior cannot bias layer {module.layer_idx}: its attention mask is a "
                         f"{type(attention_mask).__name__}, not a tensor")
    q, k = query.shape[2], key.shape[2]
    tables = state.tables  # [4, Q, past + Q]; a sliding-window layer's cache holds only the last k of those keys
    assert tables is not None and tables.shape[1] == q and tables.shape[2] >= k, (
        None if tables is None else tuple(tables.shape), (q, k))
    base = state.closed(attention_mask, q, k, query.device, kwargs.get("sliding_window"))  # [Q, K] 0 / -inf
    # the bias of each head, on top of the mask, in one matmul: [H_q, Q*K] = base + terms^T @ tables
    mask = torch.addmm(base.view(1, q * k), terms, state.flat_tables(k)).view(1, -1, q, k).to(query.dtype)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None  # [1, Q, H_q, D]


def prior_attention(inner: str) -> str:
    """The registered attention a model whose own is `inner` runs while it reads with a prior: `inner` at the
    layers without biased heads, with `inner`'s masks (flash-attention: none); SDPA (`ATTENTION`) for any other
    implementation. A forward with a custom mask (selective recompute) under flash-attention runs `ATTENTION`."""
    if inner in SDPA_NAMES or inner in UNWRAPPED or inner not in ALL_MASK_ATTENTION_FUNCTIONS:
        return ATTENTION
    name = f"{ATTENTION}+{inner}"
    with _lock:
        if name not in ALL_ATTENTION_FUNCTIONS:
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
            ALL_ATTENTION_FUNCTIONS.register(name, functools.partial(_attend, inner=inner))
            if takes_custom_mask(inner):
                accepts_custom_masks(name)
            else:
                custom_mask_fallback(name, ATTENTION)
    return name


ALL_ATTENTION_FUNCTIONS.register(ATTENTION, _attend)  # inner: kvbridge's SDPA
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
accepts_custom_masks(ATTENTION)  # SDPA underneath: selective recompute's mask passes as it is
