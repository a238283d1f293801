"""Training an adapter end to end: corpus windows -> aligned KV pairs -> ridge statistics -> per-layer solve,
with held-out metrics (R² and cosine per layer) and optional end-to-end refinement.

The windows are split by document (.jsonl: each record; .txt: runs of ~doc_chars characters of paragraphs, as
the chain's: teacher.split_documents) into three parts that share no document: the maps are fitted on the training
windows, λ and α chosen on the select windows, and R² and cosine reported on the report windows, which neither
fitted the maps nor chose them (`split_windows`)."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from kvbridge.adapters.adapter import Adapter, AdapterMeta, map_tokens, model_record
from kvbridge.adapters.fit import DEFAULT_LAMBDAS, RidgeStats, solve_layer
from kvbridge.adapters.layer_map import LAYER_MAPS, build_layer_map
from kvbridge.adapters.pairs import kv_pairs, pair_text, start_kv, start_token_id
from kvbridge.adapters.teacher import Window, document_windows, split_documents
from kvbridge.adapters.work_folder import write_tensors
from kvbridge.transfer.data import jsonl_rows
from kvbridge.transfer.models import LoadedModel
from safetensors.torch import load_file
from tqdm import tqdm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    layer_map: str = "proportional"  # see layer_map.LAYER_MAPS
    k: int = 3  # source layers per target layer for "mix"
    window_tokens: int = 256  # target tokens per fitting window
    max_tokens: int = 16_384  # target tokens read from the corpus in all (train + held-out)
    heldout_fraction: float = 0.1  # of the windows, held out by document: half choose λ and α, half are reported
    doc_chars: int = 8000  # a .txt file's documents: runs of paragraphs about this long (the unit held out)
    lambdas: tuple[float, ...] = DEFAULT_LAMBDAS  # ridge strengths tried, × the mean input power
    mix_step: float = 0.25  # grid step of the convex mix weights
    seed: int = 0

    def __post_init__(self):
        if self.layer_map not in LAYER_MAPS:
            raise ValueError(f"layer_map must be one of {LAYER_MAPS}, got {self.layer_map!r}")
        if self.k < 1:
            raise ValueError(f"--k must be >= 1, got {self.k}")
        if self.window_tokens < 8:
            raise ValueError(f"window_tokens must be >= 8, got {self.window_tokens}")
        if self.max_tokens < 3 * self.window_tokens:
            raise ValueError(f"max_tokens ({self.max_tokens}) must hold at least three windows of "
                             f"{self.window_tokens} (training, choosing λ and α, the held-out report)")
        if not 0 < self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction must be in (0, 1), got {self.heldout_fraction}")
        if self.doc_chars < 1:
            raise ValueError(f"doc_chars must be >= 1, got {self.doc_chars}")


def _read_files(files: list[str | Path]) -> tuple[list[tuple[Path, bytes]], str]:
    """Every corpus file's (path, bytes), and a sha256 over all their bytes in order."""
    if not files:
        raise ValueError("no corpus files given")
    digest, out = hashlib.sha256(), []
    for f in files:
        path = Path(f)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist")
        raw = path.read_bytes()
        digest.update(raw)
        out.append((path, raw))
    return out, digest.hexdigest()


def read_corpus(files: list[str | Path]) -> tuple[list[str], str]:
    """Texts from .txt files (paragraphs separated by blank lines) and .jsonl files (a "text" field, else
    "document"). Returns the texts and a sha256 over every file's bytes."""
    read, sha = _read_files(files)
    texts: list[str] = []
    for path, raw in read:
        if path.suffix == ".jsonl":
            texts += [body for _, body in _jsonl_texts(path, raw)]
        else:
            texts.append(raw.decode("utf-8", errors="replace"))
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise ValueError(f"the corpus files {[str(f) for f in files]} hold no text")
    return texts, sha


