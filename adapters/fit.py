"""Fitting adapters in closed form: stream aligned KV pairs, accumulate XᵀX and XᵀY in float64, solve ridge.

For target layer j with source layers N(j) = (s_1..s_k), the augmented input is x = [x_{s_1}, ..., x_{s_k}, 1]
(k·d_s + 1), or [x_{s_1}, ..., x_{s_k}, f, 1] with the target's token features f (d_tok) when the adapter has
them (they pass the mix unchanged). Train and held-out statistics are kept apart: `RidgeStats` holds, per
distinct N, the Gram G = Σ xxᵀ; per target layer, C = Σ x yᵀ and Σ‖y‖². A convex mix α of the k layers with a
map W (and bias) is a ridge problem in the mixed input whose Gram and cross terms follow from G and C (MᵀGM,
MᵀC with M = α ⊗ I plus the bias), so every (α, λ) candidate is solved and scored on held-out statistics
without touching data again. Held-out SSE of W: Σ‖y‖² − 2 tr(WᵀC_h) + tr(WᵀG_hW).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEFAULT_LAMBDAS = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1, 1.0)  # × mean centred input power


class RidgeStats:
    """Float64 sufficient statistics for the K and V maps of every target layer under one layer map.

    groups: for each target layer j, the tuple of source layers N(j) (all of one length k).
    d_tok: width of the token features appended to every layer's input (0: none).
    """

    def __init__(self, groups: list[tuple[int, ...]], d_s: int, d_t: int, device: torch.device | str = "cpu",
                 d_tok: int = 0):
        if not groups or len({len(g) for g in groups}) != 1:
            raise ValueError("every target layer needs the same number k >= 1 of source layers")
        self.groups = [tuple(g) for g in groups]
        self.unique = sorted(set(self.groups))
        self.k = len(self.groups[0])
        self.d_s, self.d_t, self.d_tok = d_s, d_t, d_tok
        n_in = self.k * d_s + d_tok + 1
        f64 = dict(dtype=torch.float64, device=device)
        self.gram = {m: torch.zeros(len(self.unique), n_in, n_in, **f64) for m in "kv"}  # [G, n_in, n_in]
        self.cross = {m: torch.zeros(len(self.groups), n_in, d_t, **f64) for m in "kv"}  # [L_t, n_in, d_t]
        self.yy = {m: torch.zeros(len(self.groups), **f64) for m in "kv"}  # [L_t]
        self.count = 0
        self._gidx = torch.tensor([self.unique.index(g) for g in self.groups])
        self._unique_layers = torch.tensor(self.unique)  # [G, k]

    def _augment(self, x: torch.Tensor, tok: torch.Tensor | None) -> torch.Tensor:
        # x: [L_s, n, d_s], tok: [n, d_tok] or None -> [G, n, k*d_s + d_tok + 1] in float64
        sel = x.to(torch.float64)[self._unique_layers.to(x.device)]  # [G, k, n, d_s]
        g, k, n, d = sel.shape
        parts = [sel.permute(0, 2, 1, 3).reshape(g, n, k * d)]
        if self.d_tok:
            parts.append(tok.to(device=x.device, dtype=torch.float64)[None].expand(g, n, self.d_tok))
        parts.append(torch.ones(g, n, 1, dtype=torch.float64, device=x.device))
        return torch.cat(parts, dim=2)

    def add(self, xk: torch.Tensor, xv: torch.Tensor, yk: torch.Tensor, yv: torch.Tensor,
            tok: torch.Tensor | None = None) -> None:
        """xk, xv: [L_s, n, d_s]; yk, yv: [L_t, n, d_t] (one window's aligned pairs); tok: [n, d_tok] when the
        statistics have token features."""
        if (tok is None) != (self.d_tok == 0) or (tok is not None and tuple(tok.shape) != (xk.shape[1], self.d_tok)):
            raise ValueError(f"these statistics take token features of width {self.d_tok}, got "
                             f"{None if tok is None else tuple(tok.shape)}")
        device = self.gram["k"].device
        for m, x, y in (("k", xk, yk), ("v", xv, yv)):
            xa = self._augment(x.to(device), tok)  # [G, n, n_in]
            self.gram[m] += xa.transpose(1, 2) @ xa
            y64 = y.to(device=device, dtype=torch.float64)  # [L_t, n, d_t]
            self.cross[m] += xa[self._gidx.to(device)].transpose(1, 2) @ y64
            self.yy[m] += (y64 * y64).sum(dim=(1, 2))
        self.count += xk.shape[1]

    def sums(self) -> list[torch.Tensor]:
        """The tensors that are sums over tokens (with `count`): what adding two runs' statistics adds."""
        return [getattr(self, name)[m] for name in ("gram", "cross", "yy") for m in "kv"]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"count": torch.tensor(self.count), "groups": torch.tensor(self.groups),
               "dims": torch.tensor([self.d_s, self.d_t, self.d_tok])}
        for m in "kv":
            out[f"gram_{m}"] = self.gram[m].cpu()
            out[f"cross_{m}"] = self.cross[m].cpu()
            out[f"yy_{m}"] = self.yy[m].cpu()
        return out

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> "RidgeStats":
        d_s, d_t, *rest = state["dims"].tolist()  # statistics saved before token features: [d_s, d_t]
        stats = cls([tuple(g) for g in state["groups"].tolist()], d_s, d_t, device, d_tok=rest[0] if rest else 0)
        for m in "kv":
            for name in ("gram", "cross", "yy"):
                want = getattr(stats, name)[m]
                got = state[f"{name}_{m}"]
                if got.shape != want.shape:
                    raise ValueError(f"saved statistics {name}_{m} have shape {tuple(got.shape)}, expected "
                                     f"{tuple(want.shape)}")
                want.copy_(got)
        stats.count = int(state["count"])
        return stats


