"""Fitting a target's induction prior (transfer/suffix/induction.py) by the continuation's NLL, as the `kvbridge prior
fit` command (prior_cli.py) made the one that ships (transfer/suffix/priors/).

Per (layer, query head) four terms (induction.TERMS): the match, the longer match, every projected key, a projected
key of the query's own token. Init: the probed prior (3 × induction score where the score >= 0.1, else 0; the other
two terms 0). Training windows: `window_tokens` target tokens of the adapter's training corpora (the documents the
chain's split keeps for training, never its held-out ones: the split the adapter file records, eval.heldout's
`training_split`; a corpus the adapter does not record reading, or other bytes than it read, is refused), shuffled by
seed 0, cut by eval's `prepare` to 512 tokens of context and 32 of continuation, those with at least 400 context
tokens kept; the first `dev` of them are
the dev windows, the next `windows - dev` the training ones. Each is projected by a kvbridge server serving the
adapter the prior is fitted for (`--adapter FILE`, default the pair's shipped one; the windows folder records its
digest and refuses another's), and its last 10% recomputed by the target (`recompute:0.1`'s cache). The prior file
records that adapter's name and digest (`InductionPrior.stale_for`: what reads the prior over another adapter's
projection says so).

A step: one training window drawn by random.Random(0), read as recompute:0.1 (p 0.7) or replace; the loss is the
mean NLL of its 31 continuation tokens with the prior on the projected keys (`--objective answer`: of the target's own
greedy answer to an instruction after the window, eval/prior_answers.py), plus lam × ||theta - init||²; Adam at
lr 0.03. Every `dev_every` steps the dev NLL (summed over the dev windows, in both readings) is recorded, and a
checkpoint written (theta and Adam's state): a run resumes from it exactly.

`kvbridge prior check FILE --until N` reruns the recipe recorded in FILE up to step N, building only the windows
those steps read (or reading those --work holds), and compares its dev NLL there with FILE's record (relative
tolerance FILE records): the shipped prior's reproduction test. It computes every step itself: a fit's checkpoint in
--work is neither read nor written.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import torch
import torch.nn.functional as F
from kvbridge.adapters.work_folder import write_tensors
from kvbridge.transfer import kvcache
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.suffix.induction import InductionPrior, induction_scores
from kvbridge.transfer.suffix.reuse import prefill_after
from kvbridge.transfer.tensor_files import json_field, read_metadata, read_tensors, readable, save_tensors

RECOMPUTE = 0.1  # recompute:0.1: the share of the context the target recomputes at its end
OBJECTIVES = ("continuation", "answer")
TOLERANCE = 2e-4  # relative, on a dev NLL: float reduction order differs across CPUs; 50 steps move it ~10x more


@dataclass(frozen=True)
class Recipe:
    preset: str = "small"
    windows: int = 360  # dev + training windows
    dev: int = 40
    steps: int = 300
    lam: float = 0.001  # weight of ||theta - init||²
    lr: float = 0.03
    window_tokens: int = 560  # target tokens cut from a document per window (before `prepare`)
    min_context: int = 400
    dev_every: int = 50
    # What the fit lowers: "continuation", the NLL of the 31 tokens after the context (the shipped prior's), or
    # "answer", the NLL of the target's own greedy answer to an instruction after the context (prior_answers.py)
    objective: str = "continuation"

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise ValueError(f"the prior fit's objective is one of {', '.join(OBJECTIVES)}, not {self.objective!r}")
        if not 0 < self.dev < self.windows:
            raise ValueError(f"the prior fit needs 0 < dev ({self.dev}) < windows ({self.windows})")
        if self.steps < 1 or self.dev_every < 1 or self.lam < 0 or self.lr <= 0:
            raise ValueError(f"the prior fit needs steps >= 1, dev_every >= 1, lam >= 0 and lr > 0: {self}")


def initial_terms(target: LoadedModel) -> torch.Tensor:
    """[4, L, H_q]: the probed prior's match terms (3 × score where the score >= 0.1), the other two 0."""
    scores = induction_scores(target)
    init = torch.where(scores >= 0.1, 3 * scores, torch.zeros_like(scores))
    return torch.stack((init, init, torch.zeros_like(init), torch.zeros_like(init)))


