"""SuffixReuseGenerator's exact reuse needs identical KV before the segment: a turn computed after projected KV is
not exact after the same tokens prefilled (nor after another projection or prior), one model's (or dtype's) KV is
never served to another through a shared manager, and forwards that recompute a shifted segment over projected KV
read it with the induction prior."""

from __future__ import annotations

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.align import start_token_id
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.suffix.cache_manager import SuffixCacheManager
from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.value_score import FixedScorer

SYSTEM = "You answer questions about the Python standard library in one short sentence."
DOC = "The json module encodes Python objects as JSON text and decodes JSON text into Python objects."
Q1 = "What does the json module do?"
Q2 = "How does the json module read a JSON file?"


def _manager():
    return SuffixCacheManager(PagedStore(StoreConfig(capacity_bytes=16 << 20, device="cpu")), scorer=FixedScorer(0.9))


def _plain(gen: SuffixReuseGenerator, texts: list[str], n: int) -> torch.Tensor:
    ids = torch.cat([torch.tensor([gen.start_token])] + [gen.tokens(t) for t in texts])
    return kvcache.generate_plain(gen.lm.model, gen.lm.spec, ids, max_new_tokens=n)


class NoisyKV:
    """The target's own KV of a text plus seeded noise: a stand-in for a projection (another seed: another adapter)."""

    def __init__(self, lm, seed: int = 0):
        self.lm, self.seed = lm, seed

    def projected_segment(self, text, offset):
        ids = torch.tensor(self.lm.tokenizer(text, add_special_tokens=False)["input_ids"])
        own = kvcache.extract(self.lm.model, self.lm.spec, torch.cat((torch.tensor([start_token_id(
            self.lm.tokenizer)]), ids))).slice(1, 1 + ids.numel())
        noise = torch.randn(own.kv.shape, generator=torch.Generator().manual_seed(self.seed)) * own.kv.std()
        return KVSegment(kv=own.kv + noise, token_ids=own.token_ids, positions=own.positions, model=own.model,
                         rotated=True)


def test_a_turn_computed_after_projected_kv_is_exact_only_after_the_same_kv(tiny_target):
    lm = tiny_target
    # recompute_k covers every token: a segment reused other than exact is recomputed whole (a plain prefill)
    gen = SuffixReuseGenerator(lm, _manager(), context_source=NoisyKV(lm), recompute_k=1000, induction_prior=False)
    _, m1 = gen.generate("s", [Part(DOC, "document", projected=True), Part(Q1), Part(Q2)], max_new_tokens=4)
    assert m1.parts == ["projected", "prefilled", "prefilled"]
    # the same tokens, the document prefilled this time: Q1's cached KV read a projection, it is not exact here
    out, m2 = gen.generate("s", [Part(DOC, "document"), Part(Q1), Part(Q2)], max_new_tokens=8)
    assert m2.parts == ["prefilled", "shifted", "prefilled"] and m2.tokens_reused_exact == 0
    assert torch.equal(out, _plain(gen, [DOC, Q1, Q2], 8))
    # the same projection again (same KV, same prior): exact, and the tokens of no reuse
    request = [Part(DOC, "document", projected=True), Part(Q1), Part(Q2)]
    out, m3 = gen.generate("s", request, max_new_tokens=8)
    assert m3.parts == ["projected", "exact", "prefilled"] and m3.tokens_reused_exact == gen.tokens(Q1).numel()
    alone = SuffixReuseGenerator(lm, None, context_source=NoisyKV(lm), induction_prior=False)
    assert torch.equal(out, alone.generate("s", request, max_new_tokens=8)[0])
    # another projection of the same text (another adapter), or the same one read with a prior: not exact
    gen.context_source = NoisyKV(lm, seed=1)
    assert gen.generate("s", request, max_new_tokens=2)[1].parts == ["projected", "shifted", "prefilled"]
    gen.context_source = NoisyKV(lm)
    gen.induction_prior = InductionPrior.from_weights(torch.ones(lm.spec.num_layers,
                                                                 lm.model.config.num_attention_heads))
    assert gen.generate("s", request, max_new_tokens=2)[1].parts == ["projected", "shifted", "prefilled"]


def test_a_segment_after_a_shifted_one_is_exact_only_after_the_same_shift(tiny_target):
    gen = SuffixReuseGenerator(tiny_target, _manager(), recompute_k=2)
    gen.generate("s", [Part(SYSTEM, "system"), Part(Q1)], max_new_tokens=2)
    request = [Part(DOC, "document"), Part(SYSTEM, "system"), Part(Q1), Part(Q2)]
    _, m = gen.generate("s", request, max_new_tokens=2)
    assert m.parts == ["prefilled", "shifted", "prefilled", "prefilled"]
    _, m = gen.generate("s", request, max_new_tokens=2)  # Q1 was computed after this very shifted SYSTEM
    assert m.parts == ["exact", "shifted", "exact", "prefilled"]
    gen.recompute_k = 3  # SYSTEM's KV comes out otherwise now: Q1 read other KV
    _, m = gen.generate("s", request, max_new_tokens=2)
    assert m.parts == ["exact", "shifted", "shifted", "prefilled"]


