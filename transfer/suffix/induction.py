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
Batch size 1. How a model attends within the block (SDPA with the prior's bias at the layers with a biased head,
its own attention elsewhere; no value read back to the host until the block ends, which raises a ValueError if a
forward's queries neither followed the cache nor recomputed tokens it holds): `induction_attention`.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvbridge.transfer.attention import eager_attention, switched_attention
from kvbridge.transfer.kvcache import decoder_layers
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.suffix.induction_attention import (
    STATE,
    TERMS,
    _ReadState,
    bias_tables,
    open_mask,
    prior_attention,
)
from kvbridge.transfer.tensor_files import json_field, read_metadata, read_tensors, save_tensors

__all__ = ["InductionPrior", "induction_scores", "find_fitted",
           "TERMS", "bias_tables", "open_mask"]  # these three: induction_attention's, imported from here too

PROBE_TOKENS = 64  # length of the random sequence the probe repeats
PROBE_SEQUENCES = 4
PRIORS = Path(__file__).resolve().parent / "priors"  # the fitted priors that ship with kvbridge

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


@dataclass(frozen=True)
class InductionPrior:
    """Per query head, what is added to the attention score of a *projected* key j (TERMS, rows of `terms`):
    match: the token at j - 1 is the query's token; match2: on top, the token at j - 2 is the query's previous token;
    projected: every projected key (how much the head trusts projected keys against exact ones); duplicate: the
    token at j is the query's own token."""

    terms: torch.Tensor  # [4, L, H_q] float32 (TERMS); a head whose four are 0 reads as the model does
    origin: str = "given"  # what made it: "probe ...", or the fitted file it came from
    # a fitted prior's adapter, as its file records it ({"name", "digest": Adapter.digest}): the terms were fitted on
    # that adapter's projections and are checked against the adapter a cache comes from (`stale_for`); None: made
    # from the target alone (a probe), no adapter to check
    adapter: dict | None = field(default=None, compare=False)
    # a fit's reading: every layer attends through the prior, so a head whose four terms are 0 gets a gradient too
    # (otherwise only the layers with a biased head do; the result is the same, the cost is not)
    every_layer: bool = False
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
        save_tensors(path, {"terms": self.terms.float().contiguous()},
                     metadata={"kvbridge_prior": json.dumps(meta, sort_keys=True)})

    @classmethod
    def load(cls, path: str | Path) -> InductionPrior:
        return cls._read(path)[0]

    @classmethod
    def load_for(cls, path: str | Path, lm: LoadedModel) -> InductionPrior:
        """A fitted prior file (`kvbridge prior fit --out`) for `lm`: ValueError when it was fitted for another
        model (its recorded config hash)."""
        prior, meta = cls._read(path)
        target = meta.get("target") or {}
        if target.get("config_hash") != lm.spec.identity.config_hash:
            raise ValueError(f"the induction prior {Path(path).name} was fitted for {target.get('name', '?')}, not "
                             f"for {lm.name}")
        return prior

    @classmethod
    def _read(cls, path: str | Path) -> tuple[InductionPrior, dict]:
        """(the prior, its file's kvbridge_prior metadata)."""
        path = Path(path)
        tensors, header = read_tensors(path)
        if "kvbridge_prior" not in header or "terms" not in tensors:
            raise ValueError(f"{path} is not an induction prior file (no kvbridge_prior metadata or terms)")
        meta = json_field(path, header, "kvbridge_prior")
        adapter = meta.get("adapter")  # before adapter digests were recorded: the adapter's file stem alone
        adapter = adapter if isinstance(adapter, dict) else {"name": str(adapter)} if adapter else None
        terms = tensors["terms"]
        if terms.is_floating_point() and not bool(torch.isfinite(terms).all()):
            raise ValueError(f"{path}: its terms hold non-finite values (NaN or infinity)")
        try:
            return cls(terms.float(), origin=path.name, adapter=adapter), meta
        except ValueError as exc:  # a shape or kind that is not a prior's: named with the file
            raise ValueError(f"{path}: {exc}") from None

    def stale_for(self, digest: str) -> str | None:
        """Why this prior was not fitted for the adapter of content `digest` (Adapter.digest), else None: a fitted
        prior learns how far to trust one adapter's projected keys, and read over another adapter's it still helps,
        less than its own would (docs/context-map.md). A probed prior reads the target alone: never stale."""
        if self.adapter is None:
            return None
        name, fitted = self.adapter.get("name", "?"), self.adapter.get("digest")
        refit = "`kvbridge prior fit --adapter FILE` fits one for it"
        if not fitted:
            return f"the induction prior {self.origin} records no adapter digest (fitted for {name}): {refit}"
        if fitted != digest:
            return (f"the induction prior {self.origin} was fitted for adapter {name} ({fitted[:16]}), not for this "
                    f"one ({digest[:16]}): {refit}")
        return None

    def from_layer(self, first: int) -> InductionPrior:
        """The prior on layers `first`.. only: where a pass made the first layers' KV the target's own."""
        if first <= 0:
            return self
        terms = self.terms.clone()
        terms[:, :first] = 0
        return InductionPrior(terms, f"{self.origin}, from layer {first}", adapter=self.adapter)

    def placed(self, device: torch.device) -> dict[int, torch.Tensor]:
        """{layer: [H_q, 4] float32 terms (TERMS) on `device`} for the layers with a biased head; made once per
        device (a forward then copies nothing)."""
        device = torch.device(device)
        with _lock:
            placed = self._placed.get(device)
            if placed is None:
                layers = range(self.terms.shape[1]) if self.every_layer else self.heads
                placed = self._placed[device] = {layer: self.terms[:, layer].T.contiguous().to(device)
                                                 for layer in layers}
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
        if not projected.any() or not (self.every_layer or bool((self.terms != 0).any())):
            yield
            return
        model = lm.model
        modules = [layer.self_attn for layer in decoder_layers(model)]
        name = prior_attention(model.config._attn_implementation)
        with switched_attention(model, name):  # holds the model's switch lock: one reading per model at a time
            if any(hasattr(module, STATE) for module in modules):
                raise RuntimeError(f"{lm.name!r} is already reading with an induction prior (one block at a time)")
            device = next(model.parameters()).device
            state = _ReadState(self.placed(device), token_ids, projected, device)
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
        header = read_metadata(path)
        if "kvbridge_prior" not in header:  # not a prior
            continue
        meta = json_field(path, header, "kvbridge_prior")
        if (meta.get("target") or {}).get("config_hash") == lm.spec.identity.config_hash:
            return path
    return None
