"""The scalable adapter trainer on the tiny pair: teacher cache, ridge from the cache, the residual maps, the
attention-matching and KL objectives; determinism, resume, and a planted attention-output optimum."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from kvbridge.adapters.adapter import project
from kvbridge.adapters.losses import AttentionGeometry, attention_loss, continuation_logp
from kvbridge.adapters.map_kv import project_window
from kvbridge.adapters.pairs import pair_text, start_token_id
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps, fit_ridge
from kvbridge.adapters.teacher import TeacherCache, TeacherConfig, Window, is_heldout
from kvbridge.adapters.trainer import TrainerConfig, batch_indices, exact_tail_tokens, train
from kvbridge.transfer import kvcache
from safetensors.torch import save_file

WORDS = ("the a model reads text once and keeps its cache in blocks while another model of a different family "
         "generates from the projected keys and values without reading the document again").split()
TEACHER = TeacherConfig(context_tokens=24, continuation_tokens=8, topk=8, query_positions="all")  # (one test matches
# every query)


def _text(rng: random.Random, n: int = 60) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


@pytest.fixture(scope="module")
def pair():
    from kvbridge.transfer.presets import load_pair

    return load_pair("tiny", device="cpu")


@pytest.fixture(scope="module")
def cache(pair, tmp_path_factory):
    source, target = pair
    rng = random.Random(0)
    windows = [Window(f"doc:{i // 2}/{i % 2}", f"doc:{i // 2}", _text(rng)) for i in range(16)]
    root = tmp_path_factory.mktemp("teacher")
    c = TeacherCache(root)
    c.build(source, target, windows, TEACHER, start_token_id(target.tokenizer), progress=False)
    assert len(c) == 16
    return c


@pytest.fixture(scope="module")
def ridge(pair, cache):
    _, target = pair
    adapter, stats = fit_ridge(cache, list(range(12)), list(range(12, 16)), target, progress=False)
    return adapter, stats


@pytest.fixture(scope="module")
def ridge_tok(pair, cache):
    _, target = pair
    return fit_ridge(cache, list(range(12)), list(range(12, 16)), target, progress=False, token_rank=4)


@pytest.fixture(scope="module")
def ridge_basis(pair, cache):
    _, target = pair
    return fit_ridge(cache, list(range(12)), list(range(12, 16)), target, progress=False, token_rank=4, source_rank=6)


@pytest.fixture(params=["source features", "with token features", "with a source basis"])
def either_ridge(request, ridge, ridge_tok, ridge_basis):
    return {"source features": ridge, "with token features": ridge_tok, "with a source basis": ridge_basis}[
        request.param]


def _maps(ridge, capacity=None, seed=0):
    torch.manual_seed(seed)
    return ResidualMaps(ridge[0], ridge[1], capacity or CapacityConfig())


def test_split_by_document_id_is_deterministic_and_order_free():
    ids = [f"kernel:{i:05d}" for i in range(2000)]
    held = [i for i in ids if is_heldout(i, 0.1)]
    assert held == [i for i in reversed(ids) if is_heldout(i, 0.1)][::-1]
    assert 120 < len(held) < 280


def test_teacher_cache_holds_the_targets_own_kv_and_is_resumable(pair, cache):
    source, target = pair
    w = cache.load(0)
    seg = kvcache.extract(target.model, target.spec, w["ids"])
    assert torch.equal(seg.keys.to(torch.bfloat16), w["k"])
    assert torch.equal(seg.values.to(torch.bfloat16), w["v"])
    before = len(cache)
    again = TeacherCache(cache.root)  # a rerun finds every window done
    stats = again.build(source, target, [Window("doc:0/0", "doc:0", "ignored")], TEACHER,
                        start_token_id(target.tokenizer), progress=False)
    assert stats["windows"] == 0 and len(again) == before


def test_zero_residual_projects_like_adapter_project(pair, either_ridge):
    ridge = either_ridge
    source, target = pair
    maps = _maps(ridge, CapacityConfig(rank=8, joint=True))
    text = _text(random.Random(5))
    paired = pair_text(text, source.tokenizer, target.tokenizer)
    seg = kvcache.extract(source.model, source.spec, paired.source_ids)
    want = project(ridge[0], seg, paired.alignment, paired.target_ids, source.rope, target.rope, dtype=torch.float32)
    from kvbridge.adapters.teacher import source_features
    xk, xv = source_features(source, paired.source_ids, paired.alignment.source_index)
    start = (paired.alignment.source_index < 0) & (paired.target_ids == start_token_id(target.tokenizer))
    k, v = project_window(maps, ridge[0].start_kv, xk, xv, start, target, paired.target_ids)
    torch.testing.assert_close(k, want.keys, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v, want.values, atol=1e-4, rtol=1e-4)


def test_linear_residual_folds_into_an_exact_adapter(pair, either_ridge):
    ridge = either_ridge
    maps = _maps(ridge)
    with torch.no_grad():
        for p in maps.parameters():
            p.normal_(std=0.3)
    folded = maps.to_adapter(ridge[0])
    src = ridge[0].meta.source  # the source KV as the maps take it: every source layer
    x = torch.randn(src["num_layers"], 7, src["num_kv_heads"] * src["head_dim"])
    from kvbridge.adapters.adapter import map_tokens
    ids = torch.randint(0, pair[1].model.get_input_embeddings().weight.shape[0], (7,))
    yk, yv = maps(x, 2 * x, ids)
    fk, fv = map_tokens(folded, x, 2 * x, target_ids=ids)
    assert folded.token_rank == ridge[0].token_rank and folded.source_rank == ridge[0].source_rank
    torch.testing.assert_close(yk, fk, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(yv, fv, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("objective,capacity", [("attention", CapacityConfig()),
                                                ("kl", CapacityConfig(rank=8, joint=True))])
def test_same_seed_same_weights(pair, cache, ridge, tmp_path, objective, capacity):
    _, target = pair
    cfg = TrainerConfig(objective=objective, capacity=capacity, max_iters=4, warmup_iters=1, batch_windows=2,
                        eval_interval=2, lr=1e-2, min_lr=1e-3)
    runs = []
    for name in ("a", "b"):
        maps = _maps(ridge, capacity)
        train(maps, ridge[0].start_kv, target, cache, list(range(12)), None, cfg, TEACHER.context_tokens,
              tmp_path / name, progress=False)
        runs.append(maps.state_dict())
    changed = [n for n, p in _maps(ridge, capacity).state_dict().items() if not torch.equal(p, runs[0][n])]
    assert changed  # training moved something
    for n in runs[0]:
        assert torch.equal(runs[0][n], runs[1][n]), n


def test_resume_matches_an_uninterrupted_run(pair, cache, ridge, tmp_path):
    _, target = pair
    cfg = TrainerConfig(objective="attention", max_iters=6, warmup_iters=1, batch_windows=2, eval_interval=3,
                        lr=1e-2, min_lr=1e-3)
    whole = _maps(ridge)
    rec_whole = train(whole, ridge[0].start_kv, target, cache, list(range(12)), None, cfg, TEACHER.context_tokens,
                      tmp_path / "whole", progress=False)
    part = _maps(ridge)
    train(part, ridge[0].start_kv, target, cache, list(range(12)), None, cfg, TEACHER.context_tokens,
          tmp_path / "part", progress=False, until=3)
    resumed = _maps(ridge, seed=123)  # other initial state: everything must come from the checkpoint
    rec = train(resumed, ridge[0].start_kv, target, cache, list(range(12)), None, cfg, TEACHER.context_tokens,
                tmp_path / "part", resume=True, progress=False)
    assert rec["iters"] == rec_whole["iters"] == 6
    for n, p in whole.state_dict().items():
        assert torch.equal(p, resumed.state_dict()[n]), n
    # a checkpoint written before a config field existed resumes under its default; another value is refused
    from safetensors import safe_open

    last = tmp_path / "part" / "last.safetensors"
    with safe_open(str(last), "pt") as f:
        state, tensors = json.loads(f.metadata()["state"]), {k: f.get_tensor(k) for k in f.keys()}
    del state["config"]["decision_weight"]
    save_file(tensors, str(last), metadata={"state": json.dumps(state)})
    again = train(_maps(ridge), ridge[0].start_kv, target, cache, list(range(12)), None, cfg, TEACHER.context_tokens,
                  tmp_path / "part", resume=True, progress=False)
    assert again["iters"] == 6
    with pytest.raises(ValueError, match="another config"):
        train(_maps(ridge), ridge[0].start_kv, target, cache, list(range(12)), None,
              dataclasses.replace(cfg, decision_weight=2.0), TEACHER.context_tokens, tmp_path / "part", resume=True,
              progress=False)


def test_attention_matching_recovers_a_planted_optimum(pair, cache, ridge, tmp_path):
    """Rewrite the cached target K/V as an exact linear map of the source (the ridge map plus a planted residual);
    attention matching, started from the ridge map, must drive the loss near zero and find the planted V map."""
    _, target = pair
    planted = _maps(ridge)
    with torch.no_grad():
        planted.dw_k.normal_(std=0.5)
        planted.dw_v.normal_(std=0.5)
    root = tmp_path / "planted"
    root.mkdir()
    for i, e in enumerate(cache.entries):
        w = cache.load(i)
        with torch.no_grad():
            k, v = project_window(planted, ridge[0].start_kv, w["xk"].float(), w["xv"].float(), w["start_mask"],
                                  target, w["ids"])
        w["k"], w["v"] = k.to(torch.bfloat16), v.to(torch.bfloat16)
        w["xk"], w["xv"] = w["xk"], w["xv"]
        save_file({n: t.contiguous() for n, t in w.items()}, str(root / e["file"]))
    (root / "index.json").write_text(cache.index_path.read_text())
    planted_cache = TeacherCache(root)
    geometry = AttentionGeometry(target)
    maps = _maps(ridge)

    def loss():
        with torch.no_grad():
            return float(sum(attention_loss(maps, ridge[0].start_kv, planted_cache.load(i), target, geometry,
                                            TEACHER.context_tokens, "all") for i in range(12, 16)))

    before = loss()
    cfg = TrainerConfig(objective="attention", queries="all", max_iters=300, warmup_iters=5, batch_windows=4,
                        eval_interval=1000,
                        lr=1e-1, min_lr=1e-3)
    train(maps, ridge[0].start_kv, target, planted_cache, list(range(12)), None, cfg, TEACHER.context_tokens,
          tmp_path / "run", progress=False)
    after = loss()
    assert after < 0.05 * before, (before, after)
    err = (maps.to_adapter(ridge[0]).wv - planted.to_adapter(ridge[0]).wv).norm()
    start_err = (ridge[0].wv - planted.to_adapter(ridge[0]).wv).norm()
    assert err < 0.5 * start_err, (float(err), float(start_err))


def test_recovery_probe_brackets_full_and_none(pair, cache, ridge):
    _, target = pair
    probe = RecoveryProbe.from_cache(target, ridge[0].start_kv, cache, [12, 13, 14, 15], TEACHER.context_tokens)
    r = probe.recovery(_maps(ridge), wrong=True)
    lo, hi = r["interval"]
    assert r["documents"] == 4 and lo <= r["recovery"] <= hi
    assert set(r["nll"]) == {"none", "full", "projected"}
    assert r["wrong_interval"][0] <= r["wrong"] <= r["wrong_interval"][1]
    assert r["own_minus_wrong"] == pytest.approx(r["recovery"] - r["wrong"])


def test_exact_tail_scores_the_continuation_after_an_exact_recompute(pair, cache, ridge):
    """With the context's last k tokens prefilled exactly: an untrained fuser (the target's own cache) gives the
    plain prefill's log-probs for every k, and a projection no longer depends on the source of those k tokens."""
    from kvbridge.adapters.fuser import FuserConfig, FuserMaps

    _, target = pair
    c = TEACHER.context_tokens
    windows = [cache.load(i) for i in (12, 13)]
    for w in windows:  # the cache keeps the target's K/V in bf16: the exact ones here
        seg = kvcache.extract(target.model, target.spec, w["ids"])
        w["k"], w["v"] = seg.keys.float(), seg.values.float()
    fuser = FuserMaps.from_ridge(ridge[0], ridge[1], FuserConfig(rank=4))
    ids = torch.stack([w["ids"] for w in windows])
    with torch.no_grad():
        plain = target.model(input_ids=ids).logits[:, 1 + c:-1].float().log_softmax(-1)
        for k in (0, 1, 7):
            got = continuation_logp(fuser, None, windows, target, c, exact=k)
            assert got.shape == plain.shape
            torch.testing.assert_close(got, plain, atol=2e-4, rtol=0)
    probe = RecoveryProbe.from_cache(target, None, cache, [12, 13, 14, 15], c)
    for it in probe.items:
        seg = kvcache.extract(target.model, target.spec, it.context_ids)
        it.k, it.v = seg.keys.float(), seg.values.float()
    assert probe.recovery(fuser, exact=7)["recovery"] == pytest.approx(1.0, abs=1e-4)

    maps, k = _maps(ridge), 6
    probe = RecoveryProbe.from_cache(target, ridge[0].start_kv, cache, [12, 13, 14, 15], c)
    before = {e: probe.per_document(maps, exact=e) for e in (0, k)}
    for it in probe.items:  # another source for the last k context tokens only
        it.xk[:, -k:] = torch.randn_like(it.xk[:, -k:]) * 3
        it.xv[:, -k:] = torch.randn_like(it.xv[:, -k:]) * 3
    assert probe.per_document(maps, exact=k) == pytest.approx(before[k], rel=1e-5)
    assert probe.per_document(maps) != pytest.approx(before[0], rel=1e-3)
    with pytest.raises(ValueError, match="exact must be in"):
        continuation_logp(maps, ridge[0].start_kv, windows, target, c, exact=c)


