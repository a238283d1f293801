"""The attention a model runs while it reads with an induction prior (`induction.InductionPrior.reading`).

Per forward, the bias tables of its query tokens against the cache's (`bias_tables`: which projected keys follow the
query's token); at the layers with a biased head, SDPA with the prior's terms added to those scores; at the others,
the model's own attention (flash-attention stays on there, as it cannot take a per-head bias). A forward reads no value
back to the host: the tables live on the model's device, and whether each forward's queries follow the cache (or
recompute tokens it holds) is checked once, when the block ends (`_ReadState.check`). Registered with transformers as
`ATTENTION` (over SDPA) and, per own implementation of a model, `ATTENTION+<inner>` (`prior_attention`).
"""

from __future__ import annotations

import functools
import sys
import threading

import torch
import torch.nn.functional as F
from kvbridge.transfer.attention import (
    GROUPED_SDPA,
    SDPA_NAMES,
    accepts_custom_masks,
    custom_mask_fallback,
    takes_custom_mask,
)
from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

ATTENTION = "kvbridge_induction_prior"  # the attention implementation a model runs while it reads with a prior
STATE = "_kvbridge_induction_read"  # the attribute of each attention module that holds its model's _ReadState
UNWRAPPED = ("flex_attention",)  # own attentions whose masks the prior cannot read: SDPA everywhere (`ATTENTION`)
TERMS = ("match", "match2", "projected", "duplicate")  # the rows of InductionPrior.terms and of a forward's tables

_lock = threading.Lock()  # registering an attention


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

    def __init__(self, biased: dict[int, torch.Tensor], token_ids: torch.Tensor, projected: torch.Tensor,
                 device: torch.device):
        self.ids = token_ids.to(device)  # [N'] the cache's tokens so far
        self.projected = projected.to(device)  # [N] which of the first N positions are projected
        self.biased = biased  # layer -> [H_q, 4] terms (TERMS), some != 0, on the model's device (`placed`)
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
