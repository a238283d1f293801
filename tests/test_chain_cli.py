"""`train-adapter --trainer chain|fuser` on the tiny pair: one command makes the teacher cache, the ridge fit and the
stages; the file records that command, the corpus hashes and the held-out figures; a rerun resumes (no teacher
window computed twice) and gives the same weights; dev windows never come from training documents."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil

import pytest
import torch
from kvbridge.adapters.answer_windows import DEV_INSTRUCTION, AnswerCache, instruction_for
from kvbridge.adapters.chain import ChainConfig, parse_stages, select_windows
from kvbridge.adapters.cli import main
from kvbridge.adapters.fuser import load_fuser
from kvbridge.adapters.io import load_adapter, read_adapter_meta
from kvbridge.adapters.teacher import TeacherConfig, is_heldout
from safetensors.torch import load_file

WORDS = ("the a model reads text once and keeps its cache in blocks while another model of a different family "
         "generates from the projected keys and values without reading the document again").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    files = []
    for name in ("alpha_corpus.txt", "beta_docs_corpus.txt"):
        paragraphs = [" ".join(rng.choice(WORDS) for _ in range(120)) + "." for _ in range(1500)]
        (root / name).write_text("\n\n".join(paragraphs))
        files.append(str(root / name))
    with open(root / "eval.jsonl", "w") as f:
        for _ in range(4):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(400))}) + "\n")
    return files, str(root / "eval.jsonl")


def _args(corpus, work, out, *extra):
    files, evaluation = corpus
    return ["--preset", "tiny", "--corpus", *files, "--train-windows", "16", "--ridge-windows", "8",
            "--dev-per-corpus", "2", "--work", str(work), "--out", str(out), "--eval", evaluation, "--eval-docs", "4",
            "-q", *extra]


def _eval_docs(corpus, source, target):
    """The documents `_args`' --eval --eval-docs 4 scores (192 + 64 tokens, train-adapter's defaults)."""
    from kvbridge.adapters.evaluate import prepare_documents
    from kvbridge.adapters.train import read_corpus

    return prepare_documents(read_corpus([corpus[1]])[0], source, target, 192, 64, limit=4)


def test_stages_parse_and_bad_ones_are_named():
    assert parse_stages("attention:3, kl:5") == (("attention", 3), ("kl", 5))
    for bad in ("attention", "kl:0", "ridge:4", "kl:x"):
        with pytest.raises(ValueError, match="OBJECTIVE:STEPS"):
            parse_stages(bad)
    with pytest.raises(ValueError, match="fuser trains on stage 'ce' only"):
        ChainConfig(stages=(("kl", 3),), fuser_rank=8)
    with pytest.raises(ValueError, match="the teacher cache must keep them"):
        ChainConfig(stages=(("attention", 3),), teacher=TeacherConfig(queries=False))
    assert parse_stages("decision:4") == (("decision", 4),)
    with pytest.raises(ValueError, match="answer_windows must be >= 1"):
        ChainConfig(stages=(("decision", 3),))
    with pytest.raises(ValueError, match="decision_weight must be > 0"):
        ChainConfig(stages=(("decision", 3),), answer_windows=4, decision_weight=0.0)


def test_dev_windows_come_from_held_out_documents_only(corpus, tiny_target):
    config = ChainConfig(train_windows=40, ridge_windows=8, dev_per_corpus=2)
    dev, train = select_windows(corpus[0], tiny_target.tokenizer, config)
    assert len(dev) == 4 and len(train) == 40
    assert {w.doc_id.split(":")[0] for w in dev} == {"alpha", "beta"}
    assert all(is_heldout(w.doc_id, config.heldout_fraction) for w in dev)
    assert not any(is_heldout(w.doc_id, config.heldout_fraction) for w in train)
    assert (dev, train) == select_windows(corpus[0], tiny_target.tokenizer, config)


def test_the_ridge_windows_keep_the_targets_kv_where_they_make_teacher_windows(corpus, tiny_target):
    """The ridge reads the first `ridge_windows` training windows that make teacher windows (valid_windows), so those
    are the ones whose teacher data keep the target's own KV, not the first selected when one of them is too short."""
    from kvbridge.adapters.chain import kv_windows, valid_windows

    config = ChainConfig(stages=(("kl", 1),), train_windows=12, ridge_windows=3)
    dev, train_w = select_windows(corpus[0], tiny_target.tokenizer, config)
    short = dataclasses.replace(train_w[1], text=train_w[1].text[:40])  # re-tokenises to less than a window
    windows = [train_w[0], short, *train_w[2:]]
    valid = valid_windows(config, windows, tiny_target.tokenizer)
    assert short not in valid and valid[:3] == [train_w[0], train_w[2], train_w[3]]
    assert kv_windows(config, dev, valid) == {w.id for w in dev} | {train_w[i].id for i in (0, 2, 3)}


