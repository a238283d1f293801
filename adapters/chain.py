"""`train-adapter --trainer chain|fuser`: the whole recipe of a trained adapter in one resumable call.

corpus files -> documents (ids "<file stem's first word>:NNNNN", held out by a hash of the id) -> windows ->
the teacher cache (dev windows from held-out documents, then training windows in a seeded shuffle) -> ridge from
the first `ridge_windows` training windows (λ and α chosen on the dev windows) -> the stages in order, each starting
from the previous stage's best weights (by dev recovery) -> a folded adapter (chain: format 1-3, or 4 with a context
branch, `context_window`: context.py) or a format-2 fuser.

With `init` (a trained adapter of this pair) the ridge fit is skipped: the stages train a residual on that adapter,
whitened by statistics of the ridge windows read through its own layer groups and token table (init/), e.g. to
fine-tune the shipped adapter with exact tails (`exact_tail`: trainer.py) for selective recompute.

Everything lands under one work folder (teacher/, ridge/ or init/, stage-N-OBJECTIVE/), so a rerun of the same command
resumes where it stopped: finished teacher windows are skipped, the ridge fit is read back, a stage continues
from its last checkpoint. Each of them records what it was made from (work_folder.py: the corpus files' sha256, the
options that shape it, the adapter it started from), and a rerun that asks for anything else is refused by the
option's name before any teacher window is computed, not served the old results. Stages are given in optimiser
steps, so a run is a function of the command and the seed, not of how busy the machine was.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvbridge.adapters.adapter import Adapter
from kvbridge.adapters.answer_probe import AnswerProbe
from kvbridge.adapters.answer_windows import AnswerCache, AnswerConfig, answer_windows
from kvbridge.adapters.chain_start import (
    context_config,
    init_start,
    load_init,
    read_start,
    ridge_start,
    start_inputs,
)
from kvbridge.adapters.context import ContextConfig, ContextMaps
from kvbridge.adapters.distributed import build_teacher_cache, is_main, world_size
from kvbridge.adapters.fuser import FuserConfig, FuserMaps
from kvbridge.adapters.layer_map import LAYER_MAPS
from kvbridge.adapters.pairs import start_token_id
from kvbridge.adapters.recovery_probe import RecoveryProbe
from kvbridge.adapters.residual import CapacityConfig, ResidualMaps
from kvbridge.adapters.teacher import (
    TeacherConfig,
    Window,
    document_windows,
    is_heldout,
    makes_window,
    split_documents,
)
from kvbridge.adapters.trainer import (
    ANSWER_OBJECTIVES,
    OBJECTIVES,
    TrainerConfig,
    batch_indices,
    check_resume,
    train,
)
from kvbridge.adapters.work_folder import corpus_digest
from kvbridge.transfer.align import tokenize
from kvbridge.transfer.models import LoadedModel

DEFAULT_LR = {"attention": 3e-3, "kl": 3e-3, "ce": 3e-3, "answer": 1e-3, "decision": 1e-3, "onpolicy": 1e-3}
DEFAULT_EVAL_INTERVAL = {"attention": 40, "kl": 25, "ce": 20, "answer": 25, "decision": 25, "onpolicy": 25}


def parse_stages(text: str) -> tuple[tuple[str, int], ...]:
    """"attention:300,kl:600" -> (("attention", 300), ("kl", 600)): objective and optimiser steps per stage."""
    stages = []
    for part in text.split(","):
        name, _, steps = part.strip().partition(":")
        if name not in OBJECTIVES or not steps.isdigit() or int(steps) < 1:
            raise ValueError(f"a stage is OBJECTIVE:STEPS with OBJECTIVE in {OBJECTIVES} and STEPS >= 1, got {part!r}")
        stages.append((name, int(steps)))
    return tuple(stages)


@dataclass(frozen=True)
class ChainConfig:
    stages: tuple[tuple[str, int], ...] = (("attention", 300), ("kl", 600))
    fuser_rank: int = 0  # > 0: train a fuser of this rank (stages "ce" only) instead of a projection
    token_rank: int = 0  # > 0: the projection's maps also read the target's token features of this rank
    source_rank: int = 0  # > 0: the maps read a basis of this rank over all source layers (format 3), not a mix
    context_window: int = 0  # > 0: a context branch over that many tokens before each token (format 4, context.py)
    context_rank: int = 32  # its hidden width per target layer
    context_norm: bool = True  # False: its filter's output goes to its GEMM without a norm (format 5)
    train_windows: int = 1400  # training windows put in the teacher cache (in the seeded shuffle's order)
    ridge_windows: int = 200  # of them, for the ridge statistics
    dev_per_corpus: int = 12  # held-out windows per corpus file: λ/α, and the stages' best-checkpoint choice
    heldout_fraction: float = 0.08  # documents held out (blake2b of the id), never trained on
    doc_chars: int = 8000
    layer_map: str = "mix"
    k: int = 3
    batch_windows: int = 4
    init: str = ""  # a trained adapter of this pair to start from (no ridge fit); its token rank is the run's
    exact_tail: float = 0.0  # the kl/ce stages' exact tails (trainer.TrainerConfig.exact_tail)
    decision_weight: float = 1.0  # the decision stages' hinge beside the answer KL (TrainerConfig.decision_weight)
    answer_windows: int = 0  # answer windows for the "answer" stages (answer_windows.py), from training documents;
    #                          with any, every stage also reports dev fidelity on dev answer windows (answer_dev a file)
    answer_dev: int = 0  # dev answer windows per corpus file (held-out dev documents); 0: dev_per_corpus. The dev
    #                      fidelity of 24 windows moves by +-0.05 between checkpoints that score alike held out
    keep: str = "best"  # each stage's checkpoint: "best" by its dev score (fidelity for answer stages), or "last"
    answer: AnswerConfig = AnswerConfig()
    lr: dict = field(default_factory=lambda: dict(DEFAULT_LR))
    teacher: TeacherConfig = TeacherConfig()
    seed: int = 0

    def __post_init__(self):
        if not self.stages:
            raise ValueError("no stages")
        if self.keep not in ("best", "last"):
            raise ValueError(f"keep is 'best' or 'last', got {self.keep!r}")
        for name, steps in self.stages:
            if name not in OBJECTIVES or steps < 1:
                raise ValueError(f"bad stage {name}:{steps}")
            if self.fuser_rank and name != "ce":  # (answer windows keep no target KV to fuse with)
                raise ValueError(f"a fuser trains on stage 'ce' only, got {name!r}")
        if self.fuser_rank and self.token_rank:
            raise ValueError("token features are for projections: a fuser adds to the target's own KV, which has them")
        if self.token_rank < 0 or self.source_rank < 0:
            raise ValueError(f"token_rank and source_rank must be >= 0, got {self.token_rank}, {self.source_rank}")
        if self.fuser_rank and self.source_rank:
            raise ValueError("a source basis is for projections; the fuser reads a mix of source layers")
        if self.context_window < 0 or (self.context_window and self.fuser_rank):
            raise ValueError(f"a context window is for projections and >= 0, got {self.context_window}"
                             + (" with a fuser" if self.fuser_rank else ""))
        if self.context_window:
            ContextConfig(window=self.context_window, rank=self.context_rank)  # names a bad rank
        if self.init and self.fuser_rank:
            raise ValueError("init starts a projection from a trained adapter; a fuser starts from its own KV")
        if self.exact_tail and not any(name in ("kl", "ce") for name, _ in self.stages):
            raise ValueError("exact_tail applies to the kl and ce stages; there is none")
        if not self.teacher.queries and any(name == "attention" for name, _ in self.stages):
            raise ValueError("an attention stage reads the target's queries: the teacher cache must keep them")
        if isinstance(self.answer, dict):  # from a saved record's JSON
            object.__setattr__(self, "answer", AnswerConfig(**self.answer))
        if any(name in ANSWER_OBJECTIVES for name, _ in self.stages) and self.answer_windows < 1:
            raise ValueError("an answer (decision, onpolicy) stage trains on answer windows: answer_windows must "
                             "be >= 1")
        if not self.decision_weight > 0:
            raise ValueError(f"decision_weight must be > 0, got {self.decision_weight}")
        if self.answer_windows < 0 or self.answer_dev < 0:
            raise ValueError(f"answer_windows and answer_dev must be >= 0, got {self.answer_windows}, "
                             f"{self.answer_dev}")
        if self.train_windows < self.ridge_windows or self.ridge_windows < 1 or self.dev_per_corpus < 1:
            raise ValueError("need train_windows >= ridge_windows >= 1 and dev_per_corpus >= 1")
        if self.batch_windows < 1:
            raise ValueError(f"--batch-windows must be >= 1, got {self.batch_windows}")
        if not 0 <= self.exact_tail < 1:
            raise ValueError(f"--exact-tail must be in [0, 1), got {self.exact_tail}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.layer_map not in LAYER_MAPS:
            raise ValueError(f"--layer-map must be one of {LAYER_MAPS}, got {self.layer_map!r}")
        if self.fuser_rank < 0:
            raise ValueError(f"--fuser-rank must be >= 0, got {self.fuser_rank}")
        for name, lr in self.lr.items():
            if name not in OBJECTIVES:
                raise ValueError(f"--stage-lr names {name!r}, not a stage: the stages are {', '.join(OBJECTIVES)}")
            if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < math.inf:
                raise ValueError(f"--stage-lr {name}={lr}: a learning rate must be a finite number > 0")
        self.stage_configs()  # names a stage the trainer would refuse, before any work

    def stage_configs(self) -> list[TrainerConfig]:
        """Each stage's trainer config: its rate from `lr` (a tenth of it at the end of the cosine), its seed the
        run's plus its index, exact tails for kl and ce, the checkpoint kept by `keep` and its objective."""
        out = []
        for n, (objective, steps) in enumerate(self.stages):
            lr = self.lr.get(objective, DEFAULT_LR[objective])
            out.append(TrainerConfig(
                objective=objective, lr=lr, min_lr=lr / 10, warmup_iters=min(10, steps - 1), max_iters=steps,
                batch_windows=self.batch_windows, eval_interval=DEFAULT_EVAL_INTERVAL[objective], seed=self.seed + n,
                exact_tail=self.exact_tail if objective in ("kl", "ce") else 0.0,
                decision_weight=self.decision_weight,
                select="last" if self.keep == "last" else "fidelity" if objective in ANSWER_OBJECTIVES else "recovery"))
        return out


