"""`kvbridge eval rouge --engine vllm`: every mode as a vLLM engine serves it, through the kvbridge connector.

Same documents, layout, table and intervals as the in-process harness (eval.summaries), but the target is vLLM
(a child process in the vLLM venv: kvbridge.vllm.engine) and a projected context reaches it the way users get it:
the connector fetches the server's cache for the request (`kv_transfer_params`) and loads it into vLLM's paged KV
(whole vLLM blocks; vLLM prefills the rest of the prompt itself). Per document and mode:
  a one-token request       TTFT, cold: the first time this mode's cache is fetched (the server projects, or
                            computes its served correction from it); for modes without a cache, vLLM's own
                            prefill. The plain projection is fetched first, whatever the modes' order: where a
                            served mode comes before replace and recompute:r, the harness makes the projection's
                            cold and warm requests itself before it. A mode whose cache an earlier request fetched
                            (recompute:r reads replace's projection) finds it in the store: its fetch seconds are
                            replaced by that first fetch's, as the in-process harness counts every projected mode's
                            cold TTFT with the one cold fetch; a served mode, its correction computed over the stored
                            projection, adds the projection's first fetch's seconds over its warm fetch's
                            (FirstFetches). So no mode's cold TTFT depends on the modes' order.
  the summary               [start] + document + instruction, vLLM's greedy decoding, cut at the first line break
  the continuation's NLL    [start] + document + continuation, one request with vLLM's prompt log-probs: the
                            continuation's first token is input, the others are scored (summed NLL, top-1 at each)
  a one-token request       TTFT, warm: the cache is in the server's store
Modes:
  full, none, tail:r        vLLM prefills [start] + the document (or nothing of it, or its last r)
  replace                   the server's plain projection
  served:C                  the server's stored correction C (blend:0.1, recompute:0.1): no target pass at request time
  recompute:r               replace, leaving the document's last r (rounded to whole blocks) to vLLM's own prefill
vLLM reads loaded KV as it is: it has no induction prior at decode time (the in-process modes read projected KV with
it), so every mode here is what the in-process harness calls `/noprior`; a `/noprior` suffix is taken and changes
nothing, `/probe` and the modes that need a target pass in this process (blend:r, fuse, fuser) are refused.
"""

from __future__ import annotations

import time
from pathlib import Path

from kvbridge.eval.flops import FlopModel
from kvbridge.eval.modes import NO_PRIOR, Mode
from kvbridge.eval.summaries import (
    DocumentResult,
    EvalConfig,
    ModeResult,
    PreparedDoc,
    instruction_ids,
    served_forwards,
    stop_ids,
)
from kvbridge.transfer.models import LoadedModel

VLLM_KINDS = ("full", "none", "tail", "replace", "served", "recompute")
BLOCK_SIZE = 32  # vLLM's block size here (CPU: multiples of 32): small, so little of a document is left over


def check_vllm_modes(modes: list[Mode]) -> None:
    """ValueError naming the first mode vLLM cannot run (before any engine starts)."""
    for mode in modes:
        if mode.kind not in VLLM_KINDS:
            raise ValueError(f"mode {mode.name!r} does not run with --engine vllm (it needs a target pass in this "
                             f"process); there: {', '.join(VLLM_KINDS)} (served:blend:R is blend, corrected once "
                             "by the server)")
        if mode.name.count("/") and not mode.name.endswith(NO_PRIOR):
            raise ValueError(f"mode {mode.name!r}: vLLM reads loaded KV without an induction prior; only "
                             f"{NO_PRIOR} (which changes nothing there) is taken")


def one_line(tokenizer, ids: list[int], stop: set[int]) -> list[int]:
    """The answer as eval.summaries.greedy(one_line=True) cuts it: up to a stop token, or a line break once some
    text came."""
    out: list[int] = []
    for token in ids:
        if token in stop or ("\n" in tokenizer.decode([token]) and tokenizer.decode(out).strip()):
            break
        out.append(token)
    return out


def engine_options(target: LoadedModel, address: str, config: EvalConfig, dtype: str = "", token: str = ""):
    """EngineOptions of an engine that serves `target` (a packaged checkpoint) for the evaluation, with the
    connector pointed at the server at `address`; dtype "": vLLM's fastest here (`engine_dtype`)."""
    from kvbridge.transfer.models import prepare_gguf
    from kvbridge.vllm.engine import EngineOptions, engine_dtype, kv_transfer_config

    prompt = instruction_ids(target, config.instruction).numel() + config.max_new_tokens
    longest = 1 + config.max_doc_tokens + max(prompt, config.continuation_tokens)
    return EngineOptions(model=str(prepare_gguf(target.name)), dtype=dtype or engine_dtype(),
                         max_model_len=(longest + BLOCK_SIZE) // BLOCK_SIZE * BLOCK_SIZE + BLOCK_SIZE,
                         block_size=BLOCK_SIZE,
                         kv_transfer_config=kv_transfer_config(address=address, token=token, timeout_s=600))


