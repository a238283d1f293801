"""The target's segment cache: sessions isolated, session TTL and topic changes flush (injected clock), the value
scorer routes segments by its thresholds and learns from hits; reuse at new positions: exact with the same
prefix, measured deviation otherwise, and recompute lowers it."""

from __future__ import annotations

import pytest
import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.suffix.cache_manager import ManagerConfig, SuffixCacheManager
from kvbridge.transfer.suffix.reuse import deviation, place, recompute_first
from kvbridge.transfer.suffix.value_score import FixedScorer, OnlineValueScorer, SegmentFeatures


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _ids(lm, text: str) -> torch.Tensor:
    return torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.fixture()
def setup(tiny_target):
    clock = Clock()
    store = PagedStore(StoreConfig(capacity_bytes=16 << 20, device="cpu"), clock=clock)
    return tiny_target, store, clock


def _segment(lm, text: str, start: int = 0):
    return kvcache.extract(lm.model, lm.spec, _ids(lm, text), start_position=start)


def test_sessions_never_see_each_others_segments(setup):
    lm, store, _ = setup
    manager = SuffixCacheManager(store, scorer=FixedScorer(0.9))
    seg = _segment(lm, "You are a careful assistant who answers briefly.")
    offer = manager.offer("a", seg, torch.tensor([], dtype=torch.int64), role="system")
    assert offer.decision == "keep" and offer.key is not None
    assert manager.find("b", seg.token_ids, seg.model, seg.dtype) is None
    found = manager.find("a", seg.token_ids, seg.model, seg.dtype)
    assert found is not None and torch.equal(found.segment.kv, seg.kv) and found.prefix_hash == ""
    # the same tokens offered by b: its own entry, its own key
    assert manager.offer("b", seg, torch.tensor([], dtype=torch.int64)).key != offer.key


def test_scores_route_segments_by_the_thresholds(setup):
    lm, store, clock = setup
    seg = _segment(lm, "Every record holds a name and a value.")
    none = torch.tensor([], dtype=torch.int64)
    for score, decision, ttl in ((0.9, "keep", None), (0.85, "keep", None), (0.7, "ttl", 1800.0),
                                 (0.6, "ttl", 1800.0), (0.59, "skip", None)):
        manager = SuffixCacheManager(store, tenant=f"t{score}", scorer=FixedScorer(score))
        offer = manager.offer("s", seg, none)
        assert offer.decision == decision, score
        if decision == "skip":
            assert offer.key is None and manager.find("s", seg.token_ids, seg.model, seg.dtype) is None
        else:
            info = store.info(offer.key, manager._namespace("s"))
            assert info.expires_at == (None if ttl is None else clock.now + ttl)
    # a mid-value segment is gone after its 30 minutes even while the session stays active
    manager = SuffixCacheManager(store, tenant="mid", scorer=FixedScorer(0.7))
    manager.offer("s", seg, none)
    for _ in range(7):
        clock.now += 299
        manager.begin_turn("s", "Every record holds a name and a value, and more.")
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is None


def test_a_kept_segment_never_expires_in_a_store_with_a_default_ttl(tiny_target):
    """A segment scored to keep is kept without a TTL; a store whose entries get a default TTL (serve --default-ttl-s)
    gave it that one, and its expiry taught the scorer the segment it rated most went unused."""
    clock = Clock()
    store = PagedStore(StoreConfig(capacity_bytes=16 << 20, device="cpu", default_ttl_s=60.0), clock=clock)
    manager = SuffixCacheManager(store, scorer=FixedScorer(0.9))
    seg = _segment(tiny_target, "You are a careful assistant who answers briefly.")
    offer = manager.offer("s", seg, torch.tensor([], dtype=torch.int64), role="system")
    assert offer.decision == "keep" and store.info(offer.key, manager._namespace("s")).expires_at is None
    clock.now += 61  # the session stays (its TTL is 300 s); the store's default would have taken the entry
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is not None
    mid = SuffixCacheManager(store, tenant="mid", scorer=FixedScorer(0.7))
    assert store.info(mid.offer("s", seg, torch.tensor([], dtype=torch.int64)).key,
                      mid._namespace("s")).expires_at == clock.now + 1800.0  # a mid score's own TTL, as before