def test_exact_tail_draws_and_config():
    config = TrainerConfig(objective="kl", exact_tail=0.25, warmup_iters=0, max_iters=10)
    draws = [exact_tail_tokens(config, it, 192) for it in range(400)]
    assert draws == [exact_tail_tokens(config, it, 192) for it in range(400)]  # a function of (seed, it)
    assert 150 < draws.count(0) < 250 and max(draws) == 48 and min(d for d in draws if d) == 1
    assert exact_tail_tokens(dataclasses.replace(config, exact_tail=0.0), 3, 192) == 0
    with pytest.raises(ValueError, match="exact_tail is for the end-to-end objectives"):
        dataclasses.replace(config, objective="attention")
    with pytest.raises(ValueError, match="exact_tail must be in"):
        dataclasses.replace(config, exact_tail=1.0)


def test_training_with_exact_tails_scores_dev_on_both(pair, cache, ridge, tmp_path):
    _, target = pair
    c = TEACHER.context_tokens
    probe = RecoveryProbe.from_cache(target, ridge[0].start_kv, cache, [12, 13, 14, 15], c)
    config = TrainerConfig(objective="kl", exact_tail=0.5, lr=1e-3, min_lr=1e-4, warmup_iters=0, max_iters=2,
                           eval_interval=1)
    out = train(_maps(ridge), ridge[0].start_kv, target, cache, list(range(12)), probe, config, c, tmp_path,
                progress=False)
    tail = round(0.5 * c / 2)
    for row in out["record"]:
        assert row["dev_recovery"] == pytest.approx((row["dev_recovery_replace"] + row[f"dev_recovery_exact_{tail}"])
                                                    / 2)
    assert out["best"] == max(row["dev_recovery"] for row in out["record"])


