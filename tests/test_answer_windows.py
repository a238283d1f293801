"""Answer windows and the answer objectives on the tiny pair: what a window holds, the lean teacher cache (queries only
where attention matching reads them) scoring like the full one, a planted answer-distillation optimum recovered
(teacher-forced, with the decision hinge, and on-policy), and the trainer keeping the checkpoint of best dev
fidelity."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch
from kvbridge.adapters.answer_probe import AnswerProbe
from kvbridge.adapters.answer_windows import (
    DEV_INSTRUCTION,
    INSTRUCTIONS,
    AnswerCache,
    AnswerConfig,
    answer_windows,
    document_term,
    instruction_for,
)
from kvbridge.adapters.answering import greedy, greedy_agreement, stop_ids
from kvbridge.adapters.losses import (
    AttentionGeometry,
    answer_context,
    answer_loss,
    attention_loss,
    decision_hinge,
    decision_loss,
    kl_loss,
    onpolicy_loss,
    own_context,
)
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps, fit_ridge
from kvbridge.adapters.teacher import TeacherCache, TeacherConfig, Window
from kvbridge.adapters.trainer import TrainerConfig, batch_indices, train
from kvbridge.eval.summaries import EvalConfig
from kvbridge.transfer import kvcache
from safetensors.torch import load_file, save_file
from test_trainer import _text  # the tiny pair's text of the trainer's tests

ANSWERS = AnswerConfig(lengths=(16, 32, 48), max_answer_tokens=6, topk=8)


@pytest.fixture(scope="module")
def pair():
    from kvbridge.transfer.presets import load_pair

    return load_pair("tiny", device="cpu")


@pytest.fixture(scope="module")
def teacher(pair, tmp_path_factory):
    """The same windows in a full teacher cache (every query) and a lean one (the continuation's queries)."""
    source, target = pair
    rng = random.Random(0)
    windows = [Window(f"doc:{i // 2}/{i % 2}", f"doc:{i // 2}", _text(rng)) for i in range(12)]
    caches = {}
    for positions in ("all", "scored"):
        c = TeacherCache(tmp_path_factory.mktemp(positions))
        c.build(source, target, windows, TeacherConfig(context_tokens=24, continuation_tokens=8, topk=8,
                                                       query_positions=positions),
                start_token_id(target.tokenizer), progress=False)
        caches[positions] = c
    return caches


@pytest.fixture(scope="module")
def ridge(pair, teacher):
    return fit_ridge(teacher["all"], list(range(8)), list(range(8, 12)), pair[1], progress=False)


@pytest.fixture(scope="module")
def answers(pair, tmp_path_factory):
    source, target = pair
    rng = random.Random(1)
    docs = [(f"doc:{i}", _text(rng, 80)) for i in range(10)]
    windows = answer_windows(docs, target.tokenizer, ANSWERS, per_document=2)
    c = AnswerCache(tmp_path_factory.mktemp("answers"))
    c.build(source, target, windows, ANSWERS, start_token_id(target.tokenizer), progress=False)
    assert len(c) >= 16
    return c


def _maps(ridge, seed=0):
    torch.manual_seed(seed)
    return ResidualMaps(ridge[0], ridge[1], CapacityConfig())


def test_lean_teacher_cache_scores_like_the_full_one(pair, teacher, ridge):
    _, target = pair
    geometry, maps = AttentionGeometry(target), _maps(ridge)
    full, lean = teacher["all"], teacher["scored"]
    assert full.load(0)["q"].shape[2] == 1 + 24 + 8 and lean.load(0)["q"].shape[2] == 8
    assert lean.root.joinpath(lean.entries[0]["file"]).stat().st_size < full.root.joinpath(
        full.entries[0]["file"]).stat().st_size
    with torch.no_grad():
        for i in range(4):
            a = attention_loss(maps, ridge[0].start_kv, full.load(i), target, geometry, 24)
            b = attention_loss(maps, ridge[0].start_kv, lean.load(i), target, geometry, 24)
            assert torch.equal(a, b)
        windows = [full.load(i) for i in range(4)], [lean.load(i) for i in range(4)]
        assert torch.equal(kl_loss(maps, ridge[0].start_kv, windows[0], target, 24),
                           kl_loss(maps, ridge[0].start_kv, windows[1], target, 24))
    with pytest.raises(ValueError, match="query_positions 'all'"):  # every query wanted, only the scored kept
        attention_loss(maps, ridge[0].start_kv, lean.load(0), target, geometry, 24, "all")


def test_windows_without_the_targets_kv_score_kl_like_full_ones_and_are_refused_where_it_is_read(pair, teacher,
                                                                                                 ridge, tmp_path):
    """A kl-only window keeps no q, k, v (4.8 MB of 10.7 for the small pair): the kl loss is the same; the ridge
    statistics, the recovery probe and attention matching refuse it by name; asked for with its KV, it is rebuilt."""
    from kvbridge.adapters.recovery_probe import RecoveryProbe

    source, target = pair
    rng = random.Random(0)
    windows = [Window(f"doc:{i // 2}/{i % 2}", f"doc:{i // 2}", _text(rng)) for i in range(12)]
    config = TeacherConfig(context_tokens=24, continuation_tokens=8, topk=8, query_positions="all")
    cache = TeacherCache(tmp_path / "mixed")
    kv_ids = {w.id for w in windows[:4]}
    cache.build(source, target, windows, config, start_token_id(target.tokenizer), progress=False, kv_ids=kv_ids)
    full = teacher["all"]
    assert [cache.has_kv(i) for i in range(12)] == [True] * 4 + [False] * 8
    assert {"q", "k", "v"} <= set(cache.load(0)) and not {"q", "k", "v"} & set(cache.load(5))
    assert cache.root.joinpath(cache.entries[5]["file"]).stat().st_size < 0.6 * full.root.joinpath(
        full.entries[5]["file"]).stat().st_size
    maps = _maps(ridge)
    with torch.no_grad():
        for i in range(4, 12, 4):
            batch = [i, i + 1, i + 2, i + 3]
            assert torch.equal(kl_loss(maps, ridge[0].start_kv, [cache.load(j) for j in batch], target, 24),
                               kl_loss(maps, ridge[0].start_kv, [full.load(j) for j in batch], target, 24))
    fit_ridge(cache, [0, 1, 2], [3], target, progress=False)  # the windows with their KV serve the ridge fit
    with pytest.raises(ValueError, match="4 of its 5 teacher windows .* are lean"):
        fit_ridge(cache, [0, 4, 5, 6, 7], [3], target, progress=False)
    with pytest.raises(ValueError, match="recovery probe .* lean"):
        RecoveryProbe.from_cache(target, ridge[0].start_kv, cache, [3, 8], 24)
    with pytest.raises(ValueError, match="attention stage .* lean"):
        train(_maps(ridge), ridge[0].start_kv, target, cache, [4, 5, 6, 7], None,
              TrainerConfig(objective="attention", max_iters=2, warmup_iters=1, batch_windows=2), 24,
              tmp_path / "stage", progress=False)
    before = cache.load(3)
    made = cache.build(source, target, windows, config, start_token_id(target.tokenizer), progress=False,
                       kv_ids=kv_ids | {windows[8].id})
    assert made["windows"] == 1 and cache.has_kv(8) and len(cache) == 12
    assert TeacherCache(cache.root).has_kv(8) and not TeacherCache(cache.root).has_kv(9)  # (the index says so)
    assert torch.equal(cache.load(8)["k"], full.load(8)["k"])
    assert all(torch.equal(before[k], cache.load(3)[k]) for k in before)


def test_an_answer_window_holds_the_targets_own_greedy_answer(pair, answers):
    _, target = pair
    w = answers.load(0)
    assert set(w) == {"xk", "xv", "start_mask", "ids", "lengths", "top_logp", "top_idx"}  # no q, K or V
    c, q, a = w["lengths"].tolist()
    assert c in ANSWERS.lengths and 1 <= a <= ANSWERS.max_answer_tokens
    assert w["ids"].numel() == 1 + c + q + a and w["xk"].shape[1] == 1 + c
    assert torch.equal(w["top_idx"][:, 0], w["ids"][1 + c + q:])  # greedy: the answer is the teacher's argmax
    own = kvcache.extract(target.model, target.spec, w["ids"][:1 + c])
    again, _ = greedy(target, own, w["ids"][1 + c:1 + c + q], ANSWERS.max_answer_tokens, stop_ids(target),
                      one_line=True)
    assert again == w["ids"][1 + c + q:].tolist()
    lengths = {answers.load(i)["lengths"][0].item() for i in range(len(answers))}
    assert len(lengths) > 1  # lengths are drawn per window


def test_answers_decoded_together_are_the_ones_each_window_gives_alone(pair, answers):
    """The cache decodes the answers of windows with as many document and instruction tokens in one batch
    (answer_window_rows): every window's answer and its teacher log-probs are those of its own greedy decoding."""
    _, target = pair
    shapes = [tuple(answers.load(i)["lengths"][:2].tolist()) for i in range(len(answers))]
    assert max(shapes.count(s) for s in shapes) > 1  # (some windows were decoded together)
    for i in range(len(answers)):
        w = answers.load(i)
        c, q, _ = w["lengths"].tolist()
        own = kvcache.extract(target.model, target.spec, w["ids"][:1 + c])
        scores: list[torch.Tensor] = []
        alone, _ = greedy(target, own, w["ids"][1 + c:1 + c + q], ANSWERS.max_answer_tokens, stop_ids(target),
                          one_line=True, scores=scores)
        assert alone == w["ids"][1 + c + q:].tolist(), i
        top = torch.stack(scores).log_softmax(-1).topk(ANSWERS.topk, dim=-1)
        torch.testing.assert_close(w["top_logp"].float(), top.values, atol=1e-4, rtol=0)


def test_the_probe_scores_answers_decoded_together_as_each_alone(pair, answers, ridge):
    """The dev probe decodes the answers of alike windows together (AnswerProbe.per_window): each window's greedy
    answer over the map's cache, and so its measures, are those of its own decoding."""
    _, target = pair
    maps, start_kv = _maps(ridge, seed=3), ridge[0].start_kv
    indices = list(range(len(answers)))
    rows = AnswerProbe(target, start_kv, answers, indices, ANSWERS.max_answer_tokens).per_window(maps)
    for i in indices:
        w = answers.load(i)
        c, q, _ = w["lengths"].tolist()
        with torch.no_grad():
            seg = answer_context(maps, start_kv, w, target)
        alone, _ = greedy(target, seg, w["ids"][1 + c:1 + c + q], ANSWERS.max_answer_tokens, stop_ids(target),
                          one_line=True)
        assert rows["greedy"][i] == greedy_agreement(alone, w["ids"][1 + c + q:].tolist()), i


def test_a_window_that_makes_none_is_listed_and_not_computed_again(pair, tmp_path):
    """A window that makes no teacher window (here: too short; an answer window answered with nothing) is listed
    in the index as empty, so a resumed build does not compute it again."""
    source, target = pair
    rng = random.Random(3)
    windows = [Window("d:0/0", "d:0", "model"), Window("d:1/0", "d:1", _text(rng, 80))]
    config = TeacherConfig(context_tokens=24, continuation_tokens=8, topk=8)
    cache = TeacherCache(tmp_path / "t")
    made = cache.build(source, target, windows, config, start_token_id(target.tokenizer), progress=False)
    assert (made["windows"], made["computed"]) == (1, 2)
    index = json.loads(cache.index_path.read_text())
    assert index["empty"] == ["d:0/0"] and [e["id"] for e in index["windows"]] == ["d:1/0"]
    again = TeacherCache(tmp_path / "t").build(source, target, windows, config, start_token_id(target.tokenizer),
                                               progress=False)
    assert (again["windows"], again["computed"]) == (0, 0)


def test_a_draw_of_a_window_answered_with_nothing_adds_nothing(pair, answers, ridge, tmp_path):
    """An answer window whose answer is empty keeps its place among the drawn windows (None): a step that draws only
    such windows moves no weight, the next step trains."""
    _, target = pair
    cfg = TrainerConfig(objective="answer", max_iters=1, warmup_iters=0, batch_windows=2, lr=1e-2, min_lr=1e-3)
    idx: list[int | None] = [0, 1, 2, 3]
    for i in batch_indices(cfg.seed, 2, 0, 4):  # step 0 draws two windows answered with nothing
        idx[i] = None
    weights = []
    for steps in (1, 2):
        maps = _maps(ridge)
        train(maps, ridge[0].start_kv, target, answers, idx, None, dataclasses.replace(cfg, max_iters=steps), 0,
              tmp_path / f"run-{steps}", progress=False)
        weights.append(maps.state_dict())
    start = _maps(ridge).state_dict()
    assert all(torch.equal(start[k], weights[0][k]) for k in start)
    assert not all(torch.equal(start[k], weights[1][k]) for k in start)


def test_an_answer_cache_of_other_wordings_is_refused_by_name(pair, answers, monkeypatch):
    """A window's id chooses its instruction among INSTRUCTIONS: windows drawn from other wordings (the cache of a
    run before one of them changed) are another cache, refused before anything in the folder is written."""
    import kvbridge.adapters.answer_windows as module

    source, target = pair
    index = answers.index_path.read_text()
    assert json.loads(index)["instructions"] == list(INSTRUCTIONS)
    monkeypatch.setattr(module, "INSTRUCTIONS", (*INSTRUCTIONS[:1], "\n\nIn one line, what is the text above about?",
                                                 *INSTRUCTIONS[2:]))
    windows = answer_windows([("doc:new", _text(random.Random(5), 80))], target.tokenizer, ANSWERS)
    with pytest.raises(ValueError, match="another configuration .*instructions"):
        AnswerCache(answers.root).build(source, target, windows, ANSWERS, start_token_id(target.tokenizer),
                                        progress=False)
    assert answers.index_path.read_text() == index


def test_instructions_are_chosen_by_window_and_never_the_evaluations():
    text = "The blockpool keeps blocks. A blockpool evicts tails. Nothing else repeats here."
    assert document_term(text, 0) == "blockpool"
    assert instruction_for("doc:1/answer-0", text) == instruction_for("doc:1/answer-0", text)
    made = {instruction_for(f"doc:{i}/answer-0", text) for i in range(200)}
    assert len(made) == len(INSTRUCTIONS)
    assert EvalConfig().instruction not in made and not any("{term}" in m for m in made)
    # the dev windows' wording is neither a training window's nor the evaluation's
    assert instruction_for("doc:1/answer-dev-0", text) == DEV_INSTRUCTION
    assert DEV_INSTRUCTION not in made and DEV_INSTRUCTION != EvalConfig().instruction


def test_answer_windows_take_only_lengths_a_document_holds(pair):
    _, target = pair
    def tokens(text):
        return len(target.tokenizer(text, add_special_tokens=False)["input_ids"])

    rng = random.Random(3)
    short = _text(rng, 200)
    short = short[:target.tokenizer(short, return_offsets_mapping=True, add_special_tokens=False)[
        "offset_mapping"][20][1]]  # 21 tokens: only the length 16 fits
    windows = answer_windows([("d:0", short), ("d:1", _text(rng, 200)), ("d:2", "model")], target.tokenizer,
                             ANSWERS, 3)
    assert tokens(short) == 21 and {w.doc_id for w in windows} == {"d:0", "d:1"}
    assert [tokens(w.text) for w in windows if w.doc_id == "d:0"] == [16, 16, 16]
    assert {tokens(w.text) for w in windows if w.doc_id == "d:1"} <= set(ANSWERS.lengths)


def _planted(ridge, answers: AnswerCache, target, root):
    """Planted maps (the ridge map plus a random residual) and the answer windows rewritten as they would answer."""
    planted = _maps(ridge)
    with torch.no_grad():
        planted.dw_k.normal_(std=0.5)
        planted.dw_v.normal_(std=0.5)
    return planted, _plant(answers, planted, ridge[0].start_kv, target, root)


def _plant(answers: AnswerCache, planted, start_kv, target, root):
    """The answer windows rewritten as if the teacher read each document through `planted` maps: its greedy
    answer over that cache and its log-probs over that answer."""
    root.mkdir()
    stop = stop_ids(target)
    for i, e in enumerate(answers.entries):
        w = answers.load(i)
        c, q, _ = w["lengths"].tolist()
        p = 1 + c
        with torch.no_grad():
            seg = answer_context(planted, start_kv, w, target)
        scores = []
        got, _ = greedy(target, seg, w["ids"][p:p + q], ANSWERS.max_answer_tokens, stop, scores=scores)
        top = torch.stack(scores).log_softmax(-1).topk(ANSWERS.topk, dim=-1)
        w |= {"ids": torch.cat((w["ids"][:p + q], torch.tensor(got))), "lengths": torch.tensor([c, q, len(got)]),
              "top_logp": top.values, "top_idx": top.indices}
        save_file({n: t.contiguous() for n, t in w.items()}, str(root / e["file"]))
    (root / "index.json").write_text(answers.index_path.read_text())
    return AnswerCache(root)


def test_answer_distillation_recovers_a_planted_optimum(pair, answers, ridge, tmp_path):
    """The teacher's answers come from planted maps (the ridge map plus a random residual, where the answer KL is 0);
    the answer objective, started from the ridge map, must drive the KL near zero and give the planted maps'
    answers."""
    _, target = pair
    start_kv = ridge[0].start_kv
    planted, cache = _planted(ridge, answers, target, tmp_path / "planted")
    n = len(cache)
    dev = list(range(n - 4, n))
    probe = AnswerProbe(target, start_kv, cache, dev, ANSWERS.max_answer_tokens)
    maps = _maps(ridge)

    def loss(m):
        with torch.no_grad():
            return float(answer_loss(m, start_kv, [cache.load(i) for i in range(n - 4)], target))

    before, at_plant = loss(maps), loss(planted)
    assert at_plant < 1e-4 < 0.05 < before
    cfg = TrainerConfig(objective="answer", select="fidelity", max_iters=100, warmup_iters=5, batch_windows=4,
                        eval_interval=25, lr=1e-1, min_lr=1e-3)
    out = train(maps, start_kv, target, cache, list(range(n - 4)), None, cfg, 0, tmp_path / "run", progress=False,
                answers=probe)
    # the training windows' answers are the planted maps' (a dozen windows of six answer tokens pin down far less
    # than the maps: held-out windows are not reached, and the best dev checkpoint is what the trainer keeps)
    seen = AnswerProbe(target, start_kv, cache, list(range(4)), ANSWERS.max_answer_tokens)
    trained = _maps(ridge)  # the last step's maps (`maps` holds the best dev checkpoint's)
    trained.load_state_dict({k[5:]: v for k, v in load_file(str(tmp_path / "run" / "last.safetensors")).items()
                             if k.startswith("maps.")})
    after = loss(trained)
    assert after < 0.1 * before, (before, after)
    assert seen.score(trained)["top1"] > 0.9 > seen.score(_maps(ridge))["top1"]
    assert probe.score(planted)["rougeL"] == 1.0 == probe.score(planted)["top1"]
    rows = out["record"]
    assert all({"dev_fidelity", "dev_rougeL", "dev_top1", "dev_greedy"} <= set(r) for r in rows)
    best = max(rows, key=lambda r: r["dev_fidelity"])
    assert out["best_iter"] == best["iter"] and out["best"] == best["dev_fidelity"]
    assert json.loads((tmp_path / "run" / "record.json").read_text())[-1]["dev_fidelity"] == rows[-1]["dev_fidelity"]


def test_the_decision_hinge_scores_the_greedy_decisions_the_first_most():
    """0 wherever the student ranks the teacher's token first by the teacher's own margin (capped at 1 nat), however
    unlike the teacher's its distribution is otherwise; a swap of the top two costs the teacher's margin plus the
    student's, weighted by the tokens after it (A - i, summing to 1)."""
    teacher = torch.tensor([[-0.1, -2.5, -3.0], [-0.5, -0.9, -4.0], [-0.2, -3.0, -3.5]])  # margins 2.4, 0.4, 2.8
    idx = torch.tensor([[3, 1, 0], [0, 2, 1], [1, 3, 2]])
    student = torch.full((3, 5), -9.0)
    student[0, 3], student[1, 0], student[2, 1] = -0.01, -0.3, -1.0  # margins 8.99, 8.7, 8.0 over the rest
    assert float(decision_hinge(student, teacher, idx)) == 0.0
    swapped = student.clone()
    swapped[0, 1] = -0.005  # position 0: token 1 first, by 0.005
    assert float(decision_hinge(swapped, teacher, idx)) == pytest.approx(3 / 6 * (1.0 + 0.005))
    late = student.clone()
    late[2, 0] = -1.2  # position 2: the teacher's token first by 0.2 only, where the teacher had 2.8 (capped: 1)
    assert float(decision_hinge(late, teacher, idx)) == pytest.approx(1 / 6 * (1.0 - 0.2))
    with pytest.raises(ValueError, match="top two"):
        decision_hinge(student, teacher[:, :1], idx[:, :1])


def test_decision_training_recovers_a_planted_optimum(pair, answers, ridge, tmp_path):
    """The `decision` objective (answer KL + the hinge) is 0 at the planted maps and, from the ridge map, drives the
    loss down and the student's greedy answers to the teacher's on the windows it trains on."""
    _, target = pair
    start_kv = ridge[0].start_kv
    planted, cache = _planted(ridge, answers, target, tmp_path / "planted")
    n = len(cache)
    train_windows = [cache.load(i) for i in range(n - 4)]

    def loss(m):
        with torch.no_grad():
            return float(decision_loss(m, start_kv, train_windows, target))

    before, at_plant = loss(_maps(ridge)), loss(planted)
    assert at_plant < 1e-4 < 0.05 < before
    assert before > float(answer_loss(_maps(ridge), start_kv, train_windows, target).detach())  # the hinge adds
    cfg = TrainerConfig(objective="decision", select="last", max_iters=100, warmup_iters=5, batch_windows=4,
                        eval_interval=25, lr=1e-1, min_lr=1e-3)
    maps = _maps(ridge)
    train(maps, start_kv, target, cache, list(range(n - 4)), None, cfg, 0, tmp_path / "run", progress=False,
          answers=AnswerProbe(target, start_kv, cache, list(range(n - 4, n)), ANSWERS.max_answer_tokens))
    seen = AnswerProbe(target, start_kv, cache, list(range(4)), ANSWERS.max_answer_tokens)
    assert loss(maps) < 0.1 * before, (before, loss(maps))
    assert seen.score(maps)["greedy"] > 0.9 > seen.score(_maps(ridge))["greedy"]


def test_onpolicy_distillation_recovers_a_planted_optimum(pair, answers, ridge, tmp_path):
    """The teacher reads each document through planted maps; the student, from the ridge map, answers in its own
    words and the teacher scores them. The on-policy loss is 0 at the planted maps, and the objective drives it down
    and the student's answers towards the teacher's (the windows' answers are the planted maps', for the probe)."""
    _, target = pair
    start_kv = ridge[0].start_kv
    planted, cache = _planted(ridge, answers, target, tmp_path / "planted")
    n, stop = len(cache), stop_ids(target)

    def teacher(w):
        with torch.no_grad():
            return answer_context(planted, start_kv, w, target)

    def loss(m, teach=teacher):
        with torch.no_grad():
            return float(onpolicy_loss(m, start_kv, [cache.load(i) for i in range(n - 4)], target,
                                       ANSWERS.max_answer_tokens, stop, ANSWERS.topk, teach, mix=1.0))

    before, at_plant = loss(_maps(ridge)), loss(planted)
    assert at_plant < 1e-4 < 0.05 < before
    assert loss(planted, lambda w: own_context(target, w)) > 0.05  # the default teacher: the target's own prefill
    cfg = TrainerConfig(objective="onpolicy", select="fidelity", max_iters=100, warmup_iters=5, batch_windows=4,
                        eval_interval=25, lr=1e-1, min_lr=1e-3)
    seen = AnswerProbe(target, start_kv, cache, list(range(4)), ANSWERS.max_answer_tokens)
    probe = AnswerProbe(target, start_kv, cache, list(range(n - 4, n)), ANSWERS.max_answer_tokens)
    maps = _maps(ridge)
    out = train(maps, start_kv, target, cache, list(range(n - 4)), None, cfg, 0, tmp_path / "run", progress=False,
                answers=probe, teacher=teacher)
    trained = _maps(ridge)
    trained.load_state_dict({k[5:]: v for k, v in load_file(str(tmp_path / "run" / "last.safetensors")).items()
                             if k.startswith("maps.")})
    assert loss(trained) < 0.6 * before, (before, loss(trained))  # measured: 1.03 -> 0.45 in 100 steps
    assert seen.score(trained)["top1"] > seen.score(_maps(ridge))["top1"]
    assert out["best_iter"] == max(out["record"], key=lambda r: r["dev_fidelity"])["iter"]


def test_select_fidelity_needs_an_answer_probe(pair, answers, ridge, tmp_path):
    cfg = TrainerConfig(objective="answer", select="fidelity", max_iters=2, warmup_iters=0, eval_interval=1)
    with pytest.raises(ValueError, match="answer probe"):
        train(_maps(ridge), ridge[0].start_kv, pair[1], answers, [0, 1], None, cfg, 0, tmp_path, progress=False)
    with pytest.raises(ValueError, match="select must be one of"):
        TrainerConfig(select="rouge")


def test_select_last_keeps_the_last_step_while_the_probe_still_reports(pair, answers, ridge, tmp_path):
    """`train-adapter --keep last` (select "last"): the maps the trainer leaves are the last step's, whatever the dev
    probe scored; every evaluation still carries the probe's measures."""
    from kvbridge.adapters.chain import ChainConfig

    _, target = pair
    start_kv = ridge[0].start_kv
    cache = answers
    n = len(cache)
    probe = AnswerProbe(target, start_kv, cache, list(range(n - 2, n)), ANSWERS.max_answer_tokens)
    cfg = TrainerConfig(objective="answer", select="last", max_iters=6, warmup_iters=0, batch_windows=2,
                        eval_interval=2, lr=1e-1, min_lr=1e-2)
    maps = _maps(ridge)
    out = train(maps, start_kv, target, cache, list(range(n - 2)), None, cfg, 0, tmp_path / "run", progress=False,
                answers=probe)
    assert out["best_iter"] == out["iters"] == 6 and [r["iter"] for r in out["record"]] == [0, 2, 4, 6]
    assert all("dev_fidelity" in r for r in out["record"])
    last = {k[5:]: v for k, v in load_file(str(tmp_path / "run" / "last.safetensors")).items()
            if k.startswith("maps.")}
    assert all(torch.equal(v, last[k]) for k, v in maps.state_dict().items())
    assert any(not torch.equal(v, _maps(ridge).state_dict()[k]) for k, v in maps.state_dict().items())  # it moved
    with pytest.raises(ValueError, match="keep is 'best' or 'last'"):
        ChainConfig(stages=(("answer", 2),), keep="first")