def test_session_ttl_flushes_with_an_injected_clock(setup):
    lm, store, clock = setup
    manager = SuffixCacheManager(store, scorer=FixedScorer(0.9), config=ManagerConfig(session_ttl_s=300))
    seg = _segment(lm, "The configuration file is read once at start-up.")
    manager.offer("s", seg, torch.tensor([], dtype=torch.int64))
    clock.now = 299
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is not None  # and the find keeps the session alive
    clock.now = 598
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is not None
    clock.now = 898
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is None
    assert store.keys(manager._namespace("s")) == [] and store.check() == []


def test_a_change_of_topic_drops_the_temperature_and_flushes(setup):
    lm, store, _ = setup
    manager = SuffixCacheManager(store, scorer=FixedScorer(0.9))
    seg = _segment(lm, "Sockets connect a client to a server over the network.")
    first = manager.begin_turn("s", "How do I open a socket connection to a server in Python?")
    assert first.cosine is None and first.temperature == 0.8
    manager.offer("s", seg, torch.tensor([], dtype=torch.int64))
    same = manager.begin_turn("s", "And how do I close the socket connection to the server?")
    assert same.cosine >= 0.3 and same.temperature == 0.8 and same.flushed == 0
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is not None
    other = manager.begin_turn("s", "Give me a recipe for banana bread with walnuts.")
    assert other.cosine < 0.3 and other.temperature == 0.3 and other.flushed == 1
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is None
    warmer = manager.begin_turn("s", "Is this banana bread recipe good with walnuts?")
    assert warmer.temperature == pytest.approx(0.55)


def test_the_online_scorer_learns_which_segments_get_hit():
    scorer = OnlineValueScorer(prior=0.7)
    system = SegmentFeatures(num_tokens=40, role="system", position=0, repeats=2, temperature=0.8)
    turn = SegmentFeatures(num_tokens=25, role="turn", position=300, repeats=0, temperature=0.3)
    assert scorer.score(system) == scorer.score(turn) == 0.7  # nothing learned yet
    for _ in range(60):
        scorer.observe(system, hit=True)
        scorer.observe(turn, hit=False)
    assert scorer.score(system) > 0.85 and scorer.score(turn) < 0.6


def test_the_manager_feeds_hits_and_unused_expiries_to_its_scorer(setup):
    lm, store, clock = setup
    seen = []

    class Recorder(FixedScorer):
        def observe(self, features, hit):
            seen.append((features.role, hit))

    manager = SuffixCacheManager(store, scorer=Recorder(0.7), config=ManagerConfig(mid_ttl_s=100))
    none = torch.tensor([], dtype=torch.int64)
    used = _segment(lm, "Shared system prompt of this assistant.")
    unused = _segment(lm, "A turn nobody will ask for again.", start=30)
    manager.offer("s", used, none, role="system")
    manager.offer("s", unused, used.token_ids, role="turn")
    manager.find("s", used.token_ids, used.model, used.dtype)
    clock.now = 150
    manager.begin_turn("s", "next")
    assert seen == [("system", True), ("turn", False)]


# ------------------------------------------------------------------------------------------------ reuse


def test_shifted_reuse_with_the_same_prefix_is_exact(tiny_target):
    lm = tiny_target
    ids = _ids(lm, "Readers skip the fields they do not understand. Writers keep the field order.")
    cached = kvcache.extract(lm.model, lm.spec, ids)  # computed at positions 0..
    for delta in (5, 200):
        moved = place(cached, lm.rope, delta)
        own = kvcache.extract(lm.model, lm.spec, ids, start_position=delta)
        d = deviation(moved, own)
        assert d.keys < 1e-5 and d.values < 1e-5, d.line()


