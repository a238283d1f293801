"""SuffixReuseGenerator: exact reuse gives the tokens of no reuse; projected parts come from a context source;
shifted reuse is reported and recompute is counted; metrics add up; projected positions are read with the
induction prior."""

from __future__ import annotations

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.suffix.cache_manager import SuffixCacheManager
from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.value_score import FixedScorer

SYSTEM = "You answer questions about the Python standard library in one short sentence."
Q1 = "What does the json module do?"
A1 = "It encodes and decodes JSON text."
Q2 = "How does the json module read a JSON file?"


def _manager():
    return SuffixCacheManager(PagedStore(StoreConfig(capacity_bytes=16 << 20, device="cpu")), scorer=FixedScorer(0.9))


def _plain(gen: SuffixReuseGenerator, texts: list[str], n: int) -> torch.Tensor:
    ids = torch.cat([torch.tensor([gen.start_token])] + [gen.tokens(t) for t in texts])
    return kvcache.generate_plain(gen.lm.model, gen.lm.spec, ids, max_new_tokens=n)


def test_exact_reuse_across_turns_gives_the_tokens_of_no_reuse(tiny_target):
    gen = SuffixReuseGenerator(tiny_target, _manager())
    first, m1 = gen.generate("s", [Part(SYSTEM, "system"), Part(Q1)], max_new_tokens=8)
    assert m1.parts == ["prefilled", "prefilled"] and m1.tokens_reused_local == 0
    request = [Part(SYSTEM, "system"), Part(Q1), Part(A1), Part(Q2)]
    second, m2 = gen.generate("s", request, max_new_tokens=8)
    assert m2.parts == ["exact", "prefilled", "prefilled", "prefilled"]
    assert m2.tokens_reused_exact == gen.tokens(SYSTEM).numel() == m2.tokens_reused_local
    assert m2.tokens_prefilled + m2.tokens_reused_local == m2.tokens_total
    third, m3 = gen.generate("s", request, max_new_tokens=8)  # the same request again: all context reused
    assert m3.parts == ["exact", "exact", "exact", "prefilled"] and m3.ttft_s > 0
    plain = _plain(gen, [SYSTEM, Q1, A1, Q2], 8)
    assert torch.equal(second, plain) and torch.equal(third, plain)
    assert torch.equal(first, _plain(gen, [SYSTEM, Q1], 8))
    other, m4 = gen.generate("t", request, max_new_tokens=8)  # another session reuses nothing of s
    assert m4.tokens_reused_local == 0 and torch.equal(other, plain)


def test_projected_parts_come_from_the_context_source(tiny_target):
    lm = tiny_target

    class OwnKV:  # the target's own KV as the "projection": exact, so the tokens must match no reuse
        calls = []

        def projected_segment(self, text, offset):
            self.calls.append(offset)
            ids = torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
            return kvcache.extract(lm.model, lm.spec, torch.cat((torch.tensor([gen.start_token]), ids))).slice(
                1, 1 + ids.numel()) if offset == 1 else None

    gen = SuffixReuseGenerator(lm, _manager(), context_source=OwnKV())
    doc = "The json module encodes Python objects as JSON text and decodes JSON text into Python objects."
    out, m = gen.generate("s", [Part(doc, "document", projected=True), Part(Q1)], max_new_tokens=8)
    assert OwnKV.calls == [1] and m.parts == ["projected", "prefilled"]
    assert m.tokens_projected == gen.tokens(doc).numel() and m.tokens_prefilled == 1 + gen.tokens(Q1).numel()
    assert torch.equal(out, _plain(gen, [doc, Q1], 8))


def test_projected_parts_are_blended_with_recompute_fraction(tiny_target):
    """A wrong projection (the target's own KV plus noise): blending recomputes its share of tokens (counted as
    prefilled), and recomputing all of them gives the target's own tokens back."""
    lm = tiny_target

    class NoisyKV:
        def projected_segment(self, text, offset):
            ids = torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
            own = kvcache.extract(lm.model, lm.spec, torch.cat((torch.tensor([gen.start_token]), ids))).slice(
                1, 1 + ids.numel())
            noise = torch.randn(own.kv.shape, generator=torch.Generator().manual_seed(0)) * own.kv.std()
            return KVSegment(kv=own.kv + noise, token_ids=own.token_ids, positions=own.positions, model=own.model,
                             rotated=True)

    doc = "The json module encodes Python objects as JSON text and decodes JSON text into Python objects."
    gen = SuffixReuseGenerator(lm, None, context_source=NoisyKV(), recompute_fraction=0.25)
    n = gen.tokens(doc).numel()
    _, m = gen.generate("s", [Part(doc, "document", projected=True), Part(Q1)], max_new_tokens=4)
    assert m.tokens_prefilled - 1 - gen.tokens(Q1).numel() == round(0.25 * n) and m.tokens_projected == n - round(
        0.25 * n)
    gen.recompute_fraction = 1.0
    out, m = gen.generate("s", [Part(doc, "document", projected=True), Part(Q1)], max_new_tokens=8)
    assert m.tokens_projected == 0 and torch.equal(out, _plain(gen, [doc, Q1], 8))


