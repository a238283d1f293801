"""SuffixReuseGenerator's limits: bad arguments and requests past the model's positions are refused before anything
runs, bad projected segments are refused by name, a part too large for the store is served uncached, and threads
sharing a model never run through each other's induction prior."""

from __future__ import annotations

import threading

import pytest
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

DOC = "The json module encodes Python objects as JSON text and decodes JSON text into Python objects."
Q1 = "What does the json module do?"


def _manager(capacity: int = 16 << 20):
    return SuffixCacheManager(PagedStore(StoreConfig(capacity_bytes=capacity, device="cpu")), scorer=FixedScorer(0.9))


class Forwards:
    """Counts the model's forwards while the block runs."""

    def __init__(self, lm):
        self.lm, self.count = lm, 0

    def __enter__(self):
        self.handle = self.lm.model.register_forward_pre_hook(lambda *_: setattr(self, "count", self.count + 1))
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _own_kv(lm, text: str) -> KVSegment:
    ids = torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])
    return kvcache.extract(lm.model, lm.spec, torch.cat((torch.tensor([start_token_id(lm.tokenizer)]), ids))).slice(
        1, 1 + ids.numel())


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_new_tokens=0), r"max_new_tokens must be an int >= 1, got 0"),
    (dict(max_new_tokens=-3), r"max_new_tokens must be an int >= 1, got -3"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an int >= 1, got 2.5"),
    (dict(streamer=object()), r"does not take streamer"),
    (dict(num_beams=2), r"does not take num_beams=2.*greedy"),
    (dict(do_sample=True), r"does not take do_sample=True.*greedy"),
    (dict(temperature=0.7, top_k=5), r"does not take temperature, top_k"),
])
def test_bad_generate_arguments_are_refused_before_anything_runs(tiny_target, kwargs, message):
    manager = _manager()
    gen = SuffixReuseGenerator(tiny_target, manager)
    kwargs.setdefault("max_new_tokens", 2)
    with Forwards(tiny_target) as forwards, pytest.raises(ValueError, match=message):
        gen.generate("s", [Part("A system prompt."), Part(Q1)], **kwargs)
    assert forwards.count == 0 and manager.stats()["sessions"] == 0


def test_bad_settings_and_parts_are_refused_before_anything_runs(tiny_target):
    manager = _manager()
    gen = SuffixReuseGenerator(tiny_target, manager)
    request = [Part("A system prompt.", "system"), Part(Q1)]
    for name, value, message in (("recompute_k", -1, r"recompute_k must be an int >= 0, got -1"),
                                 ("recompute_fraction", 1.5, r"recompute_fraction must be in \[0, 1\], got 1.5"),
                                 ("recompute_fraction", -0.1, r"recompute_fraction must be in \[0, 1\], got -0.1")):
        setattr(gen, name, value)
        with Forwards(tiny_target) as forwards, pytest.raises(ValueError, match=message):
            gen.generate("s", request, max_new_tokens=2)
        assert forwards.count == 0 and manager.stats()["sessions"] == 0
        gen.recompute_k, gen.recompute_fraction = 0, 0.0
    with pytest.raises(ValueError, match=r"recompute_fraction must be in \[0, 1\], got 2"):
        SuffixReuseGenerator(tiny_target, recompute_fraction=2)
    with pytest.raises(ValueError, match=r"Part.role must be one of .*'turn'.*got 'user'"):
        Part(Q1, role="user")
    for parts, message in (([Q1], r"parts\[0\] must be a Part, got str"), ([], "at least one part")):
        with pytest.raises(ValueError, match=message):
            gen.generate("s", parts, max_new_tokens=2)
    # a projected part of whitespace alone (which the server refuses to project) is refused before any turn begins
    gen.context_source = BadSource(tiny_target, None)
    with Forwards(tiny_target) as forwards, pytest.raises(ValueError, match=r"parts\[1\] is projected but holds "
                                                                            "whitespace only"):
        gen.generate("s", [Part(DOC, "document"), Part(" \n", "document", projected=True), Part(Q1)], max_new_tokens=2)
    assert forwards.count == 0
    assert manager.stats()["sessions"] == 0


