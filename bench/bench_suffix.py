"""Multi-turn suffix reuse on the target, with the kvbridge pipeline vs the target's own full prefill, measured in
one run on the machine named in the header (STYLE rule 9).

A 20-turn conversation about one packaged document (pydoc:fnmatch, ~500 SmolLM2 tokens): turn i's request is the
document, a system prompt, every earlier question with the answer the model gave to it, then question i. Two
conversations run side by side, turn by turn (the order alternates), each with its own answers, greedy:

- with the pipeline: a real kvbridge server in this process (loopback port 0) has ingested the document once; each
  turn the document's KV is projected from the source (Gemma-3-270M) by the server and fetched over gRPC
  (ProjectedContext), the system prompt and the earlier turns come from the session's own cached segments
  (SuffixCacheManager with its default OnlineValueScorer), and only what is new is prefilled;
- without: SuffixReuseGenerator with no manager and the document as a plain part: the target (SmolLM2-135M-Instruct)
  prefills every token of the request, every turn.

    .venv/bin/python bench/bench_suffix.py [--quick] [--verbose] [--adapter FILE] [--turns 20] [--max-new-tokens 16]
                                           [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from kvbridge.adapters.io import load_adapter
from kvbridge.adapters.train import TrainConfig, train_adapter
from kvbridge.server.app import build_service, start_server
from kvbridge.server.client import KVBridgeClient
from kvbridge.server.config import ServeConfig
from kvbridge.server.projected_context import ProjectedContext
from kvbridge.transfer import kvcache
from kvbridge.transfer.data import data_path
from kvbridge.transfer.models import LoadedModel
from kvbridge.transfer.presets import load_pair
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.suffix.cache_manager import SuffixCacheManager
from kvbridge.transfer.suffix.generator import Part, RequestMetrics, SuffixReuseGenerator
from machine import device_label
from machine import machine_line as _machine_line

DOCUMENT_ID = "pydoc:fnmatch"  # 507 SmolLM2 tokens; the questions below are about it
QUICK_DOCUMENT_TOKENS = 64  # --quick: the document cut to this many target tokens
ADAPTER_NAME = "bench-adapter"
SESSION = "bench"
SYSTEM = ("\n\nYou are a concise assistant for Python programmers. Answer each question about the fnmatch module in "
          "one short sentence, using only the documentation above; if it does not say, answer that it does not say.")
# Every question names the module: the manager's TF-IDF cosine between a new turn and the earlier ones stays above
# its drift threshold (0.3; >= 0.41 for these in this format), so the session's segments are never flushed.
QUESTIONS = (
    "What does the fnmatch module provide?",
    "Are the patterns of the fnmatch module the same as regular expressions?",
    "What does the * wildcard match in a pattern of the fnmatch module?",
    "What does the ? wildcard match in a pattern of the fnmatch module?",
    "What does [seq] match in a pattern of the fnmatch module?",
    "What does [!seq] match in a pattern of the fnmatch module?",
    "How do I match a literal ? character with the fnmatch module?",
    "Is the / separator special to the fnmatch module?",
    "Does the fnmatch module treat filenames that start with a period specially?",
    "Which module does the fnmatch module point to for pathname expansion?",
    "How does the fnmatch module cache the compiled patterns?",
    "What does the fnmatch function of the fnmatch module return?",
    "Does the fnmatch function of the fnmatch module normalize the case?",
    "How does fnmatchcase differ from the fnmatch function of the fnmatch module?",
    "What does the filter function of the fnmatch module return?",
    "Is the filter function of the fnmatch module faster than a list comprehension?",
    "What does the translate function of the fnmatch module return?",
    "How can I use the fnmatch module to list the .txt files in a directory?",
    "What regular expression does the fnmatch module make for the pattern '*.txt'?",
    "What maxsize does the fnmatch module give its lru_cache?",
)


def question_text(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


# ---------------------------------------------------------------------------------------------------- helpers


def machine_line(device: torch.device, mode: str) -> str:
    return _machine_line(mode, f"models on {device_label(device)}")


def load_document(tokenizer, max_tokens: int | None) -> str:
    """The packaged held-out page DOCUMENT_ID, cut to at most max_tokens target tokens (None: whole)."""
    with open(data_path("pydoc_heldout.jsonl"), encoding="utf-8") as f:
        pages = {page["id"]: page["document"] for page in map(json.loads, f)}
    if DOCUMENT_ID not in pages:
        raise ValueError(f"pydoc_heldout.jsonl has no page {DOCUMENT_ID!r}")
    text = pages[DOCUMENT_ID]
    if max_tokens is None:
        return text
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return text[: offsets[min(max_tokens, len(offsets)) - 1][1]]


def get_adapter(path: str | None, source: LoadedModel, target: LoadedModel):
    """(adapter, note): loaded from `path`, else the pair's shipped adapter (what users get), else a ridge fit on
    2048 tokens of the packaged corpus."""
    from kvbridge.adapters.shipped import find_shipped

    t0 = time.perf_counter()
    shipped = None if path else find_shipped(source.spec, target.spec)
    if path or shipped:
        adapter, how = load_adapter(path or shipped), f"loaded from {path}" if path else f"shipped ({shipped.name})"
    else:
        corpus = str(data_path("pydoc_corpus_sample.txt"))
        adapter, _ = train_adapter(source, target, [corpus], TrainConfig(max_tokens=2048), progress=False)
        how = "ridge, fitted on 2048 corpus tokens"
    return adapter, f"adapter {how} in {time.perf_counter() - t0:.1f} s"


# ---------------------------------------------------------------------------------------------------- conversations


@dataclass
class Conversation:
    """One conversation: its generator, the document as a part, and what each turn gave (its own answers)."""

    name: str
    generator: SuffixReuseGenerator
    document: Part
    max_new_tokens: int
    answers: list[str] = field(default_factory=list)  # decoded
    answer_ids: list[list[int]] = field(default_factory=list)  # as generated
    metrics: list[RequestMetrics] = field(default_factory=list)

    def request(self, turn: int) -> list[Part]:
        parts = [self.document, Part(SYSTEM, "system")]
        for question, answer in zip(QUESTIONS[:turn], self.answers):
            parts.append(Part(question_text(question), "turn"))
            if self.generator.tokens(answer).numel():  # an empty answer (EOS first) has no part
                parts.append(Part(answer, "turn"))
        parts.append(Part(question_text(QUESTIONS[turn]), "turn"))
        return parts

    def step(self, turn: int) -> None:
        assert len(self.answers) == turn, "turns run in order"
        new, metrics = self.generator.generate(SESSION, self.request(turn), max_new_tokens=self.max_new_tokens)
        self.answer_ids.append(new.tolist())
        self.answers.append(self.generator.lm.tokenizer.decode(new, skip_special_tokens=True))
        self.metrics.append(metrics)


def total(metrics: list[RequestMetrics], name: str) -> int:
    return sum(getattr(m, name) for m in metrics)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f} ms"


# ---------------------------------------------------------------------------------------------------- main


def run(argv: list[str] | None = None) -> dict:
    """Both conversations, as on the command line; returns the printed lines' figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny random models, 4 turns, a short document: a smoke run in seconds")
    parser.add_argument("--verbose", action="store_true", help="also print one `turns` line per turn")
    parser.add_argument("--adapter", help="a trained adapter file (default: the pair's shipped adapter, else a ridge "
                                          "fit on 2048 corpus tokens)")
    parser.add_argument("--turns", type=int, help=f"turns (default {len(QUESTIONS)}; 4 with --quick)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens generated per answer (greedy)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: other processes share the cores; see bench/store.md)")
    args = parser.parse_args(argv)
    turns = args.turns if args.turns is not None else 4 if args.quick else len(QUESTIONS)  # 0 refused below
    if not 1 <= turns <= len(QUESTIONS):
        parser.error(f"--turns must be in 1..{len(QUESTIONS)}, got {turns}")
    for name, value in (("--max-new-tokens", args.max_new_tokens), ("--threads", args.threads)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    torch.set_num_threads(args.threads)
    # The server logs an open (token-less) server at WARNING; it is expected here.
    logging.getLogger("kvbridge.server").setLevel(logging.ERROR)

    started = time.perf_counter()
    preset = "tiny" if args.quick else "small"
    source, target = load_pair(preset, device="cpu")
    machine = machine_line(target.device, "quick" if args.quick else "full")
    print(machine, flush=True)
    adapter, adapter_note = get_adapter(args.adapter, source, target)
    document = load_document(target.tokenizer, QUICK_DOCUMENT_TOKENS if args.quick else None)

    with tempfile.TemporaryDirectory(prefix="kvbridge-bench-suffix-") as folder:
        config = ServeConfig(preset=preset, listen="127.0.0.1:0", selfcheck=False, adapters=folder,
                             store_capacity_mb=512, store_device="cpu", correction="replace")
        service = build_service(config, source=source, targets=[target])
        service.adapters.add(ADAPTER_NAME, adapter, make_default=True)
        running = start_server(service, config)
        client = KVBridgeClient(running.address, timeout_s=600)
        try:
            t0 = time.perf_counter()
            client.ingest(document)  # the source's prefill of the document, once, before the conversation
            ingest_s = time.perf_counter() - t0
            manager = SuffixCacheManager(PagedStore(StoreConfig(capacity_bytes=512 << 20, device="cpu")))
            context = ProjectedContext(client, target)
            with_pipeline = Conversation(
                "with", SuffixReuseGenerator(target, manager, context_source=context),
                Part(document, "document", projected=True), args.max_new_tokens)
            without = Conversation("without", SuffixReuseGenerator(target), Part(document, "document"),
                                   args.max_new_tokens)
            doc_tokens = with_pipeline.generator.tokens(document).numel()
            # warm the target up (first-call costs of torch and generate) on neither conversation's session
            kvcache.generate_plain(target.model, target.spec, with_pipeline.generator.tokens(SYSTEM)[:8],
                                   max_new_tokens=2)
            print(f"setup   {source.name} -> {target.name}, {turns} turns, greedy, {args.max_new_tokens} new tokens "
                  f"per answer; document {DOCUMENT_ID} {doc_tokens} target tokens, system prompt "
                  f"{with_pipeline.generator.tokens(SYSTEM).numel()}; Ingest (source prefill of the document, "
                  f"before the turns) {ms(ingest_s)}; {adapter_note}", flush=True)
            for turn in range(turns):
                order = (with_pipeline, without) if turn % 2 == 0 else (without, with_pipeline)
                for conversation in order:
                    conversation.step(turn)
                if turn == 0:
                    projected_ids = context.first.token_ids[1:]
                    if not torch.equal(projected_ids, with_pipeline.generator.tokens(document)):
                        raise AssertionError("the server projected other target tokens than the document's")
                if args.verbose:
                    w, o = with_pipeline.metrics[turn], without.metrics[turn]
                    same = with_pipeline.answer_ids[turn] == without.answer_ids[turn]
                    print(f"turns   {turn + 1:2d}: with {w.tokens_total} tokens, prefilled {w.tokens_prefilled}, "
                          f"projected {w.tokens_projected}, reused exact {w.tokens_reused_exact} shifted "
                          f"{w.tokens_reused_local - w.tokens_reused_exact}, TTFT {ms(w.ttft_s)} "
                          f"[{' '.join(w.parts)}] | without {o.tokens_total} tokens, prefilled {o.tokens_prefilled}, "
                          f"TTFT {ms(o.ttft_s)} | same answer {'yes' if same else 'no'}: "
                          f"{with_pipeline.answers[turn]!r}", flush=True)
            manager_stats = manager.stats()
            observations = manager.scorer.observations
            manager.close()  # its segments and its store listener
        finally:
            client.close()
            running.stop(grace_s=1)

    w, o = with_pipeline.metrics, without.metrics
    prefill_w, prefill_o = total(w, "tokens_prefilled"), total(o, "tokens_prefilled")
    print(f"prefill target tokens prefilled over {turns} turns: with pipeline {prefill_w:,} of "
          f"{total(w, 'tokens_total'):,} in the requests, without {prefill_o:,} of {total(o, 'tokens_total'):,} "
          f"-> ratio without/with {prefill_o / prefill_w:.1f}x", flush=True)
    ttft_w, ttft_o = [m.ttft_s for m in w], [m.ttft_s for m in o]
    med_w, med_o = statistics.median(ttft_w), statistics.median(ttft_o)
    print(f"ttft    time to first token, median over {turns} turns: with pipeline {ms(med_w)}, without {ms(med_o)} "
          f"-> ratio without/with {med_o / med_w:.2f}x; sum: with {ms(sum(ttft_w))}, without {ms(sum(ttft_o))} "
          f"-> ratio {sum(ttft_o) / sum(ttft_w):.2f}x (turns interleaved, order alternating)", flush=True)
    exact, local = total(w, "tokens_reused_exact"), total(w, "tokens_reused_local")
    print(f"reuse   with pipeline over {turns} turns: {total(w, 'tokens_projected'):,} tokens projected (fetched over "
          f"gRPC), {local:,} reused from the session's segments ({exact:,} exact, {local - exact:,} shifted); manager: "
          f"{manager_stats['segments']} segments cached, {manager_stats['hits']} hits; value scorer "
          f"{type(manager.scorer).__name__}, {observations} outcomes observed", flush=True)
    same = sum(a == b for a, b in zip(with_pipeline.answer_ids, without.answer_ids))
    print(f"answers same answer in both conversations at {same} of {turns} turns (information: the projected "
          f"document is an approximation of the target's own KV, and each conversation continues from its own "
          f"answers)", flush=True)
    wall_s = time.perf_counter() - started
    print(f"done in {wall_s:.0f} s", flush=True)
    return {"machine": machine, "preset": preset, "pair": f"{source.name} -> {target.name}", "turns": turns,
            "document_tokens": doc_tokens, "ingest_s": ingest_s, "prefilled_with": prefill_w,
            "prefilled_without": prefill_o, "ratio_prefill_without_over_with": prefill_o / prefill_w,
            "ttft_median_with_s": med_w, "ttft_median_without_s": med_o,
            "ratio_ttft_median_without_over_with": med_o / med_w, "ttft_sum_with_s": sum(ttft_w),
            "ttft_sum_without_s": sum(ttft_o), "ratio_ttft_sum_without_over_with": sum(ttft_o) / sum(ttft_w),
            "same_answers": same, "wall_s": wall_s}


def main(argv: list[str] | None = None) -> int:
    run(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