def test_a_teacher_cache_without_queries_serves_kl_and_refuses_attention(pair, cache, ridge, tmp_path):
    source, target = pair
    rng = random.Random(1)
    windows = [Window(f"doc:{i}/0", f"doc:{i}", _text(rng)) for i in range(3)]
    light = TeacherCache(tmp_path / "light")
    light.build(source, target, windows[:2], dataclasses.replace(TEACHER, queries=False),
                start_token_id(target.tokenizer), progress=False)
    assert "q" not in light.load(0) and {"k", "v", "xk", "top_logp"} <= set(light.load(0))
    c = TEACHER.context_tokens
    kl = TrainerConfig(objective="kl", warmup_iters=0, max_iters=1, eval_interval=1)
    train(_maps(ridge), ridge[0].start_kv, target, light, [0, 1], None, kl, c, tmp_path / "kl", progress=False)
    with pytest.raises(ValueError, match="built without them"):
        train(_maps(ridge), ridge[0].start_kv, target, light, [0, 1], None,
              dataclasses.replace(kl, objective="attention"), c, tmp_path / "att", progress=False)
    # a cache that keeps the queries (one from before the option: no "queries" in its index) serves a run that
    # does not need them, and its new windows keep them
    full = TeacherCache(tmp_path / "full")
    full.build(source, target, windows[:1], TEACHER, start_token_id(target.tokenizer), progress=False)
    index = json.loads(full.index_path.read_text())
    del index["config"]["queries"]
    full.index_path.write_text(json.dumps(index))
    full = TeacherCache(tmp_path / "full")
    full.build(source, target, windows, dataclasses.replace(TEACHER, queries=False),
               start_token_id(target.tokenizer), progress=False)
    assert len(full) == 3 and all("q" in full.load(i) for i in range(3))
    with pytest.raises(ValueError, match="another configuration"):
        TeacherCache(tmp_path / "light").build(source, target, windows, TEACHER, start_token_id(target.tokenizer),
                                               progress=False)


