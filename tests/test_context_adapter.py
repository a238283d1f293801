"""The context branch (adapter format 4, adapters/context.py) on the tiny pair: the trained maps fold into an adapter
that projects what they computed, tiled or not; it saves, loads and refuses bad shapes by name; it starts as the
per-token map and training moves it."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from kvbridge.adapters import adapter as adapter_module
from kvbridge.adapters.adapter import branch, map_tokens, project
from kvbridge.adapters.context import ContextConfig, ContextMaps
from kvbridge.adapters.io import load_adapter, read_adapter_meta, save_adapter
from kvbridge.adapters.map_kv import project_window
from kvbridge.adapters.pairs import pair_text, start_token_id
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps, adapter_stats
from kvbridge.adapters.teacher import source_features
from kvbridge.adapters.trainer import TrainerConfig, train
from kvbridge.transfer import kvcache
from test_trainer import (  # the trainer tests' tiny pair, teacher cache and ridge fits (fixtures)
    TEACHER,
    _text,
    cache,  # noqa: F401
    either_ridge,  # noqa: F401
    pair,  # noqa: F401
    ridge,  # noqa: F401
    ridge_basis,  # noqa: F401
    ridge_tok,  # noqa: F401
)

CONFIG = ContextConfig(window=3, rank=4)


def _context_maps(fit, config=CONFIG, perturb=True):
    torch.manual_seed(0)
    maps = ContextMaps(fit[0], fit[1], config)
    if perturb:  # a branch that does something (trained weights are not zero)
        with torch.no_grad():
            for name, p in maps.named_parameters():
                p.add_(torch.randn_like(p) * (0.5 if name.startswith("ctx_") else 0.05))
    return maps


def _document(models, seed=5, words=60):
    source, target = models
    paired = pair_text(_text(random.Random(seed), words), source.tokenizer, target.tokenizer)
    seg = kvcache.extract(source.model, source.spec, paired.source_ids)
    return paired, seg


@pytest.mark.parametrize("norm", [True, False], ids=["format4", "format5-no-norm"])
def test_the_branch_folds_into_a_format_4_adapter_that_projects_as_trained_tiled_or_not(pair, either_ridge, tmp_path,  # noqa: F811
                                                                                        norm):
    """Format 5 (no norm) projects through its GEMM form (adapter._linear_branch), trained through the filter."""
    source, target = pair
    maps = _context_maps(either_ridge, dataclasses.replace(CONFIG, norm=norm))
    adapter = maps.to_adapter(either_ridge[0])
    assert adapter.context_norm == norm
    assert adapter.context_halo == 3 and adapter.ctx_lags.tolist() == [1, 2, 3]
    paired, seg = _document(pair)
    xk, xv = source_features(source, paired.source_ids, paired.alignment.source_index)
    start = (paired.alignment.source_index < 0) & (paired.target_ids == start_token_id(target.tokenizer))
    # the trained module with autograd (the filter as training runs it), the projection without (its own forms)
    k, v = (t.detach() for t in project_window(maps, either_ridge[0].start_kv, xk, xv, start, target,
                                                paired.target_ids))
    whole = project(adapter, seg, paired.alignment, paired.target_ids, source.rope, target.rope, dtype=torch.float32)
    torch.testing.assert_close(whole.keys, k, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(whole.values, v, atol=1e-4, rtol=1e-4)
    plain = project(either_ridge[0], seg, paired.alignment, paired.target_ids, source.rope, target.rope,
                    dtype=torch.float32)
    assert (whole.values - plain.values).abs().max() > 1e-2  # the branch adds something
    for tile in (1, 2, 5):  # each tile reads the 3 tokens before it: the same cache
        tiled = project(adapter, seg, paired.alignment, paired.target_ids, source.rope, target.rope,
                        dtype=torch.float32, tile=tile)
        torch.testing.assert_close(tiled.kv, whole.kv, atol=1e-5, rtol=1e-5)
    path = save_adapter(adapter, tmp_path / "ctx.safetensors")
    assert read_adapter_meta(path)["format_version"] == (4 if norm else 5)
    # a file whose metadata names a format before the branch's (2, 3) is refused: its format says how the branch is
    # read (format 4 with the norm, 5 without), and it was read as format 4 whatever it held
    from safetensors.torch import load_file, save_file

    tensors, record = load_file(str(path)), read_adapter_meta(path)
    for version in (2, 3):
        older = tmp_path / f"claims-{version}.safetensors"
        save_file(tensors, str(older), metadata={"kvbridge_adapter": json.dumps(record | {"format_version": version})})
        with pytest.raises(ValueError, match=rf"claims-{version}\.safetensors: adapter format version {version} holds"):
            load_adapter(older)
    again = load_adapter(path)
    assert again.context_norm == norm
    assert torch.equal(project(again, seg, paired.alignment, paired.target_ids, source.rope, target.rope,
                               dtype=torch.float32).kv, whole.kv)
    lags = again.ctx_lags.numel()  # format 4: the filter, then A and B; format 5: A once per lag, then B
    assert again.extra_flops_per_token() - either_ridge[0].extra_flops_per_token() == 2 * (
        again.ctx_b.numel() + (again.ctx_g.numel() + again.ctx_a.numel() if norm else lags * again.ctx_a.numel()))
    half = again.with_maps_dtype(torch.bfloat16)  # the shipped dtype: the lags stay integers
    assert half.ctx_a.dtype == torch.bfloat16 and half.ctx_lags.dtype == torch.int64
    got = project(half, seg, paired.alignment, paired.target_ids, source.rope, target.rope, dtype=torch.float32)
    assert float((got.kv - whole.kv).abs().max()) < 0.05 * float(whole.kv.abs().max())


def test_the_branch_reads_only_the_tokens_before():
    """Changing a token's inputs changes the branch's output at the tokens whose lags reach it, never before it, nor
    (first_lag 1) at itself."""
    gen = torch.Generator().manual_seed(0)
    lt, t, d, r, dt = 2, 9, 6, 3, 4
    args = (torch.tensor([1, 2]), torch.randn(lt, d, generator=gen), torch.randn(lt, 2, d, generator=gen),
            torch.randn(lt, d, r, generator=gen), torch.randn(lt, r, dt, generator=gen))
    x = torch.randn(lt, t, d, generator=gen)
    y = branch(x, *args)
    x2 = x.clone()
    x2[:, 4] += 1.0
    changed = (branch(x2, *args) - y).abs().amax(dim=(0, 2)) > 1e-6
    assert changed.tolist() == [False] * 5 + [True, True, False, False]
    torch.testing.assert_close(branch(x, *args, halo=4), y[:, 4:])  # a halo only reads: the same outputs


@pytest.mark.parametrize("layers_at_once", [1, 2, 5])
def test_the_inference_branch_on_pieces_is_the_trained_branch(monkeypatch, layers_at_once):
    """The projection's branch (no autograd: the inputs as pieces, one broadcast over layers, a few layers at a
    time, the norm after the GEMM) computes what training's does, at every halo and length, the document's start
    (lags reaching before it) and lags in any order."""
    gen = torch.Generator().manual_seed(1)
    lt, r, dt = 5, 3, 4
    widths = (3, 2, 4)
    d = sum(widths)
    lags = torch.tensor([2, 1, 4])
    params = (torch.randn(lt, d, generator=gen), torch.randn(lt, 3, d, generator=gen),
              torch.randn(lt, d, r, generator=gen), torch.randn(lt, r, dt, generator=gen))
    monkeypatch.setattr(adapter_module, "BRANCH_TILE", layers_at_once)  # n >= 1 tokens: 1 .. 5 layers at a time
    for halo in (0, 1, 3, 4, 6):
        for n in (1, 2, 7):
            x = torch.randn(lt, halo + n, d, generator=gen)
            x[..., 3:5] = torch.randn(halo + n, 2, generator=gen)  # the same for every layer (as token features)
            trained = branch(x.clone().requires_grad_(), lags, *[p.clone().requires_grad_() for p in params],
                             halo=halo)
            pieces = [x[..., :3], x[0, :, 3:5].expand(lt, -1, -1), x[..., 5:]]
            got = adapter_module._branch_inference(pieces, lags, *params, halo)
            torch.testing.assert_close(got, trained.detach(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="reads 9 features, its inputs have 7"):
        adapter_module._branch_inference([x[..., :7]], lags, *params, 0)


def test_a_new_branch_is_the_per_token_map_and_training_moves_it(pair, cache, ridge, tmp_path):  # noqa: F811
    _, target = pair
    maps = _context_maps(ridge, perturb=False)
    torch.manual_seed(0)
    plain = ResidualMaps(ridge[0], ridge[1], CapacityConfig())
    x = torch.randn(ridge[0].meta.source["num_layers"], 7, ridge[0].wk.shape[1])
    for got, want in zip(maps(x, x), plain(x, x)):
        torch.testing.assert_close(got, want)
    cfg = TrainerConfig(objective="kl", max_iters=3, warmup_iters=1, batch_windows=2, eval_interval=3, lr=1e-2,
                        min_lr=1e-3)
    train(maps, ridge[0].start_kv, target, cache, list(range(12)), None, cfg, TEACHER.context_tokens,
          tmp_path / "kl", progress=False)
    assert float(maps.ctx_b.detach().abs().max()) > 0 and bool(maps.ctx_g.detach()[:, 1:].abs().max() > 0)


@pytest.mark.parametrize("norm", [True, False], ids=["format4", "format5-no-norm"])
def test_a_trained_branch_unfolds_into_maps_that_go_on_from_it(pair, cache, ridge_tok, norm):  # noqa: F811
    """train-adapter --init of a context adapter: new maps over the adapter, whitened with statistics of other
    windows (another mean, scale and target scale than the branch was trained with), and the branch unfolded into
    them compute what the adapter's maps computed and fold back into the same tensors."""
    _, target = pair
    maps = _context_maps(ridge_tok, dataclasses.replace(CONFIG, norm=norm))
    adapter = maps.to_adapter(ridge_tok[0])
    stats = adapter_stats(adapter, cache, list(range(4, 10)), target, progress=False)
    again = ContextMaps(adapter, stats, ContextConfig.of(adapter))
    assert not torch.allclose(again.std_k, maps.std_k) and not torch.allclose(again.ctx_mu, maps.ctx_mu)
    again.unfold(adapter)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(adapter.meta.source["num_layers"], 9, adapter.wk.shape[1], generator=gen)
    ids = torch.randint(0, adapter.tok_table.shape[0], (9,), generator=gen)
    with torch.no_grad():
        for got, want in zip(again(x, x, ids), maps(x, x, ids)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        folded = again.to_adapter(adapter)
    for name in ("ctx_lags", "ctx_mu", "ctx_g", "ctx_a", "ctx_b", "wk", "wv", "bk", "bv"):
        torch.testing.assert_close(getattr(folded, name), getattr(adapter, name), atol=1e-5, rtol=1e-4)
    assert folded.meta.format_version == adapter.meta.format_version == (4 if norm else 5)
    with pytest.raises(ValueError, match="the adapter's context branch is"):
        ContextMaps(adapter, stats, dataclasses.replace(CONFIG, window=2, norm=norm)).unfold(adapter)


def test_bad_context_branches_are_refused_by_name(ridge):  # noqa: F811
    adapter = _context_maps(ridge).to_adapter(ridge[0])
    with pytest.raises(ValueError, match="ctx_g has shape"):
        dataclasses.replace(adapter, ctx_g=adapter.ctx_g[:, 1:])
    with pytest.raises(ValueError, match="needs ctx_lags"):
        dataclasses.replace(adapter, ctx_b=None)
    with pytest.raises(ValueError, match="int64 lags"):
        dataclasses.replace(adapter, ctx_lags=torch.tensor([1, -2, 3]))
    with pytest.raises(ValueError, match="no context branch"):
        x = torch.randn(ridge[0].meta.source["num_layers"], 5, ridge[0].wk.shape[1])
        map_tokens(ridge[0], x, x, halo=2)
    for bad in (dict(window=0), dict(rank=0), dict(first_lag=2)):
        with pytest.raises(ValueError, match="window|first_lag"):
            ContextConfig(**bad)
    assert json.loads(json.dumps(dataclasses.asdict(CONFIG))) == dataclasses.asdict(CONFIG)