def test_chain_command_writes_a_documented_adapter_and_resumes(corpus, tmp_path, capsys):
    work, out = tmp_path / "work", tmp_path / "a.safetensors"
    args = _args(corpus, work, out, "--trainer", "chain", "--stages", "attention:3,kl:2", "--save-dtype",
                 "bfloat16", "--token-rank", "8")
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "stage attention: 3 steps" in printed and "recovery projected" in printed
    meta = read_adapter_meta(out)
    assert meta["format_version"] == 2 and meta["training"]["trainer"] == "chain"
    assert load_adapter(out).token_rank == 8 and load_adapter(out).tok_table.dtype == torch.bfloat16
    assert [s["objective"] for s in meta["training"]["record"]["stages"]] == ["attention", "kl"]
    for f in corpus[0]:
        name = f.rsplit("/", 1)[1]
        assert meta["corpus"]["sha256"][name] == hashlib.sha256(open(f, "rb").read()).hexdigest()
    assert meta["corpus"]["doc_chars"] == 8000  # the split's document length, a field eval.heldout reads
    assert "recovery" in meta["metrics"] and load_adapter(out).wk.dtype == torch.bfloat16
    first = load_adapter(out)
    index = json.loads((work / "teacher" / "index.json").read_text())
    # a second run of the same command: everything is found in the work folder, the weights are the same
    assert main(args) == 0
    assert json.loads((work / "teacher" / "index.json").read_text()) == index
    assert torch.equal(load_adapter(out).wk, first.wk)
    # the work folder's ridge fit has token features of rank 8: another rank is refused by name
    assert main(_args(corpus, work, out, "--trainer", "chain", "--stages", "attention:3,kl:2",
                      "--token-rank", "0")) == 2
    assert "was made with --token-rank 8; this run asks --token-rank 0" in capsys.readouterr().err