def test_a_draw_of_a_window_the_teacher_cache_left_out_is_refused(pair, cache, ridge, tmp_path):
    """chain.windows_read leaves windows no step draws out of the cache (-1 in the index list): a step that drew one
    anyway is an error, never the cache's last window read in its place."""
    _, target = pair
    cfg = TrainerConfig(objective="kl", max_iters=2, warmup_iters=1, batch_windows=2, eval_interval=2, lr=1e-2,
                        min_lr=1e-3)
    drawn = set(batch_indices(cfg.seed, 2, 0, 12))
    train_idx = [-1 if i in drawn else i for i in range(12)]
    with pytest.raises(RuntimeError, match="step 0 draws a training window the teacher cache does not hold"):
        train(_maps(ridge), ridge[0].start_kv, target, cache, train_idx, None, cfg, TEACHER.context_tokens,
              tmp_path / "left-out", progress=False)


def test_a_run_that_stopped_early_stays_stopped_when_resumed(pair, cache, ridge, tmp_path):
    """With patience, a run stops after evaluations without a better dev score and writes its last checkpoint there;
    a rerun with resume=True did not see that it had stopped, trained on and could replace its best checkpoint."""
    _, target = pair
    probe = RecoveryProbe.from_cache(target, ridge[0].start_kv, cache, list(range(12, 16)), TEACHER.context_tokens)
    # a rate that makes things worse: the dev recovery falls after step 0 and patience 2 stops the run early
    cfg = TrainerConfig(objective="kl", max_iters=12, warmup_iters=0, batch_windows=2, eval_interval=1, lr=3.0,
                        min_lr=3.0, patience=2)
    runs = [train(_maps(ridge), ridge[0].start_kv, target, cache, list(range(12)), probe, cfg, TEACHER.context_tokens,
                  tmp_path / "stage", resume=resume, progress=False) for resume in (False, True)]
    assert runs[0]["iters"] < cfg.max_iters  # it stopped early
    assert (runs[1]["iters"], len(runs[1]["record"]), runs[1]["best_iter"]) == (
        runs[0]["iters"], len(runs[0]["record"]), runs[0]["best_iter"])