def continuation_nll(target: LoadedModel, kv: torch.Tensor, ids: torch.Tensor, cont: torch.Tensor,
                     projected: torch.Tensor, terms: torch.Tensor, scored_from: int = 1) -> torch.Tensor:
    """Summed NLL of cont[scored_from:] after the cache read with the prior `terms` on the keys where `projected`,
    every layer through the prior's attention (so every head's terms get a gradient, as the shipped prior was fitted).
    kv: [L, 2, H, T, D] rotated at positions 0..T-1 of ids [T]; cont: [N]; projected: [T] bool; scored_from >= 1 (an
    answer window's cont is its instruction and answer, and only the answer is scored). The gradient reaches terms
    (the prior's attention passes it on)."""
    t = ids.numel()
    cache = kvcache.build_cache(kv[:, :, None].float())
    with InductionPrior(terms, every_layer=True).reading(target, ids, projected):
        logits = target.model(input_ids=cont[None], position_ids=torch.arange(t, t + cont.numel())[None],
                              cache=cache, use_cache=True).logits[0]
    return F.cross_entropy(logits[scored_from - 1:-1].float(), cont[scored_from:], reduction="sum")


def reading(window: dict, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv, ids, cont, projected) of a built window read as `replace` or `recompute` (its recomputed tail in); an
    answer window's cont is its instruction and answer (prior_answers.AnswerWindows)."""
    ids, kv = window["ids"], window["kv"].float()
    cont = torch.cat((window["prompt"], window["answer"])) if "answer" in window else window["cont"]
    t = ids.numel()
    projected = torch.zeros(t, dtype=torch.bool)
    if mode == "replace":
        projected[1:] = True
        return kv, ids, cont, projected
    k = window["tail"].shape[3]
    projected[1:t - k] = True
    return torch.cat((kv[:, :, :, :t - k], window["tail"].float()), 3), ids, cont, projected


class Windows:
    """The recipe's windows, built on demand into `folder` (NNNN.safetensors: ids, cont, kv and tail in bf16) from
    the corpora in `data`, projected by an in-process kvbridge server of the preset serving the adapter file
    `adapter` (folder/adapter.json records its name and digest: a folder of another adapter's windows is refused)."""

    def __init__(self, recipe: Recipe, data: Path, folder: Path, source: LoadedModel, target: LoadedModel,
                 adapter: Path):
        self.recipe, self.data, self.folder = recipe, Path(data), Path(folder)
        self.source, self.target, self.adapter_file = source, target, Path(adapter)
        self.adapter = adapter_record(self.adapter_file)
        self.folder.mkdir(parents=True, exist_ok=True)
        record = self.folder / "adapter.json"
        if record.is_file():
            made = json.loads(record.read_text())
            if made.get("digest") != self.adapter["digest"]:
                raise ValueError(f"{self.folder} holds windows projected by adapter {made.get('name')} "
                                 f"({str(made.get('digest'))[:16]}), not by {self.adapter['name']} "
                                 f"({self.adapter['digest'][:16]}): use another --work folder")
        elif any(self.folder.glob("*.safetensors")):
            raise ValueError(f"{self.folder} holds windows that record no adapter (made before adapters were "
                             "recorded): use another --work folder")
        else:
            record.write_text(json.dumps(self.adapter))
        self._loaded: dict[int, dict] = {}

    def path(self, index: int) -> Path:
        return self.folder / f"{index:04d}.safetensors"

    @cached_property
    def split(self):
        """The adapter's training split (eval.heldout.TrainingSplit), as its file records it."""
        from kvbridge.eval.heldout import training_split

        return training_split(self.adapter_file)

    def _candidates(self):
        from kvbridge.adapters.chain import corpus_name
        from kvbridge.adapters.teacher import document_windows, is_heldout, split_documents
        from kvbridge.eval.records import Record
        from kvbridge.eval.summaries import EvalConfig, prepare

        names = {n: corpus_name(n) for n in ("pydoc_corpus.txt", "kernel_docs_corpus.txt")}  # the trainer's ids
        missing = [n for n in names if not (self.data / n).is_file()]
        if missing:
            raise FileNotFoundError(f"the prior fit reads {' and '.join(names)} from --data {self.data}, which lacks "
                                    f"{', '.join(missing)} (`kvbridge data build --out DIR` makes them)")
        split = self.split
        for n in names:
            split.check_corpus(self.data / n)
        docs = [d for n, name in names.items() for d in split_documents(self.data / n, name, split.doc_chars)]
        # the chain's split: never its held-out documents
        train = [d for d in docs if not is_heldout(d[0], split.heldout_fraction)]
        windows = document_windows(train, self.target.tokenizer, self.recipe.window_tokens)
        random.Random(0).shuffle(windows)
        config = EvalConfig()
        for w in windows:
            doc = prepare(Record(w.id, w.text, "-"), self.target, config)
            if doc is not None and doc.doc_tokens >= self.recipe.min_context and doc.continuation.numel() >= 32:
                yield doc

    def build(self, needed: set[int], log=print) -> None:
        """Project the windows of `needed` (indices < recipe.windows) that are not in the folder yet."""
        todo = {i for i in needed if not readable(self.path(i))}  # a copy cut short is made again
        if not todo:
            return
        from kvbridge.eval.run import start_local_server
        from kvbridge.server.client import KVBridgeClient

        running = start_local_server(self.source, self.target, self.recipe.preset, str(self.adapter_file), False)
        try:
            with KVBridgeClient(running.address, timeout_s=600) as client:
                for index, doc in enumerate(self._candidates()):
                    if index > max(todo):
                        break
                    if index not in todo:
                        continue
                    t0 = time.perf_counter()
                    entry = client.ingest(text=doc.text).entries[0]
                    segment = client.fetch_projected(key=entry.key, target_model=self.target.name,
                                                     mode="replace").segment
                    self._save(index, doc, segment.kv.float())
                    log(f"window {index} {doc.record.id} {doc.doc_tokens} tokens {time.perf_counter() - t0:.1f} s")
            found = sum(readable(self.path(i)) for i in todo)
            if found < len(todo):
                raise ValueError(f"the corpora in {self.data} give {found} of the {len(todo)} windows asked for")
        finally:
            running.stop(1)

    def _save(self, index: int, doc, kv: torch.Tensor) -> None:
        # kv: [L, 2, H, T, D] the projection of the window's ids, rotated at positions 0..T-1
        ids = doc.target_ids
        k = max(1, round(RECOMPUTE * doc.doc_tokens))
        t = ids.numel()
        head = KVSegment(kv=kv[:, :, :, :t - k], token_ids=ids[:t - k], positions=torch.arange(t - k),
                         model=self.target.spec.identity, rotated=True)
        tail = prefill_after(self.target, head, ids[t - k:]).kv.float()
        write_tensors(self.path(index), {"ids": ids, "cont": doc.continuation, "kv": kv.to(torch.bfloat16),
                                         "tail": tail.to(torch.bfloat16)}, metadata={"id": doc.record.id})

    def __getitem__(self, index: int) -> dict:
        if index not in self._loaded:
            self._loaded[index] = read_tensors(self.path(index))[0]
        return self._loaded[index]