def test_reuse_after_another_prefix_reports_its_deviation_and_recompute_lowers_it(tiny_target):
    lm = tiny_target
    segment_ids = _ids(lm, "The parser returns a tree of nodes, one for each statement in the source file.")
    old_prefix = _ids(lm, "Question about the json module:")
    new_prefix = _ids(lm, "Here is a long and different introduction about compilers and their front ends:")
    cached = kvcache.extract(lm.model, lm.spec, torch.cat((old_prefix, segment_ids))).slice(
        old_prefix.numel(), old_prefix.numel() + segment_ids.numel())
    context = kvcache.extract(lm.model, lm.spec, new_prefix)
    exact = kvcache.extract(lm.model, lm.spec, torch.cat((new_prefix, segment_ids))).slice(
        new_prefix.numel(), new_prefix.numel() + segment_ids.numel())
    placed = place(cached, lm.rope, new_prefix.numel())
    errors = []
    for k in (0, 2, 4, 8, 16, segment_ids.numel()):
        d = deviation(recompute_first(lm, context, placed, k), exact)
        errors.append(d.keys + d.values)
    assert errors[0] > 1e-3  # a different prefix: an approximation, and the deviation says how far
    assert all(a >= b for a, b in zip(errors, errors[1:])), errors  # recompute lowers it, monotonically
    assert errors[-1] < 1e-5  # recomputing every token is the model's own KV


