"""The induction prior (transfer.suffix.induction): the bias lands on projected keys whose previous token is the
query's token, at the prior's heads only, in prefill and decode alike, and in a forward that recomputes cached tokens
in place as a prefill of them would read it; with nothing to match the model reads as it does without; the model's
attention comes back after the block; bad input is named; the probe finds SmolLM2's induction heads."""

from __future__ import annotations

import json

import pytest
import torch
import zoo
from kvbridge.transfer import kvcache
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.induction import TERMS, InductionPrior, induction_scores
from kvbridge.transfer.suffix.reuse import prefill_after, recompute_selected
from safetensors.torch import save_file

CONTEXT = 40


def _setup(name: str = "qwen2"):
    lm = zoo.build(name)
    ids = torch.randperm(lm.spec.vocab_size - 3, generator=torch.Generator().manual_seed(2))[:CONTEXT] + 3  # distinct
    seg = kvcache.extract(lm.model, lm.spec, ids)
    return lm, ids, seg


def _prior(lm, layer: int, head: int, bias: float, bias2: float = 0.0) -> InductionPrior:
    weights = torch.zeros(lm.spec.num_layers, lm.model.config.num_attention_heads)
    weights[layer, head] = 1.0
    return InductionPrior.from_weights(weights, bias, bias2)


def _heads_out(lm, seg, query: torch.Tensor, layer: int, cache=None):
    """The attention output of every query head at `layer` for `query` after `seg` ([Q, H_q, D]), and the logits."""
    seen = {}
    o_proj = kvcache.decoder_layers(lm.model)[layer].self_attn.o_proj
    handle = o_proj.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach().clone()))
    start = seg.num_tokens if cache is None else cache.get_seq_length()
    cache = kvcache.to_cache(seg, lm.model, lm.spec) if cache is None else cache
    try:
        with torch.no_grad():
            logits = lm.model(input_ids=query[None], position_ids=torch.arange(start, start + query.numel())[None],
                              cache=cache, use_cache=True).logits[0]
    finally:
        handle.remove()
    heads = lm.model.config.num_attention_heads
    return seen["x"][0].view(query.numel(), heads, -1), logits, cache


def test_a_strong_bias_sends_the_head_to_the_projected_key_after_the_querys_token():
    lm, ids, seg = _setup()
    layer, head = 1, 2
    kv_head = head // (lm.model.config.num_attention_heads // lm.spec.num_kv_heads)
    projected = torch.ones(CONTEXT, dtype=torch.bool)
    projected[0] = False
    query = ids[10:11]  # the key at 11 follows this token
    plain, plain_logits, _ = _heads_out(lm, seg, query, layer)
    with _prior(lm, layer, head, bias=60.0).reading(lm, ids, projected):
        out, logits, _ = _heads_out(lm, seg, query, layer)
    value = seg.kv[layer, 1, kv_head, 11]  # [D]
    assert torch.allclose(out[0, head], value, atol=1e-4)
    assert not torch.allclose(plain[0, head], value, atol=1e-2)
    others = [h for h in range(out.shape[1]) if h != head]
    assert torch.allclose(out[0, others], plain[0, others], atol=1e-5)  # the other heads read as before
    assert not torch.allclose(logits, plain_logits, atol=1e-3)

    projected[11] = False  # the target's own key there: no bias
    with _prior(lm, layer, head, bias=60.0).reading(lm, ids, projected):
        out, _, _ = _heads_out(lm, seg, query, layer)
    assert torch.allclose(out[0, head], plain[0, head], atol=1e-5)


