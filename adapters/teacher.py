"""Training data for the adapter trainer: documents with ids, windows cut from them, a held-out split by a hash of
the document id, and the teacher data of every window computed once and cached on disk.

One window is `context_tokens + continuation_tokens` target text tokens behind the target's start token
(T = 1 + C + N target positions, as in `evaluate.prepare_documents`). Its cache file (safetensors) holds

  xk, xv      [L_s, T, d_s] bf16  source KV gathered to the target tokens (keys un-rotated; unmapped tokens zero),
                                  exactly the input `adapter.project` feeds to its maps
  k, v        [L_t, H_t, T, D_t] bf16  the target's own KV of the window (keys rotated, as cached)
  q           [L_t, H_q, T, D_t] bf16  the target's own queries (rotated) of every layer; only with
                                  `TeacherConfig.queries` (attention matching reads them, nothing else does:
                                  without them a window of the small pair takes 10.7 MB, not 19.6); with
                                  `query_positions` "scored" only the continuation's, [L_t, H_q, N, D_t] (the
                                  queries attention matching reads by default: 12.9 MB a window, not 19.6)
              (k, v and q are left out of a *lean* window, one that only objectives reading no target KV use:
              the `kl` and `ce` stages of a projection; its index entry says "kv": false. 4.8 MB a window of the
              small pair instead of 10.7; `TeacherCache.build(kv_ids=...)` decides which windows keep them)
  has_text    [T] bool            a source text token covers the target token (the tokens ridge fits on)
  start_mask  [T] bool            positions that take the adapter's exact start KV (the start token)
  ids         [T] int64           target ids: start, context, continuation
  top_logp, top_idx  [N - 1, topk]  the target's own-prefill log-probs of its top-k next tokens at the positions
                                  that predict continuation tokens 1..N-1 (the positions evaluate.py scores)

Queries, keys and values come from one target prefill through a registered attention function that records them
and then runs the model's own attention (`capture_attention`), so any transformers causal LM works.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from kvbridge.adapters.adapter import has_text_source, model_record
from kvbridge.adapters.pairs import flatten_heads, pair_text
from kvbridge.adapters.work_folder import differences, write_tensors
from kvbridge.transfer import kvcache
from kvbridge.transfer.attention import switched_attention
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.tensor_files import read_tensors, write_text
from tqdm import tqdm
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

log = logging.getLogger(__name__)

CAPTURE = "kvbridge_capture"
CACHE_VERSION = 1


# ---------------------------------------------------------------------------------------------- documents and windows

@dataclass(frozen=True, slots=True)
class Window:
    id: str  # "<doc id>/<index in the document>"
    doc_id: str  # "<corpus>:<document index>": the unit of the held-out split
    text: str  # about context + continuation target tokens, cut at token boundaries


def split_documents(path: str | Path, name: str, doc_chars: int = 8000) -> list[tuple[str, str]]:
    """The corpus file as documents of consecutive paragraphs (blank-line separated), each about doc_chars long.

    The files carry no document boundaries of their own; a run of paragraphs is the unit kept apart, so no held-out
    window shares a paragraph's neighbourhood with a training window. Returns [(doc_id, text)]."""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    docs, current, size = [], [], 0
    for p in paragraphs:
        current.append(p)
        size += len(p)
        if size >= doc_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    if current:
        docs.append("\n\n".join(current))
    return [(f"{name}:{i:05d}", d) for i, d in enumerate(docs)]