def simplex_grid(k: int, step: float) -> list[tuple[float, ...]]:
    """Convex weights over k items on a grid of `step` (k = 1: just (1,))."""
    if k == 1:
        return [(1.0,)]
    n = round(1 / step)
    return [tuple(c / n for c in combo) for combo in _compositions(k, n)]


def _compositions(k: int, n: int):
    """The k-tuples of non-negative integers summing to n, in lexicographic order (itertools.product's, filtered):
    C(n + k - 1, k - 1) of them, made without walking the (n + 1)^k others."""
    if k == 1:
        yield (n,)
        return
    for first in range(n + 1):
        for rest in _compositions(k - 1, n - first):
            yield (first, *rest)


def mixing_matrix(alpha: torch.Tensor, d_s: int, d_tok: int = 0) -> torch.Tensor:
    # alpha: [k] -> M: [k*d_s + d_tok + 1, d_s + d_tok + 1] with x_mix_aug = x_aug @ M (token features and the bias
    # input pass through)
    k = alpha.numel()
    eye = torch.eye(d_s, dtype=torch.float64)
    m = torch.zeros(k * d_s + d_tok + 1, d_s + d_tok + 1, dtype=torch.float64)
    for i in range(k):
        m[i * d_s:(i + 1) * d_s, :d_s] = alpha[i] * eye
    m[k * d_s:, d_s:] = torch.eye(d_tok + 1, dtype=torch.float64)
    return m


@dataclass(frozen=True)
class LayerFit:
    w: torch.Tensor  # [d_s + d_tok, d_t] float64 (the token features' rows last)
    b: torch.Tensor  # [d_t] float64
    alpha: tuple[float, ...]
    lam: float  # the chosen λ (relative)
    heldout_r2: float  # 1 - SSE/SST on the statistics λ and α were chosen on: biased up, not a held-out report
    heldout_sse: float


def _sse(w_aug: torch.Tensor, gram: torch.Tensor, cross: torch.Tensor, yy: torch.Tensor) -> torch.Tensor:
    # w_aug: [..., n_in, d_t]; gram: [n_in, n_in]; cross: [n_in, d_t]; yy: scalar -> [...]
    return yy - 2 * (w_aug * cross).sum(dim=(-2, -1)) + (w_aug * (gram @ w_aug)).sum(dim=(-2, -1))