def corpus_name(path: str | Path) -> str:
    """pydoc_corpus.txt -> "pydoc", kernel_docs_corpus.txt -> "kernel": the prefix of every document id."""
    return Path(path).stem.split("_")[0].split("-")[0] or "corpus"


def select_windows(files: list[str | Path], target_tokenizer, config: ChainConfig) -> tuple[list[Window], list[Window]]:
    """(dev, train): dev windows sampled from held-out documents of every file, training windows from the others
    in a seeded shuffle. No training window comes from a held-out document."""
    rng = random.Random(config.seed)
    dev, train_all = [], []
    names = [corpus_name(f) for f in files]
    if len(set(names)) != len(names):
        raise ValueError(f"corpus files need distinct name prefixes (document ids), got {names}")
    for path, name in zip(files, names):
        windows = document_windows(split_documents(path, name, config.doc_chars), target_tokenizer,
                                   config.teacher.window_tokens)
        held = [w for w in windows if is_heldout(w.doc_id, config.heldout_fraction)]
        held_dev = [w for w in held if is_heldout(w.doc_id, 0.5, salt="dev")]
        if len(held_dev) < config.dev_per_corpus:
            raise ValueError(f"{path}: {len(held_dev)} held-out dev windows, {config.dev_per_corpus} wanted")
        dev += rng.sample(held_dev, config.dev_per_corpus)
        train_all += [w for w in windows if not is_heldout(w.doc_id, config.heldout_fraction)]
    rng.shuffle(train_all)
    return dev, train_all[:config.train_windows]