def corpus_windows(texts: list[str], target_tokenizer, window_tokens: int, max_tokens: int, seed: int) -> list[str]:
    """Consecutive chunks of about window_tokens target tokens (cut at token boundaries), shuffled with the
    seed, as many as max_tokens allows."""
    windows = []
    for text in texts:
        enc = target_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        for start in range(0, len(offsets) - window_tokens + 1, window_tokens):
            a, b = offsets[start][0], offsets[start + window_tokens - 1][1]
            chunk = text[a:b]
            if chunk.strip():
                windows.append(chunk)
    random.Random(seed).shuffle(windows)
    return windows[: max(2, max_tokens // window_tokens)]


# how train_adapter splits its windows (recorded in the adapter's corpus metadata and in the --stats key): "documents"
# since the split by document into train / select / report; before it, one held-out part of the shuffled windows both
# chose λ and α and gave the reported R², and windows of one document fell on both sides
SPLIT = "documents"


def read_documents(files: list[str | Path], doc_chars: int) -> tuple[list[tuple[str, str]], str]:
    """The corpus as documents [(doc_id, text)]: a .jsonl file's records (a "text" field, else "document"), id
    "<file name>:<line>"; a .txt file's runs of paragraphs of about doc_chars characters (teacher.split_documents),
    id "<file name>:<index>". Returns them and a sha256 over every file's bytes (as read_corpus's)."""
    read, sha = _read_files(files)
    docs: list[tuple[str, str]] = []
    for path, raw in read:
        if path.suffix == ".jsonl":
            docs += [(f"{path.name}:{n}", body) for n, body in _jsonl_texts(path, raw)]
        else:
            docs += split_documents(path, path.name, doc_chars)
    docs = [(doc_id, text) for doc_id, text in docs if text.strip()]
    if not docs:
        raise ValueError(f"the corpus files {[str(f) for f in files]} hold no text")
    return docs, sha


def _jsonl_texts(path: Path, raw: bytes) -> list[tuple[int, str]]:
    """(line number, text) of every record of a .jsonl corpus file."""
    out = []
    for n, record in jsonl_rows(path, raw.decode("utf-8", errors="replace")):
        body = record.get("text", record.get("document")) if isinstance(record, dict) else None
        if not isinstance(body, str):
            raise ValueError(f"{path}:{n}: expected an object with a string 'text' (or 'document') field")
        out.append((n, body))
    return out


def split_windows(windows: list[Window], budget: int, heldout_fraction: float
                  ) -> tuple[list[Window], list[Window], list[Window]]:
    """(train, select, report) of `budget` windows in all, no document in two of them. `windows`: every window of the
    corpus in a seeded shuffle. Documents are taken in the order of their first window there: report's until it
    holds n = max(1, round(budget · heldout_fraction / 2)) windows, then select's until it holds n, then every other
    document is a training one, of which the first budget − 2n windows are read (a held-out document's windows past
    its part's n are read by nothing)."""
    n = max(1, round(budget * heldout_fraction / 2))
    docs = list(dict.fromkeys(w.doc_id for w in windows))  # in the order of their first window
    part_of: dict[str, str] = {}
    held = {"report": [], "select": []}
    for doc in docs:
        part = next((name for name, got in held.items() if len(got) < n), "train")
        part_of[doc] = part
        if part != "train":
            held[part] += [w for w in windows if w.doc_id == doc][:n - len(held[part])]
    train = [w for w in windows if part_of[w.doc_id] == "train"][:budget - 2 * n]
    if not held["report"] or not held["select"] or not train:
        raise ValueError(f"the corpus gave windows of {len(docs)} document(s): the fit needs at least three, as "
                         "training, choosing λ and α, and the held-out report each read documents of their own "
                         "(give more text: more .jsonl records, or .txt files of more paragraphs; a .txt file's "
                         "documents are runs of paragraphs of ~8,000 characters, TrainConfig.doc_chars)")
    return train, held["select"], held["report"]


@dataclass
class TrainReport:
    layers: list[dict] = field(default_factory=list)  # per target layer: source layers, α, λ, R², cosine of K and V
    train_tokens: int = 0
    heldout_tokens: int = 0  # the report windows' tokens: R² and cosine are of them
    windows: int = 0  # read in all: train + select + report
    select_tokens: int = 0  # the tokens λ and α were chosen on
    documents: dict = field(default_factory=dict)  # {"train", "select", "report": documents read}

    def split(self) -> str:
        """How the windows were used, in one line."""
        d = self.documents
        return (f"{self.train_tokens} training tokens, λ and α chosen on {self.select_tokens} tokens, R² and cosine "
                f"on {self.heldout_tokens} held-out tokens that neither fitted nor chose (documents {d.get('train')} / "
                f"{d.get('select')} / {d.get('report')}, none in two parts)")

    def table(self) -> str:
        head = f"{'layer':>5} {'src':>10} {'R2 K':>7} {'cos K':>7} {'R2 V':>7} {'cos V':>7} {'lam K':>7} {'lam V':>7}"
        rows = [head]
        for r in self.layers:
            src = ",".join(str(s) for s in r["source_layers"])
            rows.append(f"{r['layer']:>5} {src:>10} {r['r2_k']:7.3f} {r['cos_k']:7.3f} {r['r2_v']:7.3f} "
                        f"{r['cos_v']:7.3f} {r['lambda_k']:7.0e} {r['lambda_v']:7.0e}")
        mean = {key: sum(r[key] for r in self.layers) / len(self.layers) for key in ("r2_k", "cos_k", "r2_v", "cos_v")}
        rows.append(f"{'mean':>5} {'':>10} {mean['r2_k']:7.3f} {mean['cos_k']:7.3f} {mean['r2_v']:7.3f} "
                    f"{mean['cos_v']:7.3f}")
        return "\n".join(rows)


def _stats_key(config: TrainConfig, corpus_sha: str, source: LoadedModel, target: LoadedModel) -> str:
    data = {"config": asdict(config), "corpus": corpus_sha, "source": source.spec.identity.key,
            "target": target.spec.identity.key, "split": SPLIT}
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


STATS_EVERY_S = 600.0  # --stats: the statistics (~1.8 GB for the production pair) written at most this often


def train_adapter(source: LoadedModel, target: LoadedModel, corpus_files: list[str | Path], config: TrainConfig,
                  stats_path: str | Path | None = None, progress: bool = True, save_every_s: float = STATS_EVERY_S,
                  clock=time.monotonic) -> tuple[Adapter, TrainReport]:
    """Fit an adapter in closed form. With stats_path, the accumulated statistics are written (atomically) when every
    window is in, and before that at most every save_every_s seconds of `clock`; a rerun with the same models,
    corpus and config resumes from them."""
    docs, corpus_sha = read_documents(corpus_files, config.doc_chars)
    every = document_windows(docs, target.tokenizer, config.window_tokens)
    random.Random(config.seed).shuffle(every)
    budget = config.max_tokens // config.window_tokens
    train_windows, select_windows, report_windows = split_windows(every, budget, config.heldout_fraction)
    windows = [*train_windows, *select_windows, *report_windows]
    sspec, tspec = source.spec, target.spec
    groups = [tuple(g) for g in build_layer_map(config.layer_map, sspec.num_layers, tspec.num_layers, config.k)]
    d_s, d_t = sspec.num_kv_heads * sspec.head_dim, tspec.num_kv_heads * tspec.head_dim
    device = target.device
    train = RidgeStats(groups, d_s, d_t, device)
    select = RidgeStats(groups, d_s, d_t, device)  # what λ and α are chosen on
    key = _stats_key(config, corpus_sha, source, target)
    done = 0
    if stats_path is not None and Path(stats_path).exists():
        state = load_file(str(stats_path))
        saved_key = bytes(state.pop("key").tolist()).decode()
        if saved_key != key:
            raise ValueError(f"{stats_path} holds statistics of another run (models, corpus or config differ); "
                             "remove it or choose another --stats file")
        done = int(state.pop("windows_done"))
        train = RidgeStats.from_state_dict({k[6:]: v for k, v in state.items() if k.startswith("train.")}, device)
        select = RidgeStats.from_state_dict({k[7:]: v for k, v in state.items() if k.startswith("select.")}, device)
        log.info("resuming from %s: %d of %d windows already accumulated", stats_path, done, len(train_windows))

    def pairs(w: Window):
        return kv_pairs(source, target, pair_text(w.text, source.tokenizer, target.tokenizer))

    if done == 0:
        for w in tqdm(select_windows, desc="λ/α windows", disable=not progress):
            select.add(*pairs(w))

    def save(windows_done: int) -> None:
        state = {f"train.{k}": v for k, v in train.state_dict().items()}
        state |= {f"select.{k}": v for k, v in select.state_dict().items()}
        state["windows_done"] = torch.tensor(windows_done)
        state["key"] = torch.tensor(list(key.encode()), dtype=torch.uint8)
        write_tensors(Path(stats_path), state)

    saved_at = clock()
    for i, w in enumerate(tqdm(train_windows, desc="fitting windows", disable=not progress)):
        if i < done:
            continue
        train.add(*pairs(w))
        if stats_path is not None and i + 1 < len(train_windows) and clock() - saved_at >= save_every_s:
            save(i + 1)
            saved_at = clock()
    if stats_path is not None and done < len(train_windows):
        save(len(train_windows))

    fits = {m: [solve_layer(train, select, m, j, config.lambdas, config.mix_step) for j in range(len(groups))]
            for m in "kv"}
    held_pairs = [pairs(w) for w in tqdm(report_windows, desc="held-out windows", disable=not progress)]
    documents = {name: len({w.doc_id for w in part}) for name, part in
                 (("train", train_windows), ("select", select_windows), ("report", report_windows))}
    start = start_token_id(target.tokenizer)
    f32 = dict(dtype=torch.float32)
    adapter = Adapter(
        meta=AdapterMeta(source=model_record(sspec), target=model_record(tspec), layer_map=config.layer_map,
                         start_token=start,
                         lambdas={m: [f.lam for f in fits[m]] for m in "kv"},
                         corpus={"sha256": corpus_sha, "files": [str(f) for f in corpus_files],
                                 "windows": len(windows), "train_tokens": train.count,
                                 "select_tokens": select.count, "documents": documents,
                                 "split": f"{SPLIT}: train, select (λ and α), report (metrics.heldout_layers) share no "
                                          f"document (.jsonl records; .txt runs of ~{config.doc_chars} characters)"}),
        layer_map=torch.tensor(groups, dtype=torch.int64),
        mix_k=torch.tensor([f.alpha for f in fits["k"]], **f32),
        mix_v=torch.tensor([f.alpha for f in fits["v"]], **f32),
        wk=torch.stack([f.w for f in fits["k"]]).to(**f32), bk=torch.stack([f.b for f in fits["k"]]).to(**f32),
        wv=torch.stack([f.w for f in fits["v"]]).to(**f32), bv=torch.stack([f.b for f in fits["v"]]).to(**f32),
        start_kv=start_kv(target, start).cpu(),
    )
    report = _report(adapter, fits, held_pairs, train.count, len(windows), groups)
    report.select_tokens, report.documents = select.count, documents
    adapter.meta.corpus["heldout_tokens"] = report.heldout_tokens
    adapter.meta.metrics["heldout_layers"] = report.layers
    return adapter, report


def _report(adapter, fits, held_pairs, n_train, n_windows, groups) -> TrainReport:
    """R² and mean cosine per layer from the report windows' pairs themselves, with the adapter's own maps."""
    report = TrainReport(train_tokens=n_train, heldout_tokens=sum(p[0].shape[1] for p in held_pairs),
                         windows=n_windows)
    xk = torch.cat([p[0] for p in held_pairs], dim=1)
    xv = torch.cat([p[1] for p in held_pairs], dim=1)
    yk = torch.cat([p[2] for p in held_pairs], dim=1)
    yv = torch.cat([p[3] for p in held_pairs], dim=1)
    pk, pv = map_tokens(adapter.to(xk.device), xk, xv)
    for j in range(len(groups)):
        row = {"layer": j, "source_layers": list(groups[j]), "alpha_k": list(fits["k"][j].alpha),
               "alpha_v": list(fits["v"][j].alpha), "lambda_k": fits["k"][j].lam, "lambda_v": fits["v"][j].lam}
        for m, pred, true in (("k", pk[j], yk[j]), ("v", pv[j], yv[j])):
            sse = ((pred - true) ** 2).sum()
            sst = ((true - true.mean(0)) ** 2).sum()
            row[f"r2_{m}"] = float(1 - sse / sst)
            row[f"cos_{m}"] = float(torch.nn.functional.cosine_similarity(pred, true, dim=-1).mean())
        report.layers.append(row)
    return report
