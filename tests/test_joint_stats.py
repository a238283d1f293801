"""`fit.JointStats` from float32 windows whose mean is large against their spread (as K channels with an offset
are): the sums, the covariance a source basis reads and the basis itself match those of the same data summed in
float64, the windows folded in several blocks."""

from __future__ import annotations

import torch
from kvbridge.adapters.fit import JointStats, source_basis

L_S, D_S, L_T, D_T, N = 2, 6, 2, 5, 6000


def _data(offset: float):
    """Source K, V [L_S, N, D_S] and target K, V [L_T, N, D_T] in float64: unit-scale spread around `offset`."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(N, 2 * L_S * D_S, generator=gen, dtype=torch.float64)
    x = z @ (torch.randn(2 * L_S * D_S, 2 * L_S * D_S, generator=gen, dtype=torch.float64) * 0.3) + offset
    w = torch.randn(2 * L_S * D_S, 2 * L_T * D_T, generator=gen, dtype=torch.float64)
    y = (x - offset) @ w + 0.1 * torch.randn(N, 2 * L_T * D_T, generator=gen, dtype=torch.float64) - offset

    def halves(t, layers, d):  # [N, 2·L·d] -> K, V: [L, N, d]
        return (t[:, :layers * d].reshape(N, layers, d).transpose(0, 1),
                t[:, layers * d:].reshape(N, layers, d).transpose(0, 1))

    return (*halves(x, L_S, D_S), *halves(y, L_T, D_T))


def _stats(tensors, dtype: torch.dtype) -> JointStats:
    stats = JointStats(L_S, D_S, L_T, D_T)
    for s in range(0, N, 300):  # windows of 300 tokens: several blocks of ~2,048
        stats.add(*(t[:, s:s + 300].to(dtype) for t in tensors))
    stats.flush()
    return stats


def _covariance(stats: JointStats) -> torch.Tensor:
    f = stats.gram.shape[0] - 1
    mean = stats.gram[-1, :f] / stats.count
    return stats.gram[:f, :f] / stats.count - torch.outer(mean, mean)


def test_float32_windows_with_a_large_mean_give_the_float64_covariance_and_basis():
    data = _data(offset=1000.0)
    rounded = [t.float().double() for t in data]  # the same float32 values, summed in float64: the reference
    got, want = _stats(data, torch.float32), _stats(rounded, torch.float64)
    assert got.count == want.count == N
    cov, ref = _covariance(got), _covariance(want)
    assert float((cov - ref).norm() / ref.norm()) < 1e-5  # (float32 products of the raw inputs: 0.2)
    cross_c = got.cross[:-1] / N - torch.outer(got.gram[-1, :-1] / N, got.cross[-1] / N)
    cross_r = want.cross[:-1] / N - torch.outer(want.gram[-1, :-1] / N, want.cross[-1] / N)
    assert float((cross_c - cross_r).norm() / cross_r.norm()) < 1e-5
    torch.testing.assert_close(got.gram[-1], want.gram[-1], rtol=1e-9, atol=0)  # sums of the inputs (and the count)
    torch.testing.assert_close(got.yy, want.yy, rtol=1e-9, atol=0)
    basis, ref_basis = source_basis(got, 4), source_basis(want, 4)
    assert float((basis - ref_basis).norm() / ref_basis.norm()) < 1e-3  # (float32 products: another subspace)


def test_the_ridge_statistics_through_a_basis_match_float64_summing():
    data = _data(offset=300.0)
    got, want = _stats(data, torch.float32), _stats([t.float().double() for t in data], torch.float64)
    basis = source_basis(want, 3)
    a, b = got.ridge_stats(basis), want.ridge_stats(basis)
    for m in "kv":
        # the centred Gram of the maps' inputs: what the ridge solve reads
        n, d = a.count, a.d_s
        ca = a.gram[m][0][:d, :d] / n - torch.outer(a.gram[m][0][:d, d] / n, a.gram[m][0][:d, d] / n)
        cb = b.gram[m][0][:d, :d] / n - torch.outer(b.gram[m][0][:d, d] / n, b.gram[m][0][:d, d] / n)
        assert float((ca - cb).norm() / cb.norm()) < 1e-5, m