def is_heldout(doc_id: str, fraction: float, salt: str = "kvbridge-13") -> bool:
    """Deterministic split by a hash of the document id (independent of order and of the other documents)."""
    h = hashlib.blake2b(f"{salt}:{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64 < fraction


def document_windows(docs: list[tuple[str, str]], target_tokenizer, window_tokens: int) -> list[Window]:
    """Consecutive, non-overlapping chunks of window_tokens target tokens of every document, in order."""
    out = []
    for doc_id, text in docs:
        enc = target_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        for n, start in enumerate(range(0, len(offsets) - window_tokens + 1, window_tokens)):
            a, b = offsets[start][0], offsets[start + window_tokens - 1][1]
            if text[a:b].strip():
                out.append(Window(f"{doc_id}/{n}", doc_id, text[a:b]))
    return out


# ------------------------------------------------------------------------------------------------ attention capture

@contextlib.contextmanager
def capture_attention(model: torch.nn.Module):
    """Record every attention layer's (query, key, value) — rotated, after the cache update — and the attention
    module itself, while the model runs its own attention. Yields {layer_idx: (module, q, k, v)} with
    q [B, H_q, T, D], k, v [B, H_kv, T_k, D]."""
    records: dict[int, tuple] = {}
    original = model.config._attn_implementation
    inner = ALL_ATTENTION_FUNCTIONS[original] if original in ALL_ATTENTION_FUNCTIONS else None
    if inner is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as inner

    def attend(module, query, key, value, attention_mask, **kwargs):
        records[module.layer_idx] = (module, query, key, value)
        return inner(module, query, key, value, attention_mask, **kwargs)

    ALL_ATTENTION_FUNCTIONS.register(CAPTURE, attend)
    ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE, ALL_MASK_ATTENTION_FUNCTIONS[original])
    with switched_attention(model, CAPTURE):
        yield records


# ------------------------------------------------------------------------------------------------------ teacher data

@dataclass(frozen=True)
class TeacherConfig:
    context_tokens: int = 192  # projected in training, as in evaluate.prepare_documents
    continuation_tokens: int = 64  # prefilled by the target; KL is taken on their next-token distributions
    topk: int = 32  # teacher log-probs kept per position (the KL is renormalised over them)
    queries: bool = True  # keep the target's queries (attention matching needs them)
    query_positions: str = "scored"  # "scored": only the continuation's queries (what attention matching reads with
    #                                  its default `queries="continuation"`); "all": every position's

    def __post_init__(self):
        if self.query_positions not in ("scored", "all"):
            raise ValueError(f"query_positions must be 'scored' or 'all', got {self.query_positions!r}")
        if self.context_tokens < 2 or self.continuation_tokens < 2:
            raise ValueError(f"context_tokens and continuation_tokens must be >= 2, got {self.context_tokens}, "
                             f"{self.continuation_tokens}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")

    @property
    def window_tokens(self) -> int:
        return self.context_tokens + self.continuation_tokens


