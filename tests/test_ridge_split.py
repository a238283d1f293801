"""`train-adapter --trainer ridge` (train.train_adapter) splits its windows by document into the training windows,
the windows λ and α are chosen on, and the windows the R² and cosine are reported on: no document in two parts, and
the reported figures come from windows that neither fitted the maps nor chose λ and α."""

from __future__ import annotations

import json
import random

import pytest
import torch
from kvbridge.adapters import fit, train
from kvbridge.adapters.teacher import Window
from kvbridge.adapters.train import TrainConfig, train_adapter

WORDS = ("the model reads a document once and keeps its keys and values in blocks while another model of a "
         "different family answers from the projected cache without reading the text again").split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """24 documents (.jsonl records) of seeded word salad, several 64-token windows each."""
    rng = random.Random(4)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(300))})
                            + "\n" for i in range(24)))
    return path


CONFIG = TrainConfig(max_tokens=64 * 20, window_tokens=64, heldout_fraction=0.2)


def test_each_window_is_read_for_one_part_and_no_document_is_in_two(corpus, tiny_source, tiny_target, monkeypatch):
    """Which statistics each window's pairs went into (a spy on the real RidgeStats.add): the training ones, the
    ones λ and α are chosen on, or none (read for the report only). The parts share no document, and the report
    reads windows that are in no statistics."""
    docs = {n: json.loads(line)["text"] for n, line in enumerate(corpus.read_text().splitlines(), start=1)}
    events: list = []
    real_pair_text, real_add = train.pair_text, fit.RidgeStats.add
    monkeypatch.setattr(train, "pair_text", lambda text, *a: (events.append(text), real_pair_text(text, *a))[1])
    monkeypatch.setattr(fit.RidgeStats, "add", lambda self, *a: (events.append(self), real_add(self, *a))[1])
    adapter, report = train_adapter(tiny_source, tiny_target, [corpus], CONFIG, progress=False)
    parts: dict = {}  # statistics object (or "report") -> documents of the windows read for it
    for i, event in enumerate(events):
        if isinstance(event, str):
            into = events[i + 1] if i + 1 < len(events) and not isinstance(events[i + 1], str) else "report"
            parts.setdefault(id(into) if into != "report" else into, set()).update(
                n for n, text in docs.items() if event in text)
    assert "report" in parts and len(parts) == 3, "the report must read windows that no statistics took"
    groups = list(parts.values())
    for a in range(3):
        for b in range(a + 1, 3):
            assert not groups[a] & groups[b], (groups[a], groups[b])
    assert report.documents == {"train": len(groups[1]), "select": len(groups[0]), "report": len(parts["report"])}
    assert adapter.meta.corpus["split"].startswith("documents") and adapter.meta.corpus["documents"] == report.documents
    assert report.heldout_tokens == adapter.meta.corpus["heldout_tokens"] > 0 and report.select_tokens > 0


def test_split_windows_is_a_deterministic_partition_by_document():
    from kvbridge.adapters.train import split_windows

    windows = [Window(f"d{d}/{i}", f"d{d}", f"text {d} {i}") for d in range(9) for i in range(1 + d % 3)]
    random.Random(0).shuffle(windows)
    tr, sel, rep = split_windows(windows, budget=12, heldout_fraction=0.35)
    assert (len(sel), len(rep), len(tr)) == (2, 2, 8)  # n = round(12 · 0.35 / 2) each, the rest of the budget trains
    docs = [{w.doc_id for w in part} for part in (tr, sel, rep)]
    assert not (docs[0] & docs[1] or docs[0] & docs[2] or docs[1] & docs[2])
    assert (tr, sel, rep) == split_windows(list(windows), budget=12, heldout_fraction=0.35)
    with pytest.raises(ValueError, match="windows of 2 document"):
        split_windows([w for w in windows if w.doc_id in ("d1", "d2")], budget=4, heldout_fraction=0.5)


def test_lambda_and_alpha_are_those_of_the_select_windows_and_the_r2_that_of_the_report_windows(
        corpus, tiny_source, tiny_target):
    """λ, α: the best on the select windows' statistics; R²: the adapter's on the report windows, recomputed here."""
    from kvbridge.adapters.adapter import map_tokens
    from kvbridge.adapters.train import split_windows

    cfg = TrainConfig(max_tokens=64 * 20, window_tokens=64, heldout_fraction=0.2, layer_map="mix", k=2)
    adapter, report = train_adapter(tiny_source, tiny_target, [corpus], cfg, progress=False)
    docs, _ = train.read_documents([corpus], cfg.doc_chars)
    every = train.document_windows(docs, tiny_target.tokenizer, cfg.window_tokens)
    random.Random(cfg.seed).shuffle(every)
    tr, sel, rep = split_windows(every, cfg.max_tokens // cfg.window_tokens, cfg.heldout_fraction)
    groups = [tuple(g) for g in adapter.layer_map.tolist()]
    d_s = tiny_source.spec.num_kv_heads * tiny_source.spec.head_dim
    d_t = tiny_target.spec.num_kv_heads * tiny_target.spec.head_dim
    stats = {name: fit.RidgeStats(groups, d_s, d_t) for name in ("train", "select")}
    pairs = {}
    for name, part in (("train", tr), ("select", sel), ("report", rep)):
        pairs[name] = [train.kv_pairs(tiny_source, tiny_target, train.pair_text(
            w.text, tiny_source.tokenizer, tiny_target.tokenizer)) for w in part]
        for p in pairs[name] if name != "report" else []:
            stats[name].add(*p)
    for m in "kv":
        for j in range(len(groups)):
            best = fit.solve_layer(stats["train"], stats["select"], m, j, cfg.lambdas, cfg.mix_step)
            assert adapter.meta.lambdas[m][j] == best.lam
            assert tuple(getattr(adapter, f"mix_{m}")[j].tolist()) == best.alpha
    x = [torch.cat([p[i] for p in pairs["report"]], dim=1) for i in range(4)]
    pk, _ = map_tokens(adapter, x[0], x[1])
    for j, row in enumerate(report.layers):
        sse = float(((pk[j] - x[2][j]) ** 2).sum())
        sst = float(((x[2][j] - x[2][j].mean(0)) ** 2).sum())
        assert row["r2_k"] == pytest.approx(1 - sse / sst, abs=1e-5)