def test_the_bias_follows_the_tokens_each_forward_appends():
    lm, ids, seg = _setup()
    layer, head = 1, 3
    kv_head = head // (lm.model.config.num_attention_heads // lm.spec.num_kv_heads)
    projected = torch.ones(CONTEXT, dtype=torch.bool)
    fresh = torch.tensor([1, 2])  # not in the context: nothing to match
    with _prior(lm, layer, head, bias=60.0).reading(lm, ids, projected):
        _, _, cache = _heads_out(lm, seg, fresh, layer)  # a prefill of 2 tokens at 40, 41
        out, _, _ = _heads_out(lm, seg, ids[20:21], layer, cache=cache)  # a decode step at 42
    assert torch.allclose(out[0, head], seg.kv[layer, 1, kv_head, 21], atol=1e-4)

    # the previous token matters too: bias2 alone (bias 0) moves the head only where both tokens match
    with _prior(lm, layer, head, bias=0.0, bias2=60.0).reading(lm, ids, projected):
        out, _, _ = _heads_out(lm, seg, ids[29:31], layer)  # queries 29, 30 after 39: the pair (29, 30) at 30, 31
    assert torch.allclose(out[1, head], seg.kv[layer, 1, kv_head, 31], atol=1e-4)
    assert not torch.allclose(out[0, head], seg.kv[layer, 1, kv_head, 30], atol=1e-2)  # 39 before 29 nowhere


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3-sliding"])
def test_with_nothing_to_match_the_model_reads_as_without(name):
    lm, ids, seg = _setup(name)
    weights = torch.ones(lm.spec.num_layers, lm.model.config.num_attention_heads)
    query = torch.tensor([1, 2, 1])  # no context token
    _, plain, _ = _heads_out(lm, seg, query, 0)
    before = lm.model.config._attn_implementation
    with InductionPrior.from_weights(weights, 5.0, 5.0).reading(lm, ids, torch.ones(CONTEXT, dtype=torch.bool)):
        assert lm.model.config._attn_implementation != before
        _, logits, _ = _heads_out(lm, seg, query, 0)
    assert lm.model.config._attn_implementation == before
    assert torch.allclose(logits, plain, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen2", "gemma3", "phi3-sliding"])
def test_recomputing_cached_tokens_in_place_reads_the_prior_as_their_prefill_would(name):
    """Selective recompute (one forward of scattered cached tokens at their positions, the rest of the cache
    masked as the prefill would see it) with the prior gives the KV that a prefill of the same tokens after the
    cache before them gives with the prior: the queries' tokens, the tokens before them and the projected keys are
    the ones at their positions, not the ones the forward appends."""
    lm = zoo.build(name)
    period = torch.randperm(lm.spec.vocab_size - 3, generator=torch.Generator().manual_seed(3))[:10] + 3
    ids = period.repeat(5)  # an induction head has matches to find, within every sliding window here
    c = 6
    context = kvcache.extract(lm.model, lm.spec, ids[:c])
    exact = prefill_after(lm, context, ids[c:])
    noise = torch.randn(exact.kv.shape, generator=torch.Generator().manual_seed(4)) * exact.kv.std()
    placed = KVSegment(kv=exact.kv + 0.5 * noise, token_ids=exact.token_ids, positions=exact.positions,
                       model=exact.model, rotated=True)  # "projected": wrong everywhere
    prior = InductionPrior.from_weights(torch.ones(lm.spec.num_layers, lm.model.config.num_attention_heads), 4.0,
                                        4.0)
    t = placed.num_tokens
    for first in (30, t - 5):  # one token with others cached after it; the last 5 (recompute:r's tail)
        chosen = torch.arange(first, t if first == t - 5 else first + 1)
        projected = torch.ones(c + t, dtype=torch.bool)
        projected[:c] = False
        projected[c + chosen] = False
        with prior.reading(lm, ids, projected):
            in_place = recompute_selected(lm, context, placed, chosen).kv[:, :, :, chosen]
        before = KVSegment.concat([context, placed.slice(0, first)])
        with prior.reading(lm, ids[:c + first], projected[:c + first]):
            after = prefill_after(lm, before, ids[c + first:c + int(chosen[-1]) + 1]).kv
        plain = recompute_selected(lm, context, placed, chosen).kv[:, :, :, chosen]
        assert torch.allclose(in_place, after, atol=1e-4, rtol=1e-4), (name, first)
        assert not torch.allclose(in_place, plain, atol=1e-3), (name, first)  # the prior did change them

    cache = kvcache.to_cache(KVSegment.concat([context, placed]), lm.model, lm.spec)
    with pytest.raises(ValueError, match="recompute tokens it holds"), torch.no_grad():
        with prior.reading(lm, ids, torch.ones(c + t, dtype=torch.bool)):  # position 10 holds another token
            lm.model(input_ids=ids[11:12][None], position_ids=torch.tensor([[10]]), cache=cache, use_cache=True)


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_a_model_whose_own_attention_is_eager_recomputes_under_a_prior_as_with_sdpa(name):
    """Under a prior, the layers without a biased head run the model's own attention; eager adds its mask to the
    scores, and selective recompute gave it the boolean mask (made for SDPA): +1 where allowed, nothing masked, so
    recomputed tokens read the future and their own stale KV. The same weights with eager attention now recompute
    (in place, and as a served blend) what they do with kvbridge's SDPA."""
    import copy

    from kvbridge.transfer.models import wrap_model
    from kvbridge.transfer.suffix.correction import Correction, correct

    sdpa = zoo.build(name)
    model = copy.deepcopy(sdpa.model)
    model.config._attn_implementation = "eager"
    eager = wrap_model(model, sdpa.tokenizer, f"{name}-eager")
    # a biased head in the last layer only: every layer before it runs the model's own attention
    prior = _terms(sdpa, sdpa.spec.num_layers - 1, 0, **{TERMS[0]: 3.0})
    ids = torch.randint(3, sdpa.spec.vocab_size, (41,), generator=torch.Generator().manual_seed(0))
    chosen = torch.tensor([5, 20, 29])
    projected = torch.zeros(41, dtype=torch.bool)
    projected[10:] = True
    projected[10 + chosen] = False
    out = {}
    for lm in (sdpa, eager):
        context = kvcache.extract(lm.model, lm.spec, ids[:10])
        placed = prefill_after(lm, context, ids[10:])
        with prior.reading(lm, ids, projected):
            in_place = recompute_selected(lm, context, placed, chosen).kv
        blended = correct(lm, kvcache.extract(lm.model, lm.spec, ids), Correction.parse("blend:0.2"), prior=prior)
        out[lm.name] = in_place, blended.segment.kv
    for got, want in zip(out[eager.name], out[sdpa.name]):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_prior_from_a_layer_on_leaves_the_layers_before_it_alone():
    lm = zoo.build("qwen2")
    prior = InductionPrior.from_weights(torch.ones(lm.spec.num_layers, lm.model.config.num_attention_heads))
    assert prior.from_layer(0) is prior
    later = prior.from_layer(1)
    assert not bool(later.terms[:, :1].any()) and torch.equal(later.terms[:, 1:], prior.terms[:, 1:])
    assert set(later.heads) == set(range(1, lm.spec.num_layers)) and "from layer 1" in later.origin


def _terms(lm, layer: int, head: int, **values: float) -> InductionPrior:
    terms = torch.zeros(len(TERMS), lm.spec.num_layers, lm.model.config.num_attention_heads)
    for name, value in values.items():
        terms[TERMS.index(name), layer, head] = value
    return InductionPrior(terms)


def test_the_projected_and_duplicate_terms_land_where_they_say():
    lm, ids, seg = _setup()
    layer, head = 1, 2
    kv_head = head // (lm.model.config.num_attention_heads // lm.spec.num_kv_heads)
    projected = torch.zeros(CONTEXT, dtype=torch.bool)
    projected[25] = True  # one projected key: a large trust in projected keys sends the head there
    query = torch.tensor([1])
    with _terms(lm, layer, head, projected=60.0).reading(lm, ids, projected):
        out, _, _ = _heads_out(lm, seg, query, layer)
    assert torch.allclose(out[0, head], seg.kv[layer, 1, kv_head, 25], atol=1e-4)
    projected[:] = True  # duplicate: the projected key of the query's own token (at 12), not the one after it
    with _terms(lm, layer, head, duplicate=60.0).reading(lm, ids, projected):
        out, _, _ = _heads_out(lm, seg, ids[12:13], layer)
    assert torch.allclose(out[0, head], seg.kv[layer, 1, kv_head, 12], atol=1e-4)


def test_a_fitted_prior_round_trips_and_is_found_by_the_models_config_hash(tmp_path):
    lm = zoo.build("qwen2")
    prior = _terms(lm, 1, 2, match=1.5, projected=-0.25)
    prior.save(tmp_path / "other.safetensors", {"target": {"config_hash": "not-this-one"}})
    assert InductionPrior.for_model(lm, folder=tmp_path).origin.startswith("probe")  # no file for this model
    prior.save(tmp_path / "qwen2.safetensors", {"target": {"config_hash": lm.spec.identity.config_hash}})
    found = InductionPrior.for_model(lm, folder=tmp_path)
    assert found.origin == "qwen2.safetensors" and torch.equal(found.terms, prior.terms)
    assert found.heads == {1: [2]}
    save_file({"terms": prior.terms}, str(tmp_path / "bare.safetensors"))
    with pytest.raises(ValueError, match="not an induction prior file"):
        InductionPrior.load(tmp_path / "bare.safetensors")
    with pytest.raises(ValueError, match="finite float"):
        InductionPrior(torch.full((4, 2, 4), float("nan")))
    # a file of such terms, or of another shape, is named with what is wrong (it was refused naming neither)
    meta = {"kvbridge_prior": json.dumps({"target": {"config_hash": lm.spec.identity.config_hash}})}
    for name, terms, says in (("nan", prior.terms.clone().fill_(float("nan")), "non-finite values"),
                              ("flat", prior.terms[0].contiguous(), "finite float")):
        save_file({"terms": terms}, str(tmp_path / f"{name}.safetensors"), metadata=meta)
        with pytest.raises(ValueError, match=rf"{name}\.safetensors: .*{says}"):
            InductionPrior.load(tmp_path / f"{name}.safetensors")


def test_bad_input_is_named_and_the_attention_comes_back():
    lm, ids, seg = _setup()
    projected = torch.ones(CONTEXT, dtype=torch.bool)
    prior = _prior(lm, 1, 0, bias=3.0)
    before = lm.model.config._attn_implementation
    with pytest.raises(ValueError, match="cannot read with 'qwen2'"):
        with InductionPrior.from_weights(torch.ones(3, 4)).reading(lm, ids, projected):
            pass
    with pytest.raises(ValueError, match="one shape"):
        with prior.reading(lm, ids, projected[:-1]):
            pass
    with pytest.raises(ValueError, match="a batch of 2"):
        with prior.reading(lm, ids, projected), torch.no_grad():
            lm.model(input_ids=torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="input_ids"):
        with prior.reading(lm, ids, projected), torch.no_grad():
            lm.model(inputs_embeds=torch.zeros(1, 3, lm.model.config.hidden_size))
    with pytest.raises(RuntimeError, match="already reading"):
        with prior.reading(lm, ids, projected), prior.reading(lm, ids, projected):
            pass
    assert lm.model.config._attn_implementation == before
    with pytest.raises(ValueError, match="biases must be >= 0"):
        InductionPrior.from_weights(torch.ones(2, 4), bias=-1.0)
    with pytest.raises(ValueError, match="threshold"):
        InductionPrior.probed(lm, threshold=0.0)


def test_the_probe_scores_every_query_head():
    lm = zoo.build("llama3")
    scores = induction_scores(lm)
    assert scores.shape == (lm.spec.num_layers, lm.model.config.num_attention_heads)
    assert bool(((scores >= 0) & (scores <= 1)).all())
    assert induction_scores(lm) is scores  # one probe per model
    prior = InductionPrior.probed(lm, threshold=1.0)
    assert prior.heads == {} and not bool(prior.terms.any())  # a random model has no perfect induction head


@pytest.mark.slow
def test_the_probe_finds_smollm2s_induction_heads(smollm2):
    scores = induction_scores(smollm2)
    assert float(scores[17, 3]) > 0.5 and float(scores[18, 6]) > 0.5  # KV heads 1 and 2 (docs/eval-blend)
    assert float(scores[:10].max()) < 0.3  # no early layer does it
    heads = InductionPrior.probed(smollm2).heads
    assert 3 in heads[17] and 6 in heads[18]
    fitted = InductionPrior.for_model(smollm2)  # the prior that ships for SmolLM2, fitted on the same heads' terms
    assert fitted.origin.endswith(".safetensors") and 3 in fitted.heads[17] and 6 in fitted.heads[18]


def test_a_fitted_prior_says_when_it_was_fitted_for_another_adapter(tmp_path):
    lm = zoo.build("qwen2")
    prior = _terms(lm, 1, 2, match=1.5)
    target = {"config_hash": lm.spec.identity.config_hash}
    mine, other = "a" * 64, "b" * 64
    prior.save(tmp_path / "fitted.safetensors", {"target": target, "adapter": {"name": "mine", "digest": mine}})
    fitted = InductionPrior.load(tmp_path / "fitted.safetensors")
    assert fitted.adapter == {"name": "mine", "digest": mine} and fitted.stale_for(mine) is None
    said = fitted.stale_for(other)
    assert "fitted for adapter mine (aaaaaaaaaaaaaaaa), not for this one (bbbbbbbbbbbbbbbb)" in said
    assert said.split(" was ")[1] in fitted.from_layer(1).stale_for(other)  # from a layer on: the same fit
    prior.save(tmp_path / "old.safetensors", {"target": target, "adapter": "mine"})  # before digests were recorded
    assert "records no adapter digest (fitted for mine)" in InductionPrior.load(tmp_path / "old.safetensors").stale_for(
        mine)
    assert InductionPrior.probed(lm).stale_for(other) is None  # made from the target alone: no adapter to check
    save_file({"terms": prior.terms}, str(tmp_path / "odd.safetensors"), metadata={"kvbridge_prior": "[1, 2"})
    with pytest.raises(ValueError, match="odd.safetensors: its kvbridge_prior metadata is not a JSON object"):
        InductionPrior.load(tmp_path / "odd.safetensors")