@torch.no_grad()
def source_features(source: LoadedModel, source_ids: torch.Tensor, source_index: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The maps' input, as `adapter.project` builds it: source_ids [T_s], source_index [T] (-1: unmapped)
    -> xk, xv [L_s, T, d_s] float32 (keys un-rotated at the source positions; unmapped tokens zero)."""
    seg = kvcache.extract(source.model, source.spec, source_ids)
    keys = source.rope.unrotate_all(seg.keys.float(), seg.positions)  # [L_s, H_s, T_s, D_s]
    mapped = (source_index >= 0)[None, :, None]
    gather = source_index.clamp(min=0).to(keys.device)
    xk = flatten_heads(keys)[:, gather] * mapped.to(keys.device)
    xv = flatten_heads(seg.values.float())[:, gather] * mapped.to(keys.device)
    return xk.cpu(), xv.cpu()


def makes_window(num_target_ids: int, config: TeacherConfig) -> bool:
    """A text whose target ids (the start token and its tokens) number this many makes a teacher window: it holds
    the start token and a whole window (teacher_window; chain.windows_read decides by it before computing any)."""
    return num_target_ids >= 1 + config.window_tokens


@torch.no_grad()
def teacher_window(source: LoadedModel, target: LoadedModel, text: str, config: TeacherConfig,
                   start_token: int, keep_kv: bool = True) -> dict[str, torch.Tensor] | None:
    """Every tensor of one window's cache file (see the module docstring); None when the text re-tokenises to
    fewer than context + continuation target tokens. keep_kv False: a lean window (no q, k, v)."""
    paired = pair_text(text, source.tokenizer, target.tokenizer)
    t = 1 + config.window_tokens
    if not makes_window(paired.target_ids.numel(), config):
        return None
    ids = paired.target_ids[:t]
    assert int(ids[0]) == start_token
    index = paired.alignment.source_index[:t]
    kind = paired.alignment.kind[:t]
    xk, xv = source_features(source, paired.source_ids, index)
    with capture_attention(target.model) as rec:
        logits = target.model(input_ids=ids[None].to(target.device)).logits[0].float()  # [T, V]
    c, n = config.context_tokens, config.continuation_tokens
    logp = logits[c + 1:c + n].log_softmax(-1)  # [N - 1, V]: predicts continuation tokens 1..N-1
    top = logp.topk(config.topk, dim=-1)
    layers = range(target.spec.num_layers)
    bf16 = torch.bfloat16
    first = 1 + c if config.query_positions == "scored" else 0
    own = {}
    if keep_kv:
        if config.queries:  # q: [L_t, H_q, T, D], or [L_t, H_q, N, D] (query_positions "scored")
            own["q"] = torch.stack([rec[j][1][0, :, first:] for j in layers]).to(bf16).cpu()
        own["k"] = torch.stack([rec[j][2][0] for j in layers]).to(bf16).cpu()  # [L_t, H_t, T, D]
        own["v"] = torch.stack([rec[j][3][0] for j in layers]).to(bf16).cpu()
    return own | {
        "xk": xk.to(bf16), "xv": xv.to(bf16),
        "has_text": has_text_source(kind), "start_mask": (~has_text_source(kind)) & (ids == start_token),
        "ids": ids.clone(), "top_logp": top.values.cpu(), "top_idx": top.indices.cpu(),
    }


def whole(entry: dict) -> bool:
    """An index entry of a window that keeps the target's own KV (not lean: no `"kv": false`)."""
    return entry.get("kv", True) is not False


class TeacherCache:
    """A folder of per-window safetensors files plus index.json ({config, models, windows: [{id, doc_id,
    file}]}). `build` computes what is missing (resumable: a rerun skips finished files). A subclass caches other
    windows by its own `config_class` and `window_tensors` (answer_windows.AnswerCache)."""

    config_class = TeacherConfig

    def window_tensors(self, source: LoadedModel, target: LoadedModel, window: Window, config, start_token: int,
                       keep_kv: bool = True) -> dict[str, torch.Tensor] | None:
        return teacher_window(source, target, window.text, config, start_token, keep_kv)

    batch_windows = 1  # windows `batch_tensors` computes at once

    def batch_tensors(self, source: LoadedModel, target: LoadedModel, windows: list[Window], config,
                      start_token: int, keep_kv: list[bool]) -> list[dict[str, torch.Tensor] | None]:
        """window_tensors of each window (keep_kv: each one's); a class may compute them together."""
        return [self.window_tensors(source, target, w, config, start_token, k) for w, k in zip(windows, keep_kv)]

    def batch_order(self, windows: list[Window], target: LoadedModel) -> list[Window]:
        """The order `build` computes the missing windows in (a batch of alike windows computes faster)."""
        return windows

    def wordings(self) -> dict:
        """What else a cache's windows depend on that its config does not hold (answer windows: their instructions);
        a folder built with other wordings is refused by name."""
        return {}

    def _header(self, index: dict) -> dict:
        """An index file's header: everything but its windows, the config with today's fields."""
        return ({k: v for k, v in index.items() if k not in ("windows", "empty")}
                | {"config": asdict(self.config_class(**index["config"]))})

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.index_path = self.root / "index.json"
        self.entries: list[dict] = []
        self.empty: list[str] = []  # ids of windows computed that made none (an answer window answered with nothing)
        if self.index_path.exists():
            saved = json.loads(self.index_path.read_text())
            self.entries, self.empty = saved["windows"], saved.get("empty", [])

    def __len__(self) -> int:
        return len(self.entries)

    def build(self, source: LoadedModel, target: LoadedModel, windows: list[Window], config,
              start_token: int, progress: bool = True, part: tuple[int, int] = (0, 1),
              kv_ids: set[str] | None = None, corpus: dict | None = None) -> dict:
        """Teacher data of every window; returns {windows: made, computed: tried, seconds, per_window_s}. A cache
        that keeps the queries serves a run that does not need them (its new windows keep them too). A window that
        makes none (too short; an answer window answered with nothing) is listed under "empty" and not tried again;
        the windows made are listed in the order of `windows` (a class may compute them in another: batch_order).

        kv_ids: the windows that keep the target's own q, k, v (None: every window); the others are made lean. A lean
        window already cached whose id is in kv_ids is computed again with them (its entry replaced).

        part (p, n): only the p-th of n strided shares of the windows not cached yet (one rank's under torchrun),
        listed in the index part `index.part-p.json` until `merge_parts` folds the parts into index.json; the n
        processes may build their parts of one folder at once, after leftover parts were merged. (0, 1): every
        missing window, listed in index.json (leftover parts merged first).

        corpus: what the windows' texts were cut from (chain.py: {"files": {file name: sha256}, "doc_chars": n}),
        recorded in the index: a folder of windows cut from other files, or from a file that has changed since, is
        refused by the file's name (an index of an older kvbridge records none: it is taken as it is, logged)."""
        p, n = part
        if not 0 <= p < n:
            raise ValueError(f"part must be (p, n) with 0 <= p < n, got {part}")
        if n == 1:
            self.merge_parts()
        self.root.mkdir(parents=True, exist_ok=True)
        saved = json.loads(self.index_path.read_text()) if self.index_path.exists() else None
        if saved is not None:
            saved["config"] = asdict(self.config_class(**saved["config"]))  # an older index: today's defaults
            if saved["config"].get("queries") and not config.queries:
                config = self.config_class(**saved["config"])
        header = {"version": CACHE_VERSION, "config": asdict(config), "source": source.spec.identity.key,
                  "target": target.spec.identity.key, "start_token": start_token,
                  "source_record": model_record(source.spec)} | self.wordings()
        if saved is not None and corpus is not None and "corpus" not in saved:
            log.warning("%s records no corpus (an older kvbridge made it): its windows are taken as cut from %s",
                        self.root, ", ".join(corpus.get("files", {})))
        elif saved is not None and corpus is None:  # a caller that names no corpus keeps the folder's record
            corpus = saved.get("corpus")
        if corpus is not None:
            header["corpus"] = corpus
        if saved is not None:
            if {k: saved.get(k, corpus if k == "corpus" else None) for k in header} != header:
                differ = [f"{k}: {saved['config'].get(k)!r} there, {v!r} here" for k, v in header["config"].items()
                          if saved["config"].get(k) != v]
                differ += [k for k in header if k not in ("config", "corpus") and saved.get(k) != header[k]]
                old = saved.get("corpus", corpus)
                if old != corpus:  # (both records: a folder without one took this run's)
                    differ += differences({"corpus": old["files"]}, {"corpus": corpus["files"]})
                    differ += ["doc_chars"] if old.get("doc_chars") != corpus.get("doc_chars") else []
                raise ValueError(f"{self.root} holds teacher data of another configuration or model pair, or another "
                                 f"corpus ({'; '.join(differ)}); use another --work or remove {self.root}")
        position = {e["id"]: i for i, e in enumerate(self.entries)}

        empty = set(self.empty)

        def wanted(w: Window) -> bool:
            if w.id in empty:  # computed before: it makes no window
                return False
            if w.id not in position:
                return True
            return not self.has_kv(position[w.id]) and (kv_ids is None or w.id in kv_ids)

        index, listed, none = (self.index_path, self.entries, self.empty) if n == 1 else (self._part_path(p), [], [])
        todo = self.batch_order([w for w in windows if wanted(w)], target)[p::n]
        first_new = len(listed)
        began, made = time.perf_counter(), 0
        with tqdm(total=len(todo), desc="teacher windows", disable=not progress) as bar:
            for at in range(0, len(todo), self.batch_windows):
                batch = todo[at:at + self.batch_windows]
                keep = [kv_ids is None or w.id in kv_ids for w in batch]
                computed = self.batch_tensors(source, target, batch, config, start_token, keep)
                for w, keep_kv, tensors in zip(batch, keep, computed):
                    if tensors is None:
                        none.append(w.id)
                        continue
                    name = hashlib.blake2b(w.id.encode(), digest_size=10).hexdigest() + ".safetensors"
                    write_tensors(self.root / name, tensors)
                    entry = {"id": w.id, "doc_id": w.doc_id, "file": name} | ({} if keep_kv else {"kv": False})
                    if n > 1:
                        listed.append(entry)
                    elif w.id in position:  # a lean window made whole
                        self.entries[position[w.id]] = entry
                    else:
                        position[w.id] = len(self.entries)
                        self.entries.append(entry)
                    made += 1
                bar.update(len(batch))
                if (at + len(batch)) % 4 == 0 or self.batch_windows >= 4:
                    self._write_index(index, header, listed, none)
        order = {w.id: i for i, w in enumerate(windows)}  # the new windows listed in `windows` order, as computed
        listed[first_new:] = sorted(listed[first_new:], key=lambda e: order.get(e["id"], len(order)))
        if n == 1 or listed or none:  # (a part with nothing new leaves index.json as it is)
            self._write_index(index, header, listed, none)
        seconds = time.perf_counter() - began
        return {"windows": made, "computed": len(todo), "seconds": seconds, "per_window_s": seconds / max(made, 1)}

    def _part_path(self, p: int) -> Path:
        return self.root / f"index.part-{p}.json"

    def merge_parts(self, order: list[str] | None = None) -> None:
        """Fold the index parts of a sharded build into index.json, every window listed once (the new ones in the
        `order` of window ids when given), then remove the parts. One process, while no build runs."""
        parts = sorted(self.root.glob("index.part-*.json"))
        if not parts:
            return
        saved = json.loads(self.index_path.read_text()) if self.index_path.exists() else None
        header = None if saved is None else self._header(saved)
        have, new = {e["id"]: i for i, e in enumerate(self.entries)}, []
        for path in parts:
            data = json.loads(path.read_text())
            header = header or self._header(data)
            if "corpus" not in header and "corpus" in data:  # an index of an older kvbridge (build: logged)
                header = header | {"corpus": data["corpus"]}
            if self._header(data) != header:
                raise ValueError(f"{path} lists teacher windows of another configuration or model pair than "
                                 f"{self.index_path}; remove it and the folder's unlisted files")
            for e in data["windows"]:
                if e["id"] not in have:
                    have[e["id"]] = -1
                    new.append(e)
                elif have[e["id"]] >= 0 and whole(e) and not self.has_kv(have[e["id"]]):
                    self.entries[have[e["id"]]] = e  # a lean window made whole by this build
            self.empty += [wid for wid in data.get("empty", []) if wid not in self.empty]
        if order is not None:
            position = {wid: i for i, wid in enumerate(order)}
            new.sort(key=lambda e: position.get(e["id"], len(position)))
        self.entries += new
        self._write_index(self.index_path, header, self.entries, self.empty)
        for path in parts:
            path.unlink()

    def _write_index(self, path: Path, header: dict, entries: list[dict], empty: list[str]) -> None:
        write_text(path, json.dumps(header | {"windows": entries} | ({"empty": empty} if empty else {})))

    def load(self, i: int) -> dict[str, torch.Tensor]:
        return read_tensors(self.root / self.entries[i]["file"])[0]

    def has_kv(self, i: int) -> bool:
        """Window i keeps the target's own q (when the cache keeps queries), k and v: it is not lean."""
        return whole(self.entries[i])

    def require_kv(self, indices, what: str) -> None:
        """Raise, naming `what` reads them, when any of the windows is lean."""
        lean = [self.entries[i]["id"] for i in indices if not self.has_kv(i)]
        if lean:
            raise ValueError(f"{what} reads the target's own KV, but {len(lean)} of its {len(indices)} teacher "
                             f"windows in {self.root} are lean (e.g. {lean[0]}): build them with kv_ids that "
                             "include them")

    def load_tensor(self, i: int, name: str) -> torch.Tensor:
        """One tensor of window i, read without the rest of its file."""
        return read_tensors(self.root / self.entries[i]["file"], names=(name,))[0][name]