def test_a_shared_manager_never_serves_one_models_kv_to_another(tiny_target):
    from kvbridge.transfer.tiny_pair import tiny_target as load_target

    bf16 = load_target(device="cpu", dtype="bfloat16")  # the same identity (config hash), another dtype
    assert bf16.spec.identity == tiny_target.spec.identity
    manager = _manager()
    request = [Part(SYSTEM, "system"), Part(Q1)]
    SuffixReuseGenerator(tiny_target, manager).generate("s", request, max_new_tokens=2)
    gen = SuffixReuseGenerator(bf16, manager)
    out, m = gen.generate("s", request, max_new_tokens=4)
    assert m.parts == ["prefilled", "prefilled"] and m.tokens_reused_local == 0
    assert torch.equal(out, SuffixReuseGenerator(bf16).generate("s", request, max_new_tokens=4)[0])
    # each finds its own
    assert gen.generate("s", request, max_new_tokens=2)[1].parts == ["exact", "prefilled"]
    assert SuffixReuseGenerator(tiny_target, manager).generate("s", request, max_new_tokens=2)[1].parts == [
        "exact", "prefilled"]


def test_the_manager_keys_segments_by_model_and_dtype(tiny_target):
    lm = tiny_target
    manager = _manager()
    ids = torch.tensor(lm.tokenizer(SYSTEM, add_special_tokens=False)["input_ids"])
    seg = kvcache.extract(lm.model, lm.spec, ids)
    other = KVSegment(kv=seg.kv * 2, token_ids=seg.token_ids, positions=seg.positions,
                      model=ModelIdentity("another-model", "0" * 64), rotated=True)
    half = seg.to(dtype=torch.bfloat16)
    none = torch.zeros(0, dtype=torch.int64)
    keys = {manager.offer("s", s, none).key for s in (seg, other, half)}
    assert len(keys) == 3
    for s in (seg, other, half):
        found = manager.find("s", s.token_ids, s.model, s.dtype)
        assert found is not None and found.segment.model == s.model and found.segment.dtype == s.dtype
        assert torch.equal(found.segment.kv, s.kv)
    assert manager.find("s", seg.token_ids, seg.model, torch.float16) is None


def test_recomputing_a_shifted_segment_reads_projected_kv_with_the_prior(tiny_target):
    """Every forward after the projected part (the shifted segment's recompute included) runs inside the prior's
    reading; with no projected part before it nothing is read with the prior and recomputing a whole shifted
    segment gives a plain prefill's tokens."""
    lm = tiny_target
    inside = []
    forwards = []

    class Spy:
        def __init__(self, prior):
            self.prior = prior
            self.terms = prior.terms

        def from_layer(self, first):
            return self

        def reading(self, lm_, ids, still):
            spy = self

            class Block:
                def __enter__(self):
                    self.inner = spy.prior.reading(lm_, ids, still)
                    self.inner.__enter__()
                    inside.append(True)

                def __exit__(self, *exc):
                    inside.pop()
                    return self.inner.__exit__(*exc)

            return Block()

    def note(module, args, kwargs):  # (read with the prior, position of the forward's first query)
        at = kwargs.get("position_ids")
        forwards.append((bool(inside), int(at[0, 0]) if at is not None else -1))

    handle = lm.model.register_forward_pre_hook(note, with_kwargs=True)
    try:
        weights = torch.zeros(lm.spec.num_layers, lm.model.config.num_attention_heads)
        weights[-1] = 1.0
        gen = SuffixReuseGenerator(lm, _manager(), context_source=NoisyKV(lm), recompute_k=2,
                                   induction_prior=Spy(InductionPrior.from_weights(weights, 4.0, 4.0)))
        after_doc = 1 + gen.tokens(DOC).numel()
        gen.generate("s", [Part(SYSTEM, "system"), Part(Q1)], max_new_tokens=2)
        request = [Part(DOC, "document", projected=True), Part(SYSTEM, "system"), Part(Q2)]
        forwards.clear()
        _, m = gen.generate("s", request, max_new_tokens=2)
        assert m.parts == ["projected", "shifted", "prefilled"]
        # SYSTEM's first 2 tokens recomputed, the new turn's prefill and its generation: all read with the prior
        late = [read for read, at in forwards if at >= after_doc]
        assert len(late) >= 3 and all(late), forwards
        gen.recompute_fraction = 0.5  # the most deviating tokens too: chosen and recomputed reading the prior
        forwards.clear()
        _, m = gen.generate("s", request, max_new_tokens=2)
        late = [read for read, at in forwards if at >= after_doc]
        assert m.parts == ["projected", "shifted", "prefilled"] and len(late) >= 5 and all(late), forwards
        # no projected part before it: no prior, and a wholly recomputed shifted segment is a plain prefill's
        gen.recompute_k, gen.recompute_fraction = 1000, 0.0
        forwards.clear()
        out, m = gen.generate("s", [Part(Q1), Part(SYSTEM, "system"), Part(Q2)], max_new_tokens=8)
        assert m.parts[1] == "shifted" and not any(read for read, _ in forwards)
        assert torch.equal(out, _plain(gen, [Q1, SYSTEM, Q2], 8))
    finally:
        handle.remove()
