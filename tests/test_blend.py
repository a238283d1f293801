"""CacheBlend over KV the target did not compute (transfer.suffix.blend): the selection pass makes the first layers
exact and finds planted deviations; the attention rule's scores are the model's own attention weights and find
tokens planted to draw it; each rule picks what it says; recomputing everything is exact for every layer mix; with
an induction prior the recompute reads what stays projected with it (from the layers the selection pass left
projected on); the forwards and FLOPs of a selection pass add up."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import zoo
from kvbridge.eval.flops import FlopModel
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import GROUPED_SDPA, eager_attention
from kvbridge.transfer.suffix.blend import (
    BlendConfig,
    attention_of_probe,
    attention_received,
    blend,
    first_layers_kv,
    kv_deviation,
    planned_forwards,
    select_tokens,
)
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.reuse import prefill_after, recompute_selected


def _setup(name: str = "gemma3", planted=(5, 17, 30)):
    lm = zoo.build(name)
    ids = torch.randint(3, lm.spec.vocab_size, (60,), generator=torch.Generator().manual_seed(4))
    context = kvcache.extract(lm.model, lm.spec, ids[:20])
    exact = prefill_after(lm, context, ids[20:])
    kv = exact.kv.clone()
    gen = torch.Generator().manual_seed(5)
    kv += 0.01 * torch.randn(kv.shape, generator=gen) * kv.std()  # everything a little wrong
    for i in planted:
        kv[:, :, :, i] += torch.randn(kv[:, :, :, i].shape, generator=gen) * kv.std()  # these very wrong
    return lm, context, exact, replace(exact, kv=kv)


def test_the_selection_pass_is_the_models_own_first_layers():
    lm, context, exact, _ = _setup()
    own = first_layers_kv(lm, context, exact.token_ids, 2)
    assert own.shape == (2, *exact.kv.shape[1:])
    assert torch.allclose(own, exact.kv[:2], atol=1e-5)


def test_deviation_finds_the_planted_tokens_and_each_rule_picks_what_it_says():
    lm, context, exact, wrong = _setup()
    deviation = kv_deviation(wrong.kv[:1], exact.kv[:1])
    assert set(deviation.topk(3).indices.tolist()) == {5, 17, 30}
    by_dev = select_tokens(deviation, 3, BlendConfig(0.1, rule="deviation"))
    assert by_dev.tolist() == [5, 17, 30]
    with_sinks = select_tokens(deviation, 10, BlendConfig(0.25, rule="sinks+deviation", sinks=2, tail=3))
    assert {0, 1, 5, 17, 30, 37, 38, 39} <= set(with_sinks.tolist()) and with_sinks.numel() == 10
    assert select_tokens(deviation, 4, BlendConfig(0.1, rule="last")).tolist() == [36, 37, 38, 39]
    by_attention = select_tokens(deviation, 10, BlendConfig(0.25, rule="attention", window=5, sinks=2))
    assert by_attention.tolist() == [0, 1, 5, 17, 30, 35, 36, 37, 38, 39]  # window, sinks, then the top scores
    random = select_tokens(deviation, 4, BlendConfig(0.1, rule="random", seed=3))
    assert random.numel() == 4 and torch.equal(random, select_tokens(deviation, 4, BlendConfig(0.1, rule="random",
                                                                                              seed=3)))
    assert select_tokens(deviation, 0, BlendConfig(0.0)).numel() == 0
    assert select_tokens(deviation, 99, BlendConfig(1.0)).tolist() == list(range(40))


@pytest.mark.parametrize("name", ["gemma3", "phi3-sliding", "qwen2", "mistral-sliding"])
def test_blending_everything_is_exact_and_blending_some_fixes_those(name):
    lm, context, exact, wrong = _setup(name)
    for rule in ("attention", "sinks+deviation", "random"):
        whole = blend(lm, context, wrong, BlendConfig(1.0, rule=rule))
        assert whole.selected.tolist() == list(range(40))
        assert torch.allclose(whole.segment.kv, exact.kv, atol=1e-5, rtol=1e-4), rule
    some = blend(lm, context, wrong, BlendConfig(0.1, rule="deviation", layers=1))
    assert {5, 17, 30} <= set(some.selected.tolist()) and some.selected.numel() == 4
    assert torch.allclose(some.segment.kv[:1], exact.kv[:1], atol=1e-5)  # the selection pass's layer is exact
    err_before = (wrong.kv[1:] - exact.kv[1:]).norm()
    assert (some.segment.kv[1:] - exact.kv[1:]).norm() < err_before


@pytest.mark.parametrize("name", ["gemma3", "phi3-sliding", "qwen2"])
def test_attention_received_is_the_models_own_attention_over_exact_kv(name):
    """Over exact KV, the window's forward sees what a full prefill shows those rows: the scores are the eager
    attention weights of the last `window` queries on the earlier placed tokens, summed over the deeper layers."""
    lm, context, exact, _ = _setup(name)
    c, t, window, start = context.num_tokens, exact.num_tokens, 6, 1
    score = attention_received(lm, context, exact, window, from_layer=start)
    assert lm.model.config._attn_implementation == GROUPED_SDPA  # switched back
    ids = torch.cat((context.token_ids, exact.token_ids))
    with eager_attention(lm.model):
        weights = lm.model(input_ids=ids[None], output_attentions=True).attentions
    want = sum(a[0, :, c + t - window:, c:c + t - window].sum(dim=(0, 1)) for a in weights[start:])
    assert torch.allclose(score[:t - window], want, atol=1e-4, rtol=1e-4)
    assert torch.isinf(score[t - window:]).all()


def test_the_attention_rule_finds_tokens_planted_to_draw_attention():
    """Keys of three tokens aligned with the window's queries in every deeper layer draw its attention: the rule
    recomputes them (and the window), and leaves the rest projected."""
    lm, context, exact, _ = _setup("qwen2")
    t, window, planted = exact.num_tokens, 4, (8, 21, 27)
    kv = exact.kv.clone()
    for i in planted:
        kv[:, 0, :, i] = 40.0 * kv[:, 0, :, t - window:].mean(dim=2)  # a key along the window's mean key
    drawn = replace(exact, kv=kv)
    score = attention_received(lm, context, drawn, window, from_layer=1)
    assert set(score[:t - window].topk(3).indices.tolist()) == set(planted)
    result = blend(lm, context, drawn, BlendConfig(7 / t, rule="attention", window=window, sinks=0))
    assert result.selected.tolist() == [*planted, *range(t - window, t)]


@pytest.mark.parametrize("name", ["gemma3", "qwen2"])
def test_the_prompt_rule_scores_with_the_requests_own_queries(name):
    """Over exact KV, the probe's forward sees what a full prefill of context + placed + probe shows the probe's rows:
    its scores are those eager attention weights on every placed token; the rule then recomputes the tokens the
    probe reads most, and refuses to run without a probe."""
    lm, context, exact, _ = _setup(name)
    c, t, start = context.num_tokens, exact.num_tokens, 1
    probe = torch.randint(3, lm.spec.vocab_size, (5,), generator=torch.Generator().manual_seed(9))
    score = attention_of_probe(lm, context, exact, probe, from_layer=start)
    ids = torch.cat((context.token_ids, exact.token_ids, probe))
    with eager_attention(lm.model):
        weights = lm.model(input_ids=ids[None], output_attentions=True).attentions
    want = sum(a[0, :, c + t:, c:c + t].sum(dim=(0, 1)) for a in weights[start:])
    assert torch.allclose(score, want, atol=1e-4, rtol=1e-4)
    config = BlendConfig(8 / t, rule="prompt", window=2, sinks=1, attention_from=start / lm.spec.num_layers)
    result = blend(lm, context, exact, config, probe_ids=probe)
    top = score[1:t - 2].topk(5).indices + 1
    assert result.selected.tolist() == sorted([0, *top.tolist(), t - 2, t - 1])
    with pytest.raises(ValueError, match="give probe_ids"):
        blend(lm, context, exact, config)


def test_the_recompute_reads_what_stays_projected_with_the_prior():
    lm, context, _, wrong = _setup("qwen2")
    c = context.num_tokens
    prior = InductionPrior.from_weights(torch.ones(lm.spec.num_layers, lm.model.config.num_attention_heads), 4.0, 4.0)
    config = BlendConfig(0.25, window=4)
    plain = blend(lm, context, wrong, config)
    before = torch.zeros(c, dtype=torch.bool)
    before[3:7] = True  # context positions that hold projected KV too (an earlier projected part)
    read = blend(lm, context, wrong, config, prior=prior, context_projected=before)
    assert torch.equal(read.selected, plain.selected)  # the selection pass reads as it did
    ids = torch.cat((context.token_ids, wrong.token_ids))
    with prior.reading(lm, ids, torch.cat((before, plain.still_projected))):
        expected = recompute_selected(lm, context, wrong, plain.selected)
    assert torch.allclose(read.segment.kv, expected.kv, atol=1e-5)
    assert not torch.allclose(read.segment.kv, plain.segment.kv, atol=1e-3)
    assert torch.equal(read.segment.kv[:, :, :, read.still_projected], wrong.kv[:, :, :, read.still_projected])

    # after a selection pass through layer 0, layer 0's KV is the target's own: a prior there alone changes nothing
    first_only = InductionPrior(prior.terms * (torch.arange(lm.spec.num_layers) == 0)[None, :, None])
    dev = BlendConfig(0.25, rule="sinks+deviation", layers=1)
    assert torch.equal(blend(lm, context, wrong, dev, prior=first_only).segment.kv,
                       blend(lm, context, wrong, dev).segment.kv)
    with pytest.raises(ValueError, match="context_projected must be"):
        blend(lm, context, wrong, config, prior=prior, context_projected=before[:-1])


def test_config_is_checked():
    for kwargs, words in (({"fraction": 1.5}, "fraction"),
                          ({"fraction": 0.1, "rule": "deviation", "layers": 0}, "layers"),
                          ({"fraction": 0.1, "rule": "best"}, "rule"), ({"fraction": 0.1, "sinks": -1}, "sinks"),
                          ({"fraction": 0.1, "window": 0}, "window"),
                          ({"fraction": 0.1, "attention_from": 1.0}, "attention_from")):
        with pytest.raises(ValueError, match=words):
            BlendConfig(**kwargs)
    assert BlendConfig(0.1).exact_layers == 0 and BlendConfig(0.1, rule="deviation").exact_layers == 1


def test_the_forwards_a_blend_runs_are_what_it_reports():
    lm, context, exact, wrong = _setup("qwen2")
    c, t, layers = context.num_tokens, exact.num_tokens, lm.spec.num_layers
    attention = blend(lm, context, wrong, BlendConfig(0.25, rule="attention", window=4))
    assert attention.forwards == ((4, c + t - 4, layers), (10, c + t - 10, layers))
    deviation = blend(lm, context, wrong, BlendConfig(0.25, rule="sinks+deviation", layers=2))
    assert deviation.forwards == ((t, c, 2), (10, c + t - 10, layers))
    assert blend(lm, context, wrong, BlendConfig(0.0)).forwards == ()


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.1, 0.25, 1.0])
@pytest.mark.parametrize("rule,layers", [("attention", None), ("prompt", None), ("sinks+deviation", 2),
                                         ("deviation", None), ("last", 1), ("random", None)])
def test_the_planned_forwards_are_the_ones_a_blend_runs(rule, layers, fraction):
    """What a cost model counts for a blend it did not run (a server's stored correction) is what blend runs."""
    lm, context, exact, wrong = _setup("qwen2")
    config = BlendConfig(fraction, rule=rule, window=4, layers=layers)
    probe = torch.tensor([7, 8, 9])
    ran = blend(lm, context, wrong, config, probe_ids=probe if rule == "prompt" else None)
    plan = planned_forwards(exact.num_tokens, context.num_tokens, lm.spec.num_layers, config, probe_tokens=3)
    assert ran.forwards == plan and ran.selected.numel() == (plan[-1][0] if fraction else 0)


def test_a_partial_pass_costs_its_share_of_the_layers(tiny_target):
    f = FlopModel.from_config(tiny_target.model.config)
    head = 2 * f.hidden * f.vocab
    assert f.prefill(50, 1, layers=f.layers) + head == f.prefill(50, 1)
    assert f.prefill(50, 1, layers=1) * f.layers == f.prefill(50, 1, layers=f.layers)
    with pytest.raises(ValueError, match="layers"):
        f.prefill(5, 0, layers=f.layers + 1)