def test_recompute_of_the_most_deviating_tokens_lowers_the_deviation(tiny_target):
    from kvbridge.transfer.suffix.reuse import checked_layer_deviation, recompute_most_deviating, recompute_selected

    lm = tiny_target
    segment_ids = _ids(lm, "The parser returns a tree of nodes, one for each statement in the source file.")
    old_prefix = _ids(lm, "Question about the json module:")
    new_prefix = _ids(lm, "Here is a long and different introduction about compilers and their front ends:")
    n = segment_ids.numel()
    cached = kvcache.extract(lm.model, lm.spec, torch.cat((old_prefix, segment_ids))).slice(
        old_prefix.numel(), old_prefix.numel() + n)
    context = kvcache.extract(lm.model, lm.spec, new_prefix)
    exact = kvcache.extract(lm.model, lm.spec, torch.cat((new_prefix, segment_ids))).slice(
        new_prefix.numel(), new_prefix.numel() + n)
    placed = place(cached, lm.rope, new_prefix.numel())
    scores = checked_layer_deviation(lm, context, placed, layer=1)
    assert scores.shape == (n,) and float(scores.min()) > 0
    assert float(checked_layer_deviation(lm, context, placed, layer=0).max()) < 1e-5  # layer 0 sees no context
    errors = []
    for fraction in (0.0, 0.1, 0.25, 0.5, 1.0):
        fixed, chosen = recompute_most_deviating(lm, context, placed, fraction)
        assert chosen.numel() == round(fraction * n)
        d = deviation(fixed, exact)
        errors.append(d.keys + d.values)
    assert all(a >= b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5  # every token recomputed with the custom mask: the model's own KV
    assert torch.equal(recompute_selected(lm, context, placed, torch.tensor([], dtype=torch.int64)).kv, placed.kv)


def test_store_evictions_teach_the_online_scorer_until_the_keep_route_fires(tiny_target):
    """Segments the store evicts unused are misses, found ones hits: with both outcomes arriving, the learned score
    of the segments that keep being hit climbs past 0.85 and they are kept without TTL."""
    lm = tiny_target
    system = _segment(lm, "You are the assistant of the documentation team. Answer briefly.")
    layout_block = lm.spec.num_layers * 2 * lm.spec.num_kv_heads * 16 * lm.spec.head_dim * 4
    # room for 6 blocks of this model's KV: every new turn pushes the oldest unused turn out (no tier below)
    store = PagedStore(StoreConfig(capacity_bytes=6 * layout_block, max_layouts=1, device="cpu"), clock=Clock())
    scorer = OnlineValueScorer(prior=0.7)
    manager = SuffixCacheManager(store, scorer=scorer)
    none = torch.tensor([], dtype=torch.int64)
    decisions, turns = [], []
    for turn in range(80):
        decisions.append(manager.offer("s", system, none, role="system").decision)
        assert manager.find("s", system.token_ids, system.model, system.dtype) is not None
        words = " ".join(f"w{turn}x{i}" for i in range(6))
        turns.append(manager.offer("s", _segment(lm, f"Turn {turn}: {words}.", start=system.num_tokens),
                                   system.token_ids, role="turn").decision)
    lost = store.stats().lost_entries
    assert lost >= 5, "the small store should have evicted unused turns"
    assert decisions[0] == "ttl" and decisions[-10:] == ["keep"] * 10, decisions
    # unused turns are mostly no longer cached (the few still tried are how the scorer keeps learning)
    assert turns[0] == "ttl" and turns[-40:].count("skip") >= 30, turns
    manager.stats()  # drains the last evictions
    assert scorer.observations == 80 + lost  # every hit and every eviction reached the scorer
    assert store.check() == []


# ------------------------------------------------------------------------------------------------ bounds


def test_a_sessions_state_stays_bounded(setup):
    from kvbridge.transfer.suffix.cache_manager import HISTORY_TURNS, OFFERED_LIMIT

    lm, store, _ = setup
    manager = SuffixCacheManager(store, scorer=FixedScorer(0.1))  # scores below the cache threshold: none stored
    for turn in range(3 * HISTORY_TURNS):
        info = manager.begin_turn("s", f"How do I read the file number {turn} with the json module?")
        assert info.flushed == 0
    assert len(manager._sessions["s"].turns) == HISTORY_TURNS  # the TF-IDF compares with the last turns only
    seg = _segment(lm, "Every record holds a name and a value.")
    none = torch.tensor([], dtype=torch.int64)
    for i in range(OFFERED_LIMIT + 50):
        manager.offer("s", KVSegment(kv=seg.kv, token_ids=seg.token_ids + i, positions=seg.positions,
                                     model=seg.model, rotated=True), none)
    assert len(manager._sessions["s"].offered) == OFFERED_LIMIT


def test_a_part_the_store_cannot_hold_is_not_cached(tiny_target):
    lm = tiny_target
    store = PagedStore(StoreConfig(capacity_bytes=lm.spec.kv_bytes_per_token * 16 * 2, device="cpu"))
    manager = SuffixCacheManager(store, scorer=FixedScorer(0.9))
    seg = _segment(lm, "A long system prompt about many things. " * 10)
    offer = manager.offer("s", seg, torch.tensor([], dtype=torch.int64))
    assert offer.decision == "full" and offer.key is None
    assert manager.find("s", seg.token_ids, seg.model, seg.dtype) is None
    assert manager.stats()["not_stored"] == 1 and store.check() == []


def test_close_drops_the_managers_segments_and_its_store_listener(setup):
    lm, store, _ = setup
    before = len(store._listeners)
    seg = _segment(lm, "You are a careful assistant who answers briefly.")
    with SuffixCacheManager(store, scorer=FixedScorer(0.9)) as manager:
        assert len(store._listeners) == before + 1
        manager.offer("s", seg, torch.tensor([], dtype=torch.int64))
        assert store.keys(manager._namespace("s")) != []
    assert len(store._listeners) == before and store.keys(manager._namespace("s")) == []
    manager.close()  # twice: nothing more to do
    with pytest.raises(ValueError, match="closed"):
        manager.find("s", seg.token_ids, seg.model, seg.dtype)
    for _ in range(20):  # managers made and closed over one store leave nothing behind
        SuffixCacheManager(store).close()
    assert len(store._listeners) == before