class FirstFetches:
    """The cold TTFT a new user's first request would see, over the modes of one document run in order. The plain
    projection's first fetch comes before any served correction's (`needs_projection` says where a caller must make
    it first): a served correction's first request, computed over that stored projection, adds the projection's first
    fetch's seconds over its warm fetch's, and a request that found its cache stored by an earlier request (replace or
    recompute:r after the projection's; served:C/noprior after served:C) counts that first fetch's seconds."""

    def __init__(self):
        self.first: dict[tuple, float] = {}  # a server cache of this document -> its first (cold) fetch's seconds
        self.projection: tuple[float, float] | None = None  # the plain projection's first and warm fetch, seconds

    @staticmethod
    def plain(kvbridge: dict) -> dict:
        """The request's kvbridge parameters for the plain projection its cache is computed over."""
        return {k: v for k, v in kvbridge.items() if k != "recompute_tokens"} | {"mode": "replace"}

    def needs_projection(self, kvbridge: dict | None) -> bool:
        """Whether a request with `kvbridge` reads a served correction before the plain projection was fetched."""
        return bool(kvbridge) and kvbridge.get("mode", "replace") != "replace" and self.projection is None

    def cold_seconds(self, kvbridge: dict | None, cold: dict, warm: dict) -> float:
        """The cold request's seconds as a new user's (`cold`, `warm`: the engine's replies to the mode's cold and warm
        one-token requests with kv_transfer_params["kvbridge"] = `kvbridge`)."""
        if not kvbridge:
            return cold["seconds"]
        if self.needs_projection(kvbridge):
            raise ValueError(f"served correction {kvbridge['mode']!r} before the plain projection's first fetch: its "
                             "cold TTFT adds projecting; pass the projection's requests first (needs_projection)")
        # the server's cache the request read: the same for replace and recompute:r
        cache = tuple(sorted((k, v) for k, v in kvbridge.items() if k != "recompute_tokens"))
        fetch_s = cold["kvbridge_fetch_s"]
        if cache in self.first:  # a store hit, not the cold fetch its column names
            return cold["seconds"] + self.first[cache] - fetch_s
        extra = 0.0
        if kvbridge.get("mode", "replace") == "replace":  # the connector's default mode
            self.projection = (fetch_s, warm["kvbridge_fetch_s"])
        else:  # the server corrected the projection it had stored
            extra = self.projection[0] - self.projection[1]
        self.first[cache] = fetch_s + extra
        return cold["seconds"] + extra