def test_a_teacher_cache_of_the_windows_read_trains_the_adapter_of_every_window(corpus, tmp_path):
    """kl:3 of 2 windows draws 6 of the 40 selected windows: the run computes only those, the ridge windows and the
    dev ones (chain.windows_read), and writes the very adapter a run whose teacher cache holds every window writes."""
    def args(work, out, stages):
        return _args(corpus, work, out, "--trainer", "chain", "--stages", stages, "--train-windows", "40",
                     "--ridge-windows", "4", "--batch-windows", "2", "--token-rank", "8", "--eval-docs", "0")

    lean, full = tmp_path / "lean", tmp_path / "full"
    assert main(args(lean, tmp_path / "lean.safetensors", "kl:3")) == 0
    # every window computed: a run that reads them all (20 steps of 2 windows), then the same kl:3 in its folder
    assert main(args(full, tmp_path / "all.safetensors", "kl:20")) == 0
    shutil.rmtree(full / "stage-0-kl")
    assert main(args(full, tmp_path / "full.safetensors", "kl:3")) == 0
    record = read_adapter_meta(tmp_path / "lean.safetensors")["training"]["record"]["teacher_windows"]
    everything = read_adapter_meta(tmp_path / "full.safetensors")["training"]["record"]["teacher_windows"]
    assert record["train"] == everything["train"] == everything["cached"] > record["cached"]
    assert record["cached"] <= 3 * 2 + 4, record
    n_lean = len(json.loads((lean / "teacher" / "index.json").read_text())["windows"])
    assert n_lean == record["cached"] + record["dev"]
    a, b = load_adapter(tmp_path / "lean.safetensors"), load_adapter(tmp_path / "full.safetensors")
    for name in ("wk", "wv", "tok_table"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_an_answer_cache_of_the_windows_drawn_trains_the_adapter_of_every_window(corpus, tmp_path, monkeypatch):
    """answer:2 of 2 windows draws 4 of the 24 selected answer windows: the answer cache computes only those and the
    dev ones (chain.answer_windows_read), and the run writes the adapter a run whose answer cache holds every window
    writes (each window decoded alone in both, so their teacher data are equal to the bit)."""
    monkeypatch.setattr(AnswerCache, "batch_windows", 1)

    def args(work, out, stages):
        return _args(corpus, work, out, "--trainer", "chain", "--stages", stages, "--token-rank", "0",
                     "--batch-windows", "2", "--answer-windows", "24", "--answer-lengths", "32,64")

    lean, full = tmp_path / "lean", tmp_path / "full"
    assert main(args(lean, tmp_path / "lean.safetensors", "answer:2")) == 0
    assert main(args(full, tmp_path / "all.safetensors", "answer:12")) == 0  # draws all 24
    shutil.rmtree(next(full.glob("stage-0-answer*")))
    assert main(args(full, tmp_path / "full.safetensors", "answer:2")) == 0
    record = read_adapter_meta(tmp_path / "lean.safetensors")["training"]["record"]["answer_windows"]
    everything = read_adapter_meta(tmp_path / "full.safetensors")["training"]["record"]["answer_windows"]
    assert record["train"] == everything["train"] == 24
    assert record["cached"] + record["empty"] <= 4 < everything["cached"] + everything["empty"] == 24, record
    assert len(json.loads((lean / "answers" / "index.json").read_text())["windows"]) == record["cached"] + record["dev"]
    a, b = load_adapter(tmp_path / "lean.safetensors"), load_adapter(tmp_path / "full.safetensors")
    for name in ("wk", "wv"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_chain_teacher_windows_take_the_commands_context_length(corpus, tmp_path, capsys):
    """--context-tokens / --continuation-tokens size every teacher window (train for long documents), and a work
    folder made at one length refuses another by name."""
    work, out = tmp_path / "work", tmp_path / "long.safetensors"
    args = _args(corpus, work, out, "--trainer", "chain", "--stages", "kl:2", "--context-tokens", "80",
                 "--continuation-tokens", "12")  # (2 steps of 4 and the 8 ridge windows read all 16 windows)
    assert main(args) == 0
    config = json.loads((work / "teacher" / "index.json").read_text())["config"]
    assert (config["context_tokens"], config["continuation_tokens"], config["queries"]) == (80, 12, False)
    kv = [e.get("kv", True) for e in json.loads((work / "teacher" / "index.json").read_text())["windows"]]
    assert kv == [True] * (4 + 8) + [False] * 8  # kl reads no target KV: only the dev and ridge windows keep it
    assert main(_args(corpus, work, out, "--trainer", "chain", "--stages", "kl:1")) == 2
    assert "context_tokens" in capsys.readouterr().err


def test_fuser_command_writes_a_format_2_fuser(corpus, tmp_path, capsys, tiny_source, tiny_target):
    from kvbridge.adapters.pairs import start_token_id
    from kvbridge.adapters.recovery_probe import RecoveryProbe

    out = tmp_path / "f.safetensors"
    assert main(_args(corpus, tmp_path / "work", out, "--trainer", "fuser", "--stages", "ce:3",
                      "--fuser-rank", "4")) == 0
    printed = capsys.readouterr().out
    assert "fused: recovery" in printed and "wrong-document control" in printed
    maps, record = load_fuser(out)
    assert record["kind"] == "fuser" and record["rank"] == 4
    assert {"recovery_fused", "recovery_wrong_document", "own_minus_wrong"} <= set(record["metrics"])
    # the recorded figures are the file's (bf16, folded), not those of the float32 maps it was trained as
    docs = _eval_docs(corpus, tiny_source, tiny_target)
    probe = RecoveryProbe.from_documents(tiny_source, tiny_target, None, docs, start_token_id(tiny_target.tokenizer),
                                         own=True)
    again = probe.recovery(maps, seed=0, wrong=True)
    assert again["recovery"] == pytest.approx(record["metrics"]["recovery_fused"][0], abs=1e-9)
    assert again["wrong"] == pytest.approx(record["metrics"]["recovery_wrong_document"][0], abs=1e-9)
    assert main(_args(corpus, tmp_path / "work", out, "--trainer", "fuser", "--stages", "kl:3")) == 2
    assert "fuser trains on stage 'ce' only" in capsys.readouterr().err


def test_chain_without_a_corpus_is_refused(capsys):
    assert main(["--preset", "tiny", "--trainer", "chain"]) == 2
    assert "needs --corpus" in capsys.readouterr().err


def test_chain_fine_tunes_a_trained_adapter_with_exact_tails(corpus, tmp_path, capsys):
    """--init: no ridge fit, the stages train a residual on the given adapter (its token rank kept) with the
    whitening statistics of the ridge windows through it; another adapter in the same work folder, or one of
    another pair, is refused by name."""
    import dataclasses

    from kvbridge.adapters.io import save_adapter

    first = tmp_path / "a.safetensors"
    assert main(_args(corpus, tmp_path / "work-a", first, "--trainer", "chain", "--stages", "kl:2",
                      "--token-rank", "8")) == 0
    work, out = tmp_path / "work-b", tmp_path / "b.safetensors"
    assert main(_args(corpus, work, out, "--trainer", "chain", "--init", str(first), "--stages", "kl:3",
                      "--stage-lr", "kl=1e-2", "--exact-tail", "0.25", "--token-rank", "0")) == 0
    assert "stage kl: 3 steps" in capsys.readouterr().out
    assert not (work / "ridge").exists() and (work / "init" / "stats.safetensors").exists()
    assert "q" not in load_file(str(next((work / "teacher").glob("*.safetensors"))))  # no attention stage
    a, b = load_adapter(first), load_adapter(out)
    assert b.token_rank == 8 and torch.equal(b.tok_table, a.tok_table) and torch.equal(b.layer_map, a.layer_map)
    assert not torch.equal(b.wk, a.wk)
    init = read_adapter_meta(out)["training"]["init"]  # what it started from: the chain of commands
    assert init["sha256"] == hashlib.sha256(first.read_bytes()).hexdigest()
    assert init["training"]["command"] == read_adapter_meta(first)["training"]["command"]
    record = json.loads((work / "stage-0-kl" / "record.json").read_text())
    assert "dev_recovery_replace" in record[-1] and any(k.startswith("dev_recovery_exact_") for k in record[-1])

    other = tmp_path / "other.safetensors"
    save_adapter(dataclasses.replace(a, wk=a.wk * 2), other)
    assert main(_args(corpus, work, out, "--trainer", "chain", "--init", str(other), "--stages", "kl:3")) == 2
    assert "holds the statistics of" in capsys.readouterr().err
    target = dict(a.meta.target, config_hash="0" * 64)
    save_adapter(dataclasses.replace(a, meta=dataclasses.replace(a.meta, target=target)), other)
    assert main(_args(corpus, tmp_path / "work-c", out, "--trainer", "chain", "--init", str(other),
                      "--stages", "kl:3")) == 2
    assert "was fitted for target" in capsys.readouterr().err
    assert main(_args(corpus, tmp_path / "work-c", out, "--trainer", "chain", "--stages", "attention:3",
                      "--exact-tail", "0.2")) == 2
    assert "exact_tail applies to the kl and ce stages" in capsys.readouterr().err


def test_chain_with_a_source_basis_writes_format_3_and_fine_tunes_from_it(corpus, tmp_path, capsys):
    """--source-rank: the maps read a basis over every source layer's K and V (format 3, kept in the written dtype);
    --init from such an adapter keeps its basis; the work folder's ridge fit refuses another source rank by name."""
    work, first = tmp_path / "work", tmp_path / "wide.safetensors"
    assert main(_args(corpus, work, first, "--trainer", "chain", "--stages", "kl:2", "--token-rank", "8",
                      "--source-rank", "6", "--save-dtype", "bfloat16")) == 0
    assert "recovery projected" in capsys.readouterr().out
    a = load_adapter(first)
    assert read_adapter_meta(first)["format_version"] == 3 and read_adapter_meta(first)["layer_map"] == "basis"
    assert a.source_rank == 6 and a.token_rank == 8 and a.src_basis.dtype == torch.bfloat16
    assert a.wk.shape[1] == 6 and int(a.layer_map.max()) == 0
    assert main(_args(corpus, work, first, "--trainer", "chain", "--stages", "kl:2", "--token-rank", "8")) == 2
    assert "was made with --source-rank 6; this run asks --source-rank 0" in capsys.readouterr().err
    out = tmp_path / "tuned.safetensors"
    assert main(_args(corpus, tmp_path / "work-b", out, "--trainer", "chain", "--init", str(first), "--stages",
                      "kl:3", "--stage-lr", "kl=1e-2")) == 0
    assert "stage kl: 3 steps" in capsys.readouterr().out  # (random tiny models: the best step may be the start)
    b = load_adapter(out)
    assert b.source_rank == 6 and torch.equal(b.src_basis.float(), a.src_basis.float())
    assert (tmp_path / "work-b" / "init" / "stats.safetensors").exists()
    with pytest.raises(ValueError, match="source basis is for projections"):
        ChainConfig(stages=(("ce", 3),), fuser_rank=8, source_rank=4)


def test_chain_answer_stage_keeps_the_best_dev_fidelity_and_resumes(corpus, tmp_path, capsys):
    from kvbridge.adapters.chain import select_answer_windows
    from kvbridge.transfer.presets import load_pair

    work, out = tmp_path / "work", tmp_path / "a.safetensors"
    args = _args(corpus, work, out, "--trainer", "chain", "--stages", "kl:2,answer:3", "--token-rank", "0",
                 "--answer-windows", "6", "--answer-lengths", "32,64")
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "stage answer: 3 steps" in printed and "by fidelity: dev recovery" in printed and "ROUGE-L" in printed
    record = read_adapter_meta(out)["training"]["record"]
    assert record["answer_windows"]["train"] == 6 and record["answer_windows"]["dev"] >= 2
    kl, answer = record["stages"]
    assert (kl["select"], answer["select"]) == ("recovery", "fidelity")
    assert {"dev_recovery", "dev_fidelity", "dev_rougeL", "dev_top1", "dev_greedy"} <= set(kl) & set(answer)
    index = json.loads((work / "answers" / "index.json").read_text())
    assert index["config"]["lengths"] == [32, 64] and len(index["windows"]) == 6 + record["answer_windows"]["dev"]
    first = load_adapter(out)
    assert main(args) == 0  # resumed: no answer window made again, the same weights
    assert json.loads((work / "answers" / "index.json").read_text()) == index
    assert torch.equal(load_adapter(out).wk, first.wk)
    # answer windows for training come from training documents, the dev ones from held-out dev documents
    _, target = load_pair("tiny", device="cpu")
    config = ChainConfig(stages=(("answer", 1),), answer_windows=40, dev_per_corpus=2)
    dev, train = select_answer_windows(corpus[0], target.tokenizer, config)
    assert len(train) == 40 and len(dev) == 4
    assert not any(is_heldout(w.doc_id, config.heldout_fraction) for w in train)
    assert all(is_heldout(w.doc_id, config.heldout_fraction) and is_heldout(w.doc_id, 0.5, salt="dev") for w in dev)
    # asked in the dev wording, which no training window is
    assert {instruction_for(w.id, w.text) for w in dev} == {DEV_INSTRUCTION}
    assert DEV_INSTRUCTION not in {instruction_for(w.id, w.text) for w in train}
    more = select_answer_windows(corpus[0], target.tokenizer, ChainConfig(stages=(("answer", 1),), answer_windows=40,
                                                                           dev_per_corpus=2, answer_dev=3))[0]
    assert len(dev) < len(more) <= 6  # 3 a file where it holds that many held-out dev documents
    assert all(is_heldout(w.doc_id, 0.5, salt="dev") and instruction_for(w.id, w.text) == DEV_INSTRUCTION for w in more)
    # the answer cache keeps windows by id and records no seed: a window's text is its id's under every --seed (a
    # window's length was drawn with the seed, and a cache of another seed served other lengths under the same ids)
    other = select_answer_windows(corpus[0], target.tokenizer, dataclasses.replace(config, seed=1))
    texts = {w.id: w.text for w in dev + train}
    shared = [w for w in other[0] + other[1] if w.id in texts]
    assert shared and all(texts[w.id] == w.text for w in shared)


def test_chain_with_a_context_window_writes_format_4_beside_a_plain_run(corpus, tmp_path, capsys):
    """--context-window: the maps also read the tokens before each token (format 4); its stages live in their own
    folders of the work folder, so a plain run there is not resumed into it; --init from it trains its branch on
    (a different branch asked for, or a fuser, is refused by name, as is --context-window from a plain adapter)."""
    work, plain, ctx = tmp_path / "work", tmp_path / "plain.safetensors", tmp_path / "ctx.safetensors"
    assert main(_args(corpus, work, plain, "--trainer", "chain", "--stages", "kl:2", "--token-rank", "8")) == 0
    assert main(_args(corpus, work, ctx, "--trainer", "chain", "--stages", "kl:2", "--token-rank", "8",
                      "--context-window", "2", "--context-rank", "4", "--save-dtype", "bfloat16")) == 0
    assert "recovery projected" in capsys.readouterr().out
    assert read_adapter_meta(plain)["format_version"] == 2 and read_adapter_meta(ctx)["format_version"] == 4
    a, c = load_adapter(plain), load_adapter(ctx)
    assert a.ctx_lags is None and c.ctx_lags.tolist() == [1, 2] and c.ctx_a.shape[2] == 4
    assert c.ctx_a.dtype == torch.bfloat16 and c.token_rank == a.token_rank == 8
    assert (work / "stage-0-kl").is_dir() and (work / "stage-0-kl-context2r4").is_dir()
    # --init from it: the branch goes on training (same lags and rank, same format), in its own stage folder
    tuned = tmp_path / "tuned.safetensors"
    assert main(_args(corpus, tmp_path / "work-b", tuned, "--trainer", "chain", "--init", str(ctx), "--stages",
                      "kl:2", "--stage-lr", "kl=1e-2")) == 0
    t = load_adapter(tuned)
    assert read_adapter_meta(tuned)["format_version"] == 4 and torch.equal(t.ctx_lags, c.ctx_lags)
    assert t.ctx_a.shape == c.ctx_a.shape and (tmp_path / "work-b" / "stage-0-kl-context2r4").is_dir()
    for bad, says in ((("--context-window", "3", "--context-rank", "4"), "has a context branch of 2 tokens, rank 4"),
                      (("--trainer", "fuser", "--stages", "ce:2", "--fuser-rank", "4"), "a fuser starts from")):
        assert main(_args(corpus, tmp_path / "work-c", tmp_path / "x.safetensors", "--trainer", "chain", "--init",
                          str(ctx), "--stages", "kl:2", *bad)) == 2
        assert says in capsys.readouterr().err
    assert main(_args(corpus, tmp_path / "work-c", tmp_path / "x.safetensors", "--trainer", "chain", "--init",
                      str(plain), "--stages", "kl:2", "--context-window", "2")) == 2
    assert "has no context branch" in capsys.readouterr().err
    with pytest.raises(ValueError, match="context window is for projections"):
        ChainConfig(stages=(("ce", 3),), fuser_rank=8, context_window=2)


def test_the_recorded_recovery_is_the_saved_files(corpus, tmp_path, tiny_source, tiny_target):
    """The figures train-adapter writes into a file are those of the file as it loads (maps rounded to --save-dtype,
    a context branch without its norm folded as saved), for a first run and for a fine-tune --init from it, not those
    of the float32 adapter in memory before it was saved."""
    from kvbridge.adapters.evaluate import evaluate_recovery

    first, tuned = tmp_path / "ctx.safetensors", tmp_path / "tuned.safetensors"
    assert main(_args(corpus, tmp_path / "work", first, "--trainer", "chain", "--stages", "kl:3", "--token-rank", "8",
                      "--context-window", "2", "--context-rank", "4", "--context-no-norm",
                      "--save-dtype", "bfloat16")) == 0
    assert main(_args(corpus, tmp_path / "work-b", tuned, "--trainer", "chain", "--init", str(first), "--stages",
                      "kl:2", "--stage-lr", "kl=1e-2", "--save-dtype", "bfloat16")) == 0
    docs = _eval_docs(corpus, tiny_source, tiny_target)
    for path in (first, tuned):
        meta = read_adapter_meta(path)
        assert meta["format_version"] == 5 and meta["metrics"]["eval_documents"] == len(docs)
        loaded = evaluate_recovery(tiny_source, tiny_target, load_adapter(path), docs, progress=False)
        for condition in ("projected", "wrong"):
            assert loaded.recovery[condition] == pytest.approx(meta["metrics"]["recovery"][condition], abs=1e-9)
        assert loaded.nll == pytest.approx(meta["metrics"]["nll"], abs=1e-9)