def draws(recipe: Recipe, steps: int) -> list[tuple[int, str]]:
    """(window index, reading) of steps 1..steps: what random.Random(0) picks."""
    rng = random.Random(0)
    out = []
    for _ in range(steps):
        index = recipe.dev + rng.randrange(recipe.windows - recipe.dev)
        out.append((index, "recompute" if rng.random() < 0.7 else "replace"))
    return out


def window_nll(target: LoadedModel, window: dict, mode: str, terms: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(summed NLL, tokens scored) of a window read as `mode`: its continuation's tokens after the first, or an answer
    window's answer tokens (0 for an empty answer)."""
    if "answer" not in window:
        return continuation_nll(target, *reading(window, mode), terms), window["cont"].numel() - 1
    n = window["answer"].numel()
    if n == 0:
        return torch.zeros(()), 0
    return continuation_nll(target, *reading(window, mode), terms, scored_from=window["prompt"].numel()), n


def dev_nll(target: LoadedModel, windows: Windows, terms: torch.Tensor) -> list[float]:
    """Summed NLL over the dev windows, read as recompute:0.1 and as replace."""
    with torch.no_grad():
        return [sum(float(window_nll(target, windows[i], mode, terms)[0]) for i in range(windows.recipe.dev))
                for mode in ("recompute", "replace")]


def fit(recipe: Recipe, target: LoadedModel, windows: Windows, work: Path | None, until: int | None = None,
        log=print, init: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """(theta [4, L, H_q], the dev NLL at step 0 and every dev_every steps), from `init` ([4, L, H_q]; default
    `initial_terms`: a head whose four terms are 0 reads as the model does and gets no gradient). Resumes from
    work/checkpoint.safetensors when it holds this recipe's run, and writes it at every dev mark; work None: every
    step computed here, no checkpoint read or written (`prior check`: a reproduction reruns the recipe)."""
    last = recipe.steps if until is None else min(until, recipe.steps)  # (until 0: the start's dev NLL alone)
    picks = draws(recipe, last)
    windows.build(set(range(recipe.dev)) | {i for i, _ in picks}, log)
    for p in target.model.parameters():
        p.requires_grad_(False)
    init = initial_terms(target) if init is None else init.float()
    theta = torch.nn.Parameter(init.clone())
    opt = torch.optim.Adam([theta], lr=recipe.lr)
    checkpoint = Path(work) / "checkpoint.safetensors" if work is not None else None
    if checkpoint is not None:
        checkpoint.parent.mkdir(parents=True, exist_ok=True)
    start, trajectory = _resume(checkpoint, recipe, theta, opt) if checkpoint is not None else (0, {})
    if start == 0:
        trajectory["0"] = dev_nll(target, windows, init)
        log(f"step 0 dev NLL {trajectory['0']}")
    for step in range(start + 1, last + 1):
        index, mode = picks[step - 1]
        nll, scored = window_nll(target, windows[index], mode, theta)
        loss = nll / max(scored, 1)
        reg = recipe.lam * ((theta - init) ** 2).sum()
        opt.zero_grad()
        (loss + reg).backward()
        opt.step()
        if step % recipe.dev_every == 0 or step == recipe.steps:
            trajectory[str(step)] = dev_nll(target, windows, theta.detach())
            log(f"step {step} loss {float(loss.detach()):.3f} dev NLL {trajectory[str(step)]}")
            if checkpoint is not None:
                _save_checkpoint(checkpoint, recipe, step, theta, opt, trajectory)
    return theta.detach().clone(), trajectory


def _save_checkpoint(path: Path, recipe: Recipe, step: int, theta, opt, trajectory) -> None:
    state = opt.state[theta]
    save_tensors(path, {"theta": theta.detach().contiguous(), "exp_avg": state["exp_avg"].contiguous(),
                        "exp_avg_sq": state["exp_avg_sq"].contiguous()},
                 metadata={"recipe": json.dumps(asdict(recipe), sort_keys=True), "step": str(step),
                           "trajectory": json.dumps(trajectory)})


def _resume(path: Path, recipe: Recipe, theta, opt) -> tuple[int, dict]:
    if not path.is_file():
        return 0, {}
    tensors, meta = read_tensors(path, names=("theta", "exp_avg", "exp_avg_sq"))
    if "recipe" not in meta or Recipe(**json.loads(meta["recipe"])) != recipe:
        raise ValueError(f"{path} holds a run of another recipe ({meta.get('recipe')}): use another --work folder")
    step = int(meta["step"])
    with torch.no_grad():
        theta.copy_(tensors["theta"])
    opt.state[theta] = {"step": torch.tensor(float(step)), "exp_avg": tensors["exp_avg"],
                        "exp_avg_sq": tensors["exp_avg_sq"]}
    return step, json.loads(meta["trajectory"])


def recorded(path: Path) -> dict:
    header = read_metadata(path)
    meta = json_field(path, header, "kvbridge_prior") if "kvbridge_prior" in header else {}
    if "recipe" not in meta or "dev_nll" not in meta:
        raise ValueError(f"{path} records no recipe and dev NLL (kvbridge_prior metadata): not made by `kvbridge "
                         "prior fit`")
    return meta


def compare(expected: list[float], got: list[float], tolerance: float) -> float:
    """The largest relative difference of two dev NLLs; raises when it passes `tolerance`."""
    gaps = [abs(g - e) / abs(e) for e, g in zip(expected, got, strict=True)]
    worst = max(gaps, key=lambda gap: math.inf if math.isnan(gap) else gap)  # (max passes a NaN after a number by)
    if not worst <= tolerance:  # a NaN (a rerun, or a record, of no number) fails too
        raise ValueError(f"dev NLL {got} differs from the recorded {expected} by {worst:.2e} relative, more than the "
                         f"recorded tolerance {tolerance:.0e}")
    return worst


def adapter_record(path: Path) -> dict:
    """{"name": the file's stem, "digest": Adapter.digest} of an adapter file."""
    from kvbridge.adapters.io import load_adapter

    return {"name": path.name.removesuffix(".safetensors"), "digest": load_adapter(path).digest}