def solve_layer(train: RidgeStats, heldout: RidgeStats, map_name: str, layer: int,
                lambdas=DEFAULT_LAMBDAS, mix_step: float = 0.25) -> LayerFit:
    """Best (α, λ) for one target layer's K or V map, chosen on held-out SSE."""
    g = train.unique.index(train.groups[layer])
    gram, cross = train.gram[map_name][g].cpu(), train.cross[map_name][layer].cpu()
    h_gram, h_cross = heldout.gram[map_name][g].cpu(), heldout.cross[map_name][layer].cpu()
    h_yy = heldout.yy[map_name][layer].cpu()
    n_h = heldout.count
    if train.count == 0 or n_h == 0:
        raise ValueError("fitting needs training and held-out tokens; the corpus gave "
                         f"{train.count} and {n_h}")
    d_s = train.d_s + train.d_tok  # the width of the mixed input
    sum_y = h_cross[-1]
    sst = float(h_yy - (sum_y @ sum_y) / n_h)
    best: LayerFit | None = None
    lams = torch.tensor(lambdas, dtype=torch.float64)
    n = train.count
    for alpha in simplex_grid(train.k, mix_step):
        m = mixing_matrix(torch.tensor(alpha, dtype=torch.float64), train.d_s, train.d_tok)
        gm, cm = m.T @ gram @ m, m.T @ cross  # augmented: the last row/column is the bias input
        hgm, hcm = m.T @ h_gram @ m, m.T @ h_cross
        # Centre, so the bias falls out and the ridge is (Gc + λ·s·I) W = Cc, solved for every λ at once through
        # one eigendecomposition of the centred Gram (symmetric PSD; a singular one gets a pseudo-inverse).
        x_mean, y_mean = gm[:d_s, d_s] / n, cm[d_s] / n
        gc = gm[:d_s, :d_s] - n * torch.outer(x_mean, x_mean)
        cc = cm[:d_s] - n * torch.outer(x_mean, y_mean)
        evals, q = torch.linalg.eigh(gc)
        evals = evals.clamp(min=0)
        scale = float(torch.diagonal(gc).mean()) or 1.0
        denom = evals[None] + lams[:, None] * scale  # [n_lam, d_s]
        inv = torch.where(denom > evals.max() * 1e-12, 1.0 / denom, torch.zeros_like(denom))
        w = q @ (inv[:, :, None] * (q.T @ cc)[None])  # [n_lam, d_s, d_t]
        b = y_mean[None] - x_mean[None, None, :] @ w  # [n_lam, 1, d_t]
        w_aug = torch.cat((w, b), dim=1)  # [n_lam, d_s + 1, d_t]
        sse = _sse(w_aug, hgm, hcm, h_yy)
        i = int(torch.argmin(sse))
        if best is None or float(sse[i]) < best.heldout_sse:
            best = LayerFit(w=w_aug[i, :d_s], b=w_aug[i, d_s], alpha=alpha, lam=float(lams[i]),
                            heldout_r2=1 - float(sse[i]) / sst if sst > 0 else float("nan"),
                            heldout_sse=float(sse[i]))
    assert best is not None
    return best



def _fixed_signs(vectors: torch.Tensor) -> torch.Tensor:
    """Columns of singular / eigen vectors have an arbitrary sign: make each column's largest-magnitude entry
    positive, so a refit gives the same basis."""
    return vectors * torch.sign(vectors.gather(0, vectors.abs().argmax(0, keepdim=True)))


def normalised_embeddings(embedding: torch.Tensor) -> torch.Tensor:
    """[V, d_model] input embeddings -> [V, d_model] float64, each row RMS-normalised (as the target's first norm
    sees it, without its gain): what the token features are made of."""
    u = embedding.detach().to(torch.float64)
    return u * (u.pow(2).mean(-1, keepdim=True) + 1e-6).rsqrt()


