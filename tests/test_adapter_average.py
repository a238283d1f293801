"""`kvbridge adapter average`: the weighted average of adapters fine-tuned from one another (adapters/average.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kvbridge.adapters.adapter import project
from kvbridge.adapters.average import average
from kvbridge.adapters.io import load_adapter, save_adapter
from kvbridge.transfer import kvcache
from test_adapters import check_tokens, identity_alignment, random_adapter


def _tuned(adapter, seed: int):
    """The adapter with its maps moved (as a fine-tune from it would): the fixed parts the same."""
    gen = torch.Generator().manual_seed(seed)
    return dataclasses.replace(adapter, **{n: getattr(adapter, n) + 0.05 * torch.randn(
        getattr(adapter, n).shape, generator=gen) for n in ("wk", "bk", "wv", "bv")})


def test_the_average_projects_the_average_of_the_projections(tiny_source, tiny_target):
    """The maps are linear in their weights and RoPE is linear: the projection by the weighted average of two
    adapters that share their layer mix is the same average of the two projections (float32 rounding apart)."""
    a = random_adapter(tiny_source, tiny_target, k=2, layer_map="mix")
    b = _tuned(a, 1)
    ids = check_tokens(tiny_source, 24)
    seg = kvcache.extract(tiny_source.model, tiny_source.spec, ids)

    def projected(adapter):
        return project(adapter, seg, identity_alignment(24), ids, tiny_source.rope, tiny_target.rope).kv.double()

    mean = average([a, b], [3.0, 1.0])  # normalised: 0.75, 0.25
    torch.testing.assert_close(projected(mean), 0.75 * projected(a) + 0.25 * projected(b), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(projected(mean), projected(a), atol=1e-3)  # it moved
    torch.testing.assert_close(mean.wk, 0.75 * a.wk + 0.25 * b.wk)
    assert torch.equal(mean.layer_map, a.layer_map) and torch.equal(mean.start_kv, a.start_kv)
    same = average([a, a, a])
    assert all(torch.allclose(getattr(same, n), getattr(a, n)) for n in ("wk", "bk", "wv", "bv", "mix_k"))
    record = mean.meta.training["average"]
    assert [r["weight"] for r in record] == [0.75, 0.25] and [r["digest"] for r in record] == [a.digest, b.digest]


def test_adapters_that_do_not_average_are_refused_by_name(tiny_source, tiny_target, adapter):
    a = random_adapter(tiny_source, tiny_target, k=2, layer_map="mix")
    with pytest.raises(ValueError, match="two adapters or more"):
        average([a])
    with pytest.raises(ValueError, match="2 weights for 3 adapters"):
        average([a, a, a], [1.0, 1.0])
    with pytest.raises(ValueError, match="weights must be finite"):
        average([a, a], [1.0, -1.0])
    other_map = dataclasses.replace(_tuned(a, 2), layer_map=a.layer_map.flip(1))
    with pytest.raises(ValueError, match="tuned.safetensors's layer_map differs"):
        average([a, other_map], names=["a.safetensors", "tuned.safetensors"])
    target = dict(a.meta.target, name="another-target")
    other_pair = dataclasses.replace(a, meta=dataclasses.replace(a.meta, target=target))
    with pytest.raises(ValueError, match="maps target another-target"):
        average([a, other_pair])
    with pytest.raises(ValueError, match="layer_map has shape"):  # one source layer per target layer, not two
        average([random_adapter(tiny_source, tiny_target, k=2, layer_map="mix"), adapter])
    lt, d_in, d_t = a.wk.shape
    ctx = dict(ctx_lags=torch.tensor([1, 2, 3]), ctx_mu=torch.zeros(lt, 2 * d_in), ctx_g=torch.ones(lt, 3, 2 * d_in),
               ctx_a=torch.randn(lt, 2 * d_in, 4), ctx_b=torch.randn(lt, 4, 2 * d_t))
    with_ctx = dataclasses.replace(a, **ctx, meta=dataclasses.replace(a.meta, format_version=5))
    with pytest.raises(ValueError, match="lacks ctx_lags"):
        average([with_ctx, a])
    refit = dataclasses.replace(with_ctx, ctx_mu=with_ctx.ctx_mu + 1)  # fitted on other data: its folding differs
    with pytest.raises(ValueError, match="ctx_mu differs"):
        average([with_ctx, refit])
    normed = dataclasses.replace(with_ctx, meta=dataclasses.replace(with_ctx.meta, format_version=4))
    with pytest.raises(ValueError, match="has the norm"):
        average([with_ctx, normed])
    tuned_ctx = dataclasses.replace(with_ctx, ctx_b=with_ctx.ctx_b * 3)
    torch.testing.assert_close(average([with_ctx, tuned_ctx]).ctx_b, with_ctx.ctx_b * 2)


def test_the_command_writes_an_adapter_that_records_its_inputs(tmp_path, tiny_source, tiny_target, capsys):
    from kvbridge.cli import main

    a = random_adapter(tiny_source, tiny_target, k=2, layer_map="mix")
    b = _tuned(a, 3)
    pa, pb = save_adapter(a, tmp_path / "a.safetensors"), save_adapter(b, tmp_path / "b.safetensors")
    out = tmp_path / "soup.safetensors"
    assert main(["adapter", "average", str(pa), str(pb), "--weights", "1,1", "--version", "2", "--out", str(out)]) == 0
    soup = load_adapter(out)
    assert soup.digest[:16] in capsys.readouterr().out
    torch.testing.assert_close(soup.wv, (load_adapter(pa).wv + load_adapter(pb).wv) / 2)
    assert soup.meta.version == "2" and soup.meta.training["command"].startswith("kvbridge adapter average")
    assert "--version 2 --out" in soup.meta.training["command"]  # the record names every option that made it
    assert [i["file"] for i in soup.meta.training["average"]] == ["a.safetensors", "b.safetensors"]
    assert main(["adapter", "average", str(pa), str(tmp_path / "missing.safetensors"), "--out", str(out)]) == 2
    assert "no adapter file" in capsys.readouterr().err
    assert main(["adapter", "average", str(pa), str(pb), "--weights", "1,x", "--out", str(out)]) == 2
    assert "--weights takes comma-separated numbers" in capsys.readouterr().err


def test_an_averages_runs_are_counted_once_each():
    """The time an adapter took from nothing, by its record: an answer-tuned adapter's --init chain is the adapter it
    is averaged with, and that chain counts once."""
    from kvbridge.adapters.average import from_scratch_seconds, runs

    base = {"command": "train-adapter --stages kl:1000", "record": {"wall_s": 1505, "teacher_cache_reused_s": 2111}}
    second = {"command": "train-adapter --init BASE", "record": {"wall_s": 607, "teacher_cache_reused_s": 2877},
              "init": {"file": "BASE.safetensors", "training": base}}
    answer = {"command": "train-adapter --init SHIPPED --stages answer:200", "record": {"wall_s": 1344},
              "init": {"file": "SHIPPED.safetensors", "training": second}}
    soup = {"average": [{"file": "SHIPPED.safetensors", "weight": 0.5, "training": second},
                        {"file": "ANSWER.safetensors", "weight": 0.5, "training": answer}],
            "command": "kvbridge adapter average SHIPPED.safetensors ANSWER.safetensors --out FILE"}
    assert [r["command"] for r in runs(soup)] == [second["command"], base["command"], answer["command"]]
    assert from_scratch_seconds(soup) == 1505 + 2111 + 607 + 2877 + 1344
    assert from_scratch_seconds(second) == 1505 + 2111 + 607 + 2877 and from_scratch_seconds({}) == 0