def valid_windows(config: ChainConfig, train_w: list[Window], target_tokenizer) -> list[Window]:
    """The training windows that make teacher windows (their text re-tokenises to a whole window, as
    teacher.teacher_window requires: teacher.makes_window): the ridge reads the first of them, the draws index them."""
    def target_ids(w: Window) -> int:  # as pair_text makes them: the start token and the text's tokens
        return 1 + len(tokenize(target_tokenizer, w.text, add_special_tokens=False).ids)

    return [w for w in train_w if makes_window(target_ids(w), config.teacher)]


def kv_windows(config: ChainConfig, dev: list[Window], valid: list[Window]) -> set[str] | None:
    """The ids of the teacher windows that must keep the target's own KV: the dev windows (the recovery probe reads
    it) and the ridge windows (the statistics: the first `ridge_windows` of `valid`, valid_windows), and every window
    when a stage reads it (attention matching, a fuser's ce); None for every window. The rest are lean (teacher.py):
    the kl and ce stages of a projection read only the source's features and the teacher's log-probs."""
    if config.fuser_rank or any(name == "attention" for name, _ in config.stages):
        return None
    return {w.id for w in dev} | {w.id for w in valid[:config.ridge_windows]}


def windows_read(config: ChainConfig, valid: list[Window]) -> set[int] | None:
    """When a run's stages read fewer training windows than it selected: the positions among the windows that make
    teacher windows (valid_windows) that are read: the ridge windows and every draw of every stage. A stage's draws
    are a function of its seed, its steps and the number of windows (trainer.batch_indices), so a teacher cache of
    only those trains exactly as one of every window (tested) and takes a fraction of its time (the shipped adapter's
    second command draws 300 of its 800 windows). None when the stages read about every window, or a stage reads
    every window's KV (attention matching, a fuser)."""
    if config.fuser_rank or any(name == "attention" for name, _ in config.stages):
        return None
    stages = [(n, steps) for n, (name, steps) in enumerate(config.stages) if name not in ANSWER_OBJECTIVES]
    if sum(steps for _, steps in stages) * config.batch_windows + config.ridge_windows >= len(valid):
        return None
    read = set(range(min(config.ridge_windows, len(valid))))
    for n, steps in stages:
        for it in range(steps):
            read.update(batch_indices(config.seed + n, config.batch_windows, it, len(valid)))
    return read