def test_shifted_reuse_is_reported_and_recompute_counted(tiny_target):
    gen = SuffixReuseGenerator(tiny_target, _manager(), recompute_k=3)
    gen.generate("s", [Part(SYSTEM, "system"), Part(Q1)], max_new_tokens=4)
    gen.generate("s", [Part(Q1), Part(SYSTEM, "system"), Part(Q2)], max_new_tokens=4)
    _, m = gen.generate("s", [Part(A1), Part(SYSTEM, "system"), Part(Q2)], max_new_tokens=4)
    # SYSTEM was computed at position 1 (after the start token); here it follows A1: shifted, 3 tokens recomputed
    assert m.parts == ["prefilled", "shifted", "prefilled"]
    n = gen.tokens(SYSTEM).numel()
    assert m.tokens_reused_local == n - 3 and m.tokens_reused_exact == 0
    assert m.tokens_prefilled == 1 + gen.tokens(A1).numel() + 3 + gen.tokens(Q2).numel()


def test_shifted_segments_can_recompute_their_most_deviating_tokens(tiny_target):
    gen = SuffixReuseGenerator(tiny_target, _manager(), recompute_k=2, recompute_fraction=0.5)
    gen.generate("s", [Part(SYSTEM, "system"), Part(Q1)], max_new_tokens=4)
    _, m = gen.generate("s", [Part(A1), Part(SYSTEM, "system"), Part(Q2)], max_new_tokens=4)
    n = gen.tokens(SYSTEM).numel()
    assert m.parts == ["prefilled", "shifted", "prefilled"]
    redone = n - m.tokens_reused_local
    assert round(0.5 * n) <= redone <= 2 + round(0.5 * n)  # the first 2 and half of the tokens, overlapping or not
    assert m.tokens_prefilled + m.tokens_reused_local == m.tokens_total


def test_projected_positions_are_read_with_the_induction_prior(tiny_target):
    """The generator hands the prior the request's tokens and which positions still hold projected KV: a projected
    part's tokens but those blend recomputed; none when all were recomputed or the prior is off."""
    lm = tiny_target
    seen = []

    class Spy:  # an InductionPrior that records what it is asked to read
        def __init__(self, prior):
            self.prior = prior

        def from_layer(self, first):
            assert first == 0  # the generator's blend has no selection pass through the first layers
            return self

        def reading(self, lm_, ids, still):
            seen.append((ids.clone(), still.clone()))
            return self.prior.reading(lm_, ids, still)

    class OwnKV:
        def projected_segment(self, text, offset):
            ids = torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
            return kvcache.extract(lm.model, lm.spec, torch.cat((torch.tensor([gen.start_token]), ids))).slice(
                1, 1 + ids.numel())

    doc = "The json module encodes Python objects as JSON text and decodes JSON text into Python objects."
    weights = torch.zeros(lm.spec.num_layers, lm.model.config.num_attention_heads)
    weights[-1] = 1.0
    gen = SuffixReuseGenerator(lm, None, context_source=OwnKV(), recompute_fraction=0.25,
                               induction_prior=Spy(InductionPrior.from_weights(weights, 4.0, 4.0)))
    n = gen.tokens(doc).numel()
    gen.generate("s", [Part(doc, "document", projected=True), Part(Q1)], max_new_tokens=4)
    assert len(seen) == 2  # blend's recompute forward; the new turn's prefill and generation, in one block
    ids, still = seen[1]
    assert torch.equal(ids, torch.cat((torch.tensor([gen.start_token]), gen.tokens(doc))))
    assert not still[0] and int(still.sum()) == n - round(0.25 * n)
    assert not still[n]  # the part's last token is recomputed (blend's window)
    assert torch.equal(seen[0][0], ids) and torch.equal(seen[0][1], still)  # blend read the same tokens as projected

    seen.clear()
    gen.generate("s", [Part(doc, "document", projected=True), Part(Q1), Part(A1), Part(Q2)], max_new_tokens=4)
    assert len(seen) == 3 and seen[1][0].numel() == 1 + n  # blend; Q1 and A1 prefilled over the document; Q2
    assert torch.equal(seen[2][1][:1 + n], seen[1][1]) and not bool(seen[2][1][1 + n:].any())

    seen.clear()
    gen.recompute_fraction = 1.0
    out, _ = gen.generate("s", [Part(doc, "document", projected=True), Part(Q1)], max_new_tokens=8)
    assert seen == [] and torch.equal(out, _plain(gen, [doc, Q1], 8))
    gen.recompute_fraction, gen.induction_prior = 0.25, False
    gen.generate("s", [Part(doc, "document", projected=True), Part(Q1)], max_new_tokens=4)
    assert seen == []