class VLLMEvaluator:
    """Runs every mode on prepared documents through `engine` (kvbridge.vllm.engine.EngineProcess) whose connector
    reaches the server named `server` in its configuration; `client` (a KVBridgeClient to that server) ingests each
    document once, so the source's read is in no TTFT (as in the in-process harness)."""

    def __init__(self, engine, client, target: LoadedModel, modes: list[Mode], config: EvalConfig | None = None,
                 server: str = "default", adapter: str = ""):
        check_vllm_modes(modes)
        self.engine, self.client, self.target, self.modes = engine, client, target, modes
        self.config = config or EvalConfig()
        self.server, self.adapter = server, adapter
        self.prompt = instruction_ids(target, self.config.instruction).tolist()
        self.stop = stop_ids(target)
        self.flops = FlopModel.from_config(target.model.config)
        self.prior = None  # vLLM has none at decode time (report meta)
        self.priors: dict = {}

    def _kvbridge(self, mode: Mode, key: str, doc_tokens: int) -> dict | None:
        """The request's kv_transfer_params["kvbridge"] in `mode` (None: vLLM prefills the context itself)."""
        if mode.kind not in ("replace", "served", "recompute"):
            return None
        p = {"key": key, "mode": mode.correction or "replace"}
        if mode.kind == "recompute":
            p["recompute_tokens"] = max(1, round(mode.fraction * doc_tokens))
        if self.server != "default":
            p["server"] = self.server
        if self.adapter:
            p["adapter"] = self.adapter
        return p

    def _context_ids(self, mode: Mode, doc: PreparedDoc) -> list[int]:
        ids = doc.target_ids.tolist()
        if mode.kind == "none":
            return ids[:1]
        if mode.kind == "tail":
            k = max(1, round(mode.fraction * doc.doc_tokens))
            return ids[:1] + ids[len(ids) - k:]
        return ids

    def _generate(self, doc: PreparedDoc, what: str, prompt: list[int], kvbridge: dict | None, max_tokens: int
                  ) -> dict:
        """The engine's reply to one request (`what`: the mode it is for, named in the error where the connector
        loaded nothing)."""
        reply = self.engine.generate(prompt, max_tokens=max_tokens, kvbridge=kvbridge)
        if reply["kvbridge_error"]:
            raise RuntimeError(f"{doc.record.id}, mode {what}: the connector loaded nothing: {reply['kvbridge_error']}")
        return reply

    def run(self, doc: PreparedDoc) -> DocumentResult:
        result = DocumentResult(doc.record.id, doc.record.summary, doc.doc_tokens)
        key = None
        if any(self._kvbridge(m, "", 1) is not None for m in self.modes):
            entry = self.client.ingest(text=doc.text).entries[0]
            key, result.source_tokens = entry.key, entry.num_tokens
        continuation = doc.continuation.tolist()
        first = FirstFetches()
        for mode in self.modes:
            kvbridge = self._kvbridge(mode, key, doc.doc_tokens)
            context = self._context_ids(mode, doc)
            prompt = context + self.prompt
            if first.needs_projection(kvbridge):  # a served mode before replace: the projection's requests first
                plain, what = first.plain(kvbridge), f"{mode.name}'s projection"
                projected = self._generate(doc, what, prompt, plain, 1)
                first.cold_seconds(plain, projected, self._generate(doc, what, prompt, plain, 1))
            cold = self._generate(doc, mode.name, prompt, kvbridge, 1)
            out = self._generate(doc, mode.name, prompt, kvbridge, self.config.max_new_tokens)
            warm = self._generate(doc, mode.name, prompt, kvbridge, 1) if kvbridge else cold
            nll, top1 = None, None
            if len(continuation) >= 2:
                scored = self.engine.score(context + continuation, len(context) + 1, kvbridge=kvbridge)
                if scored["kvbridge_error"]:
                    raise RuntimeError(f"{doc.record.id}, mode {mode.name}: the connector loaded nothing for the "
                                       f"continuation: {scored['kvbridge_error']}")
                nll = -sum(s[0] for s in scored["prompt_scores"])
                top1 = [s[1] for s in scored["prompt_scores"]]
            ids = one_line(self.target.tokenizer, out["token_ids"], self.stop)
            loaded = out["loaded_tokens"]
            # the server's correction, computed once: as many tokens as the correction takes of the document (what the
            # server's `correct` recomputes), refused where the server says it recomputed another number of document
            # tokens (the connector's count, the start token left out); not checked where nothing was loaded
            recomputed = out["kvbridge_recomputed_tokens"] if loaded else None
            shared = (sum(self.flops.prefill(*f) for f in served_forwards(mode.correction, doc.doc_tokens,
                                                                             self.flops.layers, recomputed))
                      if mode.kind == "served" else 0)
            result.modes[mode.name] = ModeResult(
                summary=self.target.tokenizer.decode(ids, skip_special_tokens=True).strip(), summary_ids=ids,
                ttft_s=first.cold_seconds(kvbridge, cold, warm), prefill_tokens=len(prompt) - loaded,
                prefill_flops=self.flops.prefill(len(prompt) - loaded, loaded), kv_bytes=out["kvbridge_wire_bytes"],
                nll=nll, nll_tokens=max(len(continuation) - 1, 0), continuation_top1=top1,
                ttft_warm_s=warm["seconds"], loaded_tokens=loaded, shared_flops=shared)
        if first.projection is not None:
            result.fetch_s, result.warm_fetch_s = first.projection
        return result


def run_vllm(target: LoadedModel, address: str, modes: list[Mode], config: EvalConfig, docs: list[PreparedDoc],
             client, log_path: Path, dtype: str = "", token: str = "", progress: bool = True, engine=None
             ) -> tuple[list[DocumentResult], dict, tuple[str, BaseException] | None]:
    """Evaluate `docs` through a vLLM engine for `target` whose connector reaches the server at `address`: `engine`
    (a running EngineProcess whose "default" server is that one), else one started here and stopped after;
    (results, engine meta, the document that stopped the run and why, or None: summaries.run_documents)."""
    from contextlib import nullcontext

    from kvbridge.eval.summaries import run_documents
    from kvbridge.vllm.engine import EngineProcess

    t0 = time.perf_counter()
    if engine is None:
        options = engine_options(target, address, config, dtype, token)
        running = EngineProcess(options, log_path)
    else:
        options, running = engine.options, nullcontext(engine)
    started = time.perf_counter() - t0
    with running as engine:
        evaluator = VLLMEvaluator(engine, client, target, modes, config)
        results, failure = run_documents(evaluator.run, docs, f"{len(modes)} modes per document (vLLM)", progress)
    meta = {"engine": "vllm", "dtype": options.dtype, "block_size": options.block_size,
            "engine_start_s": round(started, 1), "engine_log": str(engine.log_path)}
    return results, meta, failure