def answer_windows_read(config: ChainConfig, windows: int) -> set[int] | None:
    """The positions among `windows` selected answer windows that the answer stages draw (their draws index every
    selected window, one whose answer turns out empty too: trainer.batch_indices), as `windows_read` for the
    continuation windows; None when they draw about every one."""
    stages = [(n, steps) for n, (name, steps) in enumerate(config.stages) if name in ANSWER_OBJECTIVES]
    if sum(steps for _, steps in stages) * config.batch_windows >= windows:
        return None
    return {i for n, steps in stages for it in range(steps)
            for i in batch_indices(config.seed + n, config.batch_windows, it, windows)}


def select_answer_windows(files: list[str | Path], target_tokenizer, config: ChainConfig
                          ) -> tuple[list[Window], list[Window]]:
    """(dev, train) answer windows: dev from answer_dev (else dev_per_corpus) held-out dev documents of every file
    (the documents the dev windows come from; fewer where a file has fewer), asked in a wording of their own
    (answer_windows.DEV_INSTRUCTION); train from the other documents, answer_windows of them in a seeded shuffle
    (more than one per document when there are fewer documents)."""
    rng = random.Random(config.seed + 1)
    dev, train_docs = [], []
    for path in files:
        docs = split_documents(path, corpus_name(path), config.doc_chars)
        held = [d for d in docs if is_heldout(d[0], config.heldout_fraction) and is_heldout(d[0], 0.5, salt="dev")]
        dev += answer_windows(rng.sample(held, min(len(held), config.answer_dev or config.dev_per_corpus)),
                              target_tokenizer, config.answer, dev=True)
        train_docs += [d for d in docs if not is_heldout(d[0], config.heldout_fraction)]
    if not train_docs:
        return dev, []
    per_document = -(-config.answer_windows // len(train_docs))
    train_w = answer_windows(train_docs, target_tokenizer, config.answer, per_document)
    rng.shuffle(train_w)
    return dev, train_w[:config.answer_windows]


def stage_context(config: ChainConfig, init: Adapter | None) -> ContextConfig | None:
    """The context branch the stages train: the --init adapter's (it goes on training), else the command's, else
    none."""
    if config.fuser_rank:
        return None
    if init is not None and init.ctx_lags is not None:
        return ContextConfig.of(init)
    return context_config(config) if config.context_window else None


def stage_plan(config: ChainConfig, start: dict, context: ContextConfig | None
               ) -> list[tuple[TrainerConfig, str, dict]]:
    """Each stage's trainer config, folder name and inputs (work_folder.py: the starting point's, the windows it reads
    and the stages before it), in order."""
    kind = f"-context{context.window}r{context.rank}{'' if context.norm else '-nonorm'}" if context else ""
    base = {"start": start, "train_windows": config.train_windows, "dev_per_corpus": config.dev_per_corpus,
            "fuser_rank": config.fuser_rank, "context": None if context is None else dataclasses.asdict(context),
            "answer_windows": config.answer_windows, "answer_dev": config.answer_dev,
            "answer": dataclasses.asdict(config.answer) if config.answer_windows else None}
    plan = []
    for n, tc in enumerate(config.stage_configs()):
        objective = tc.objective
        weighted = f"-w{config.decision_weight:g}" if objective == "decision" and config.decision_weight != 1 else ""
        # what the stages before made: their objective, steps and rate, and a kl or ce stage's exact tail (the one
        # option they take that a later stage's own config does not hold; recorded when set, as records before it)
        before = [[c.objective, c.max_iters, c.lr] + ([{"exact_tail": c.exact_tail}] if c.exact_tail else [])
                  for c, _, _ in plan]
        plan.append((tc, f"stage-{n}-{objective}{weighted}{kind}", base | {"before": before}))
    return plan


def train_chain(source: LoadedModel, target: LoadedModel, files: list[str | Path], config: ChainConfig,
                work: str | Path, progress: bool = True) -> tuple[Adapter | FuserMaps, dict]:
    """Run (or resume) the recipe; returns the trained adapter (chain: folded, format 1) or fuser, and a record of
    what ran: windows, seconds per phase, each stage's steps, best step and dev recovery. Under torchrun: collective
    (distributed.py: the teacher cache and the statistics split by rank, rank 0 writes), the record also says how many
    ranks ran and how many teacher windows each computed.

    Before any teacher window is computed: the --init adapter is checked against the models, and every checkpoint
    the work folder holds against what this run asks (work_folder.py): one made for other options, another corpus or
    another starting point is refused by name."""
    work = Path(work)
    began = time.perf_counter()
    if world_size() > config.batch_windows:  # (trainer.train's refusal, before the work rather than after it)
        raise ValueError(f"{world_size()} ranks share each step's {config.batch_windows} windows: every rank needs at "
                         "least one (raise the batch, --batch-windows, or start fewer processes)")
    init = load_init(config, source, target) if config.init else None
    dev, train_w = select_windows(files, target.tokenizer, config)
    t0 = time.perf_counter()
    valid = valid_windows(config, train_w, target.tokenizer)
    read = windows_read(config, valid)
    needed = valid if read is None else [w for i, w in enumerate(valid) if i in read]
    corpus = corpus_digest(files)
    start = start_inputs(config, corpus, dev, valid[:config.ridge_windows])
    context = stage_context(config, init)
    plan = stage_plan(config, start, context)
    saved_start = read_start(work, config, start)
    for tc, name, inputs in plan:
        check_resume(work / name, tc, inputs)
    cache, made = build_teacher_cache(work / "teacher", source, target, dev + needed, config.teacher,
                                      start_token_id(target.tokenizer), progress=progress,
                                      kv_ids=kv_windows(config, dev, valid),
                                      corpus={"files": corpus, "doc_chars": config.doc_chars})
    teacher_s = time.perf_counter() - t0
    pos = {e["id"]: i for i, e in enumerate(cache.entries)}
    dev_idx = [pos[w.id] for w in dev if w.id in pos]  # a window too short after re-tokenising is skipped
    # every valid window keeps its place (the draws index them); one no step reads is -1
    train_idx = [pos.get(w.id, -1) for w in valid]
    if any(train_idx[i] < 0 for i in (range(len(valid)) if read is None else read)):
        raise RuntimeError(f"{sum(train_idx[i] < 0 for i in (read or range(len(valid))))} training windows the run "
                           "reads made no teacher window: teacher.makes_window and teacher_window disagree")
    answers, answer_s = None, 0.0
    if config.answer_windows:
        t0 = time.perf_counter()
        a_dev, a_train = select_answer_windows(files, target.tokenizer, config)
        a_read = answer_windows_read(config, len(a_train))
        answers, _ = build_teacher_cache(work / "answers", source, target, a_dev + [
            w for i, w in enumerate(a_train) if a_read is None or i in a_read], config.answer,
            start_token_id(target.tokenizer), progress=progress, cache_class=AnswerCache,
            corpus={"files": corpus, "doc_chars": config.doc_chars})
        answer_s = time.perf_counter() - t0
        a_pos = {e["id"]: i for i, e in enumerate(answers.entries)}
        a_dev_idx = [a_pos[w.id] for w in a_dev if w.id in a_pos]  # an empty answer makes no window
        # every selected window keeps its place: None where its answer is empty (a draw of it adds nothing to its
        # step), -1 where no stage draws it (left out of the cache)
        a_empty = set(answers.empty)
        a_train_idx = [a_pos[w.id] if w.id in a_pos else None if w.id in a_empty else -1 for w in a_train]
        if any(a_train_idx[i] == -1 for i in (range(len(a_train)) if a_read is None else a_read)):
            raise RuntimeError(f"{work / 'answers'} lacks answer windows the run draws")
    if init is not None:
        ridge, stats, ridge_s = init_start(work, saved_start, start, init, cache, train_idx, target, config, progress)
    else:
        ridge, stats, ridge_s = ridge_start(work, saved_start, start, cache, train_idx, dev_idx, target, config,
                                            progress)
    torch.manual_seed(config.seed)
    if config.fuser_rank:
        maps = FuserMaps.from_ridge(ridge, stats, FuserConfig(rank=config.fuser_rank))
    elif context is not None:
        maps = ContextMaps(ridge, stats, context)
        if init is not None and init.ctx_lags is not None:  # the branch goes on training from where it ended
            maps.unfold(ridge)
    else:
        maps = ResidualMaps(ridge, stats, CapacityConfig())
    probe = (RecoveryProbe.from_cache(target, ridge.start_kv, cache, dev_idx, config.teacher.context_tokens)
             if is_main() else None)  # rank 0 scores the dev windows
    answer_probe = (AnswerProbe(target, ridge.start_kv, answers, a_dev_idx, config.answer.max_answer_tokens)
                    if answers is not None and is_main() else None)
    record: dict = {"teacher_windows": {"dev": len(dev_idx), "train": len(train_idx),
                                        "ridge": min(config.ridge_windows, len(train_idx)),
                                        "cached": sum(i >= 0 for i in train_idx)},
                    "teacher_cache_s": round(teacher_s), "ridge_s": round(ridge_s), "stages": []}
    if answers is not None:
        record |= {"answer_windows": {"dev": len(a_dev_idx), "train": len(a_train_idx),
                                      "cached": sum(i is not None and i >= 0 for i in a_train_idx),
                                      "empty": sum(i is None for i in a_train_idx)},
                   "answer_cache_s": round(answer_s)}
    if world_size() > 1:
        record["ranks"] = {"world_size": world_size(), "teacher_windows_made": made}
    for tc, name, inputs in plan:
        objective = tc.objective
        stage_cache, stage_idx = (answers, a_train_idx) if objective in ANSWER_OBJECTIVES else (cache, train_idx)
        out = train(maps, ridge.start_kv, target, stage_cache, stage_idx, probe, tc, config.teacher.context_tokens,
                    work / name, resume=True, progress=progress, answers=answer_probe, inputs=inputs)
        best = next((r for r in out["record"] if r["iter"] == out["best_iter"]), {})
        dev_scores = {k: round(best[k], 4) for k in ("dev_recovery", "dev_fidelity", "dev_rougeL", "dev_top1",
                                                     "dev_greedy") if k in best}
        record["stages"].append({"objective": objective, "steps": out["iters"], "best_step": out["best_iter"],
                                 "select": tc.select, **dev_scores, "lr": tc.lr,
                                 "seconds": round(out["elapsed_s"]),
                                 "tokens_per_s": round(out["iters"] * out["tokens_per_step"] / out["elapsed_s"])})
    record["wall_s"] = round(time.perf_counter() - began)
    if config.fuser_rank:
        return maps, record
    adapter = maps.to_adapter(ridge)
    meta = dataclasses.replace(adapter.meta, corpus={}, training={})
    return dataclasses.replace(adapter, meta=meta), record