def token_basis(train: RidgeStats, heldout: RidgeStats, rank: int, lambdas=DEFAULT_LAMBDAS,
                mix_step: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank-`rank` basis of the full token inputs (statistics with d_tok = d_model) chosen for what the maps need
    (reduced-rank regression): fit every layer's K and V map on [source, u], stack their token parts W_u
    [d_model, 2·L_t·d_t], and keep the top directions of Σ^½ W_u (Σ: the token inputs' covariance). Returns
    P [d_model, rank] and the mean [d_model]; the features (u − mean) @ P have identity covariance."""
    d, n = train.d_tok, train.count
    if not 1 <= rank <= d:
        raise ValueError(f"token feature rank must be in [1, {d}], got {rank}")
    ws = [solve_layer(train, heldout, m, j, lambdas, mix_step).w[train.d_s:] for m in "kv"
          for j in range(len(train.groups))]
    gram = train.gram["k"][0].cpu()
    tok = slice(train.k * train.d_s, train.k * train.d_s + d)
    mean = gram[tok, -1] / n
    cov = gram[tok, tok] / n - torch.outer(mean, mean)
    evals, q = torch.linalg.eigh(cov)
    evals = evals.clamp(min=float(evals.max()) * 1e-9)
    half, inv_half = q @ torch.diag(evals.sqrt()) @ q.T, q @ torch.diag(evals.rsqrt()) @ q.T
    left, _, _ = torch.linalg.svd(half @ torch.cat(ws, dim=1), full_matrices=False)
    return inv_half @ _fixed_signs(left[:, :rank]), mean


def with_token_basis(stats: RidgeStats, basis: torch.Tensor, mean: torch.Tensor) -> RidgeStats:
    """The statistics of [source, (u − mean) @ basis] from those of [source, u]: exact, no data read again."""
    kd, d = stats.k * stats.d_s, stats.d_tok
    r = basis.shape[1]
    m = torch.zeros(kd + d + 1, kd + r + 1, dtype=torch.float64)
    m[:kd, :kd] = torch.eye(kd, dtype=torch.float64)
    m[kd:kd + d, kd:kd + r] = basis.to(torch.float64)
    m[-1, kd:kd + r] = -mean.to(torch.float64) @ basis.to(torch.float64)
    m[-1, -1] = 1.0
    out = RidgeStats(stats.groups, stats.d_s, stats.d_t, d_tok=r)
    for name in "kv":
        out.gram[name] = m.T @ stats.gram[name].cpu() @ m
        out.cross[name] = m.T @ stats.cross[name].cpu()
        out.yy[name] = stats.yy[name].cpu().clone()
    out.count = stats.count
    return out


class JointStats:
    """Float64 statistics of [every source layer's K and V, token inputs, 1] against every target layer's K and V:
    what a source basis is fitted from (`source_basis`). The `RidgeStats` of the maps that read the basis follow
    from them exactly (`ridge_stats`), so the corpus is read once.

    Memory: (F² + F·2·L_t·d_t) float64 with F = 2·L_s·d_s + d_tok + 1 (the small pair: 9,793 inputs, 1.7 GB);
    refused above `max_bytes`, where per-layer mixes are the way (a production pair's F is ~30,000).
    """

    def __init__(self, source_layers: int, d_s: int, target_layers: int, d_t: int, d_tok: int = 0,
                 max_bytes: int = 8 << 30):
        self.ls, self.d_s, self.lt, self.d_t, self.d_tok = source_layers, d_s, target_layers, d_t, d_tok
        self.n_src = 2 * source_layers * d_s
        f, out = self.n_src + d_tok + 1, 2 * target_layers * d_t
        need = 8 * (f * f + f * out)
        if need > max_bytes:
            raise ValueError(f"a source basis over {self.n_src} source features (K and V of {source_layers} layers "
                             f"of width {d_s}) needs {need / 2**30:.1f} GiB of statistics, over the "
                             f"{max_bytes / 2**30:.1f} GiB allowed: use per-layer mixes (source rank 0) for this pair")
        self.gram = torch.zeros(f, f, dtype=torch.float64)
        self.cross = torch.zeros(f, out, dtype=torch.float64)  # outputs: K of every layer, then V of every layer
        self.yy = torch.zeros(out, dtype=torch.float64)
        self.count = 0
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # windows not yet in the sums
        self._shift: tuple[torch.Tensor, torch.Tensor] | None = None  # (c [F], d [2·L_t·d_t]): flush

    def add(self, xk: torch.Tensor, xv: torch.Tensor, yk: torch.Tensor, yv: torch.Tensor,
            tok: torch.Tensor | None = None) -> None:
        """As `RidgeStats.add`: xk, xv [L_s, n, d_s]; yk, yv [L_t, n, d_t]; tok [n, d_tok]. Windows are summed
        in blocks of about 2,048 tokens: the products of a block in float32 (float64 inputs: float64), the sums
        in float64 (a ~10,000-wide Gram added in float64 per window took longer than its product). The block's
        products are of inputs and outputs less a shift (`flush`), so float32 rounds at the scale of their spread,
        not of their mean."""
        if (tok is None) != (self.d_tok == 0):
            raise ValueError(f"these statistics take token features of width {self.d_tok}")
        n = xk.shape[1]
        parts = [xk.transpose(0, 1).reshape(n, -1), xv.transpose(0, 1).reshape(n, -1)]
        if tok is not None:
            parts.append(tok)
        parts.append(torch.ones(n, 1, dtype=xk.dtype))
        work = torch.float64 if xk.dtype == torch.float64 else torch.float32
        x = torch.cat([p.to(work) for p in parts], dim=1)
        y = torch.cat((yk.transpose(0, 1).reshape(n, -1), yv.transpose(0, 1).reshape(n, -1)), dim=1).to(work)
        self._pending.append((x, y))
        self.count += n
        if sum(p[0].shape[0] for p in self._pending) >= 2048:
            self.flush()

    def sums(self) -> list[torch.Tensor]:
        """The tensors that are sums over tokens (with `count`), pending windows folded in."""
        self.flush()
        return [self.gram, self.cross, self.yy]

    def flush(self) -> None:
        """Fold the pending windows into the float64 sums (done by everything that reads them).

        A block's products are taken of x_s = x − c and y_s = y − d, with c and d the first block's means (c's last
        entry, the constant input's, 0): a float32 product of the raw inputs rounds at the scale of their mean
        squared, and the covariance `source_basis` takes from the sums (E[xxᵀ] − E[x]E[x]ᵀ) lost every digit where
        the mean is ~1,000 times the spread. The shift folds back exactly, in float64: with x = x_s M (M = I + e cᵀ,
        e the constant input), Σxᵀx = Mᵀ(Σx_sᵀx_s)M and Σxᵀy = Mᵀ(Σx_sᵀy_s + (Σx_s) dᵀ)."""
        if not self._pending:
            return
        x = torch.cat([p[0] for p in self._pending])  # [n, F]
        y = torch.cat([p[1] for p in self._pending])  # [n, 2·L_t·d_t]
        self._pending.clear()
        if self._shift is None:
            c = x.double().mean(0)
            c[-1] = 0.0
            self._shift = (c, y.double().mean(0))
        c, d = self._shift
        yy = (y.double() ** 2).sum(0)
        x = (x.double() - c).to(x.dtype)
        y = (y.double() - d).to(y.dtype)
        gram = (x.T @ x).double()  # Σ x_s x_sᵀ
        cross = (x.T @ y).double() + torch.outer(gram[:, -1], d)  # Σ x_s yᵀ
        gram += torch.outer(gram[:, -1], c)  # (Σ x_s x_sᵀ) M
        gram += torch.outer(c, gram[-1])  # Mᵀ (...)
        cross += torch.outer(c, cross[-1])
        self.gram += gram
        self.cross += cross
        self.yy += yy

    def ridge_stats(self, basis: torch.Tensor) -> RidgeStats:
        """The statistics of the maps' inputs [x_src @ basis, tok, 1] (one group: every layer reads the same)."""
        self.flush()
        r, f = basis.shape[1], self.gram.shape[0]
        m = torch.zeros(f, r + self.d_tok + 1, dtype=torch.float64)
        m[:self.n_src, :r] = basis.to(torch.float64)
        m[self.n_src:, r:] = torch.eye(self.d_tok + 1, dtype=torch.float64)
        out = RidgeStats([(0,)] * self.lt, r, self.d_t, d_tok=self.d_tok)
        gram = m.T @ self.gram @ m
        cross = (m.T @ self.cross).view(-1, 2, self.lt, self.d_t)  # [n_in, map, L_t, d_t]
        for i, name in enumerate("kv"):
            out.gram[name] = gram[None].clone()
            out.cross[name] = cross[:, i].permute(1, 0, 2).contiguous()
            out.yy[name] = self.yy.view(2, self.lt, self.d_t)[i].sum(-1)
        out.count = self.count
        return out


def source_basis(stats: JointStats, rank: int, lam: float = 1e-2) -> torch.Tensor:
    """A rank-`rank` basis [2·L_s·d_s, rank] of all source layers' K and V for what the target's K and V need
    (reduced-rank regression): the joint ridge map of the standardised inputs [source, token inputs] to every
    layer's K and V (λ relative to the token count), its source rows W_s, and the top eigenvectors of the fitted
    values' covariance W_sᵀ Σ_s W_s, every layer's K and V in units of its own standard deviation. The basis is
    returned in the source's own units, scaled so each feature has unit variance over the training tokens.
    Constant (zero-variance) source inputs get no weight."""
    stats.flush()
    n, ns = stats.count, stats.n_src
    if not 1 <= rank <= ns:
        raise ValueError(f"source rank must be in [1, {ns}], got {rank}")
    if n == 0:
        raise ValueError("a source basis needs training tokens; the statistics have none")
    f = stats.gram.shape[0] - 1
    mean = stats.gram[-1, :f] / n
    cov = stats.gram[:f, :f] / n - torch.outer(mean, mean)
    cross = stats.cross[:f] / n - torch.outer(mean, stats.cross[-1] / n)
    var = cov.diagonal().clone()
    live = var > var.max() * 1e-12
    scale = torch.where(live, var.clamp(min=1e-300).rsqrt(), torch.zeros_like(var))
    cs = cov * scale[:, None] * scale[None]
    cs.diagonal().add_(lam + (~live).double())  # a dead input's row and column are zero: keep the system regular
    w = torch.linalg.solve(cs, cross * scale[:, None])  # [F, outputs], standardised inputs
    # every target layer's K and V map counts alike (the fit is judged by their mean R²): outputs in units of their
    # map's standard deviation, so the basis does not follow the layers and the kind (K) of the largest values
    var_y = stats.yy / n - (stats.cross[-1] / n) ** 2
    block = var_y.view(2 * stats.lt, stats.d_t).mean(-1, keepdim=True).clamp(min=1e-30)
    ws = w[:ns] * block.expand(-1, stats.d_t).reshape(-1).rsqrt()[None]
    sigma = cs[:ns, :ns] - torch.diag(lam + (~live[:ns]).double())

    def fitted(v: torch.Tensor) -> torch.Tensor:  # the fitted values' covariance W_sᵀ Σ_s W_s times v, never formed
        return ws.T @ (sigma @ (ws @ v))

    # its top eigenvectors by subspace iteration (seeded): a dense eigendecomposition of the [outputs, outputs]
    # matrix takes minutes, the top `rank` of it seconds
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(fitted(torch.randn(ws.shape[1], rank + 32, generator=gen, dtype=torch.float64)))
    for _ in range(8):
        q, _ = torch.linalg.qr(fitted(q))
    _, small = torch.linalg.eigh(q.T @ fitted(q))
    basis = ws @ (q @ small[:, -rank:].flip(1))  # the strongest direction first
    basis = basis * scale[:ns, None]  # back to the source's units
    sd = (basis * (cov[:ns, :ns] @ basis)).sum(0).clamp(min=1e-30).sqrt()
    basis = basis / sd
    return _fixed_signs(basis)