def test_a_request_past_the_models_positions_is_refused_before_anything_runs(tiny_target):
    manager = _manager()
    gen = SuffixReuseGenerator(tiny_target, manager)
    limit = tiny_target.model.config.max_position_embeddings  # 4096
    words = " ".join(["word"] * limit)
    n = 1 + gen.tokens(words).numel() + gen.tokens(Q1).numel()
    assert n > limit
    with Forwards(tiny_target) as forwards:
        with pytest.raises(ValueError, match=rf"{n} context and turn tokens \+ 2 new tokens = {n + 2} positions, "
                                             rf"more than 'tiny-phi3' has \({limit}\)"):
            gen.generate("s", [Part(words), Part(Q1)], max_new_tokens=2)
        # the prompt fits, the tokens to generate do not
        short = 1 + gen.tokens(DOC).numel() + gen.tokens(Q1).numel()
        with pytest.raises(ValueError, match=rf"= {limit + 1} positions"):
            gen.generate("s", [Part(DOC), Part(Q1)], max_new_tokens=limit + 1 - short)
    assert forwards.count == 0 and manager.stats()["sessions"] == 0


def test_a_longrope_target_refuses_generation_past_its_original_window():
    """kvcache.generate over cached KV must not run past original_max_position_embeddings: the forwards there
    rotate with the long tables while the cache holds keys rotated with the short ones."""
    import zoo

    lm = zoo.build("phi3-longrope")  # original_max_position_embeddings 256
    ids = torch.randint(3, lm.spec.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    seg = kvcache.extract(lm.model, lm.spec, ids)
    new = torch.tensor([5, 6, 7])
    assert kvcache.generate(lm.model, lm.spec, seg, new, max_new_tokens=50).numel() <= 50  # 253 positions: fine
    with Forwards(lm) as forwards:
        with pytest.raises(ValueError, match=r"phi3-longrope.*longrope RoPE .* below 256 tokens"):
            kvcache.generate(lm.model, lm.spec, seg, new, max_new_tokens=60)
    assert forwards.count == 0


def test_a_longrope_target_refuses_a_request_crossing_its_window_before_anything_runs():
    import zoo
    from kvbridge.transfer.models import random_model
    from kvbridge.transfer.tiny_pair import build_tiny_tokenizer

    tok = build_tiny_tokenizer("sentencepiece")
    config = zoo.configs()["phi3-longrope"]
    config.vocab_size = len(tok)
    lm = random_model(config, "phi3-longrope", tokenizer=tok, device="cpu")
    manager = _manager()
    gen = SuffixReuseGenerator(lm, manager)
    n = 1 + gen.tokens(DOC).numel() + gen.tokens(Q1).numel()
    gen.generate("s2", [Part(DOC), Part(Q1)], max_new_tokens=256 - n)  # up to position 255: fine
    with Forwards(lm) as forwards, pytest.raises(ValueError, match=r"longrope RoPE .* below 256 tokens"):
        gen.generate("s", [Part(DOC), Part(Q1)], max_new_tokens=257 - n)
    assert forwards.count == 0 and manager.stats()["sessions"] == 1


class BadSource:
    def __init__(self, lm, spoil):
        self.lm, self.spoil = lm, spoil

    def projected_segment(self, text, offset):
        return self.spoil(_own_kv(self.lm, text), offset)


def _with(seg: KVSegment, **changes) -> KVSegment:
    fields = dict(kv=seg.kv, token_ids=seg.token_ids, positions=seg.positions, model=seg.model, rotated=seg.rotated)
    return KVSegment(**{**fields, **changes})


@pytest.mark.parametrize("spoil, message", [
    (lambda s, o: _with(s, kv=s.kv[:, :, :, :0], token_ids=s.token_ids[:0], positions=s.positions[:0]),
     r"KV for 0 tokens, expected the part's \d+ tokens"),
    (lambda s, o: s.slice(0, s.num_tokens - 1), r"KV for \d+ tokens, expected the part's \d+ tokens"),
    (lambda s, o: _with(s, rotated=False), r"un-rotated keys"),
    (lambda s, o: _with(s, positions=torch.full_like(s.positions, o)), r"positions 1, 1, 1.*expected 1\.\.\d+"),
    (lambda s, o: _with(s, positions=s.positions + 3), r"positions 4, 5, 6.*expected 1\.\.\d+"),
    (lambda s, o: _with(s, model=ModelIdentity("another-model", "0" * 64)), r"KV of another-model@0000.*tiny-phi3"),
    (lambda s, o: _with(s, kv=s.kv.double()), r"dtype torch.float64"),
    (lambda s, o: _with(s, kv=s.kv[:, :, :2]), r"layout \(6, 2, 2, \d+, 16\).*expected \(6, 2, 6, \d+, 16\)"),
    (lambda s, o: _with(s, token_ids=s.token_ids.flip(0)), r"KV of other tokens than the part's"),
])
def test_a_bad_projected_segment_is_refused_by_name(tiny_target, spoil, message):
    gen = SuffixReuseGenerator(tiny_target, context_source=BadSource(tiny_target, spoil), induction_prior=False)
    with pytest.raises(ValueError, match=r"the context source's segment for part 1: " + message):
        gen.generate("s", [Part(DOC, "document", projected=True), Part(Q1)], max_new_tokens=2)


def test_a_part_too_large_for_the_store_is_served_uncached(tiny_target):
    lm = tiny_target
    per_token = lm.spec.kv_bytes_per_token
    manager = _manager(capacity=per_token * 16 * 4)  # 4 blocks of 16 tokens
    gen = SuffixReuseGenerator(lm, manager)
    big = "A long system prompt about many things. " * 20
    request = [Part(big, "system"), Part(Q1)]
    out, m = gen.generate("s", request, max_new_tokens=4)
    assert m.parts == ["prefilled", "prefilled"]
    assert torch.equal(out, SuffixReuseGenerator(lm).generate("s", request, max_new_tokens=4)[0])
    assert manager.stats()["segments"] == 0 and manager.stats()["not_stored"] == 1
    small = [Part("A short prompt.", "system"), Part(Q1)]
    gen.generate("s", small, max_new_tokens=2)
    assert gen.generate("s", small, max_new_tokens=2)[1].parts == ["exact", "prefilled"]  # the manager still works


def test_threads_sharing_a_model_never_run_through_each_others_prior(tiny_target):
    """Thread a reads a projected document with a strong prior; thread b, started while a is inside its reading,
    runs a plain request on the same model: b's forwards wait for a's to end, and both get their tokens alone."""
    lm = tiny_target
    prior = InductionPrior(3 * torch.ones(4, lm.spec.num_layers, lm.model.config.num_attention_heads))

    class Own:
        def projected_segment(self, text, offset):
            return _own_kv(lm, text)

    doc = "the doc text a b c d e f a b c d e f " * 4
    projected = [Part(doc, "document", projected=True), Part("q a b")]
    plain = [Part("Some other user's question about json and files"), Part("and what now")]
    alone_a = SuffixReuseGenerator(lm, None, context_source=Own(), induction_prior=prior).generate(
        "a", projected, max_new_tokens=12)[0]
    alone_b = SuffixReuseGenerator(lm, None).generate("b", plain, max_new_tokens=12)[0]

    inside = threading.Event()  # a is inside its reading
    started = threading.Event()  # b is about to generate
    overlaps, results, errors = [], {}, []

    class Pausing:  # the prior, starting b once a's reading has begun
        terms = prior.terms

        def from_layer(self, first):
            return self

        def reading(self, lm_, ids, still):
            class Block:
                def __enter__(self):
                    self.inner = prior.reading(lm_, ids, still)
                    self.inner.__enter__()
                    inside.set()
                    if b_thread.ident is None:
                        b_thread.start()
                        started.wait()

                def __exit__(self, *exc):
                    inside.clear()
                    return self.inner.__exit__(*exc)

            return Block()

    def run(name, gen, parts):
        try:
            if name == "b":
                started.set()
            results[name] = gen.generate(name, parts, max_new_tokens=12)[0]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {type(exc).__name__}: {exc}")

    gen_a = SuffixReuseGenerator(lm, None, context_source=Own(), induction_prior=Pausing())
    gen_b = SuffixReuseGenerator(lm, None)
    b_thread = threading.Thread(target=run, args=("b", gen_b, plain))
    handle = lm.model.register_forward_pre_hook(
        lambda *_: overlaps.append(inside.is_set()) if threading.current_thread() is b_thread else None)
    try:
        a_thread = threading.Thread(target=run, args=("a", gen_a, projected))
        a_thread.start()
        a_thread.join()
        b_thread.join()
    finally:
        handle.remove()
    assert errors == []
    assert overlaps and not any(overlaps), "b ran forwards while a was reading with its prior"
    assert torch.equal(results["a"], alone_a) and torch.equal(results["b"], alone_b)
