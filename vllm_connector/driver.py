"""`python -m kvbridge.vllm.driver` (in the vLLM venv): one vLLM engine serving requests read from stdin, one JSON
object a line; replies on stdout, everything vLLM prints goes to stderr. The first line is the engine's options
(`engine.EngineOptions`); then {"op": "generate", ...} or {"op": "quit"}. Used by `engine.EngineProcess`.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvbridge.transfer import timeline


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # anything else printed goes to the log
    options = json.loads(sys.stdin.readline())
    try:
        from vllm import LLM

        env = options.pop("env", {})
        os.environ.update(env)
        llm = LLM(**llm_arguments(options))
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises with the log
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}", "fatal": True}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        if request["op"] == "generate_many":  # submitted together, stepped until all finish: who finished when
            replies.write(json.dumps({"replies": _generate_many(llm, request["requests"])}) + "\n")
            continue
        prompt, params = _request(request)
        timeline.event("submit")
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        timeline.event("done")
        replies.write(json.dumps(_reply(out, time.perf_counter() - t0, request)) + "\n")
    return 0


def llm_arguments(options: dict) -> dict:
    """vLLM's LLM(...) arguments for the engine's options (`engine.EngineOptions` as a dict)."""
    kwargs = dict(model=options["model"], dtype=options["dtype"], max_model_len=options["max_model_len"],
                  block_size=options["block_size"], enable_prefix_caching=options["enable_prefix_caching"],
                  enforce_eager=options.get("enforce_eager", True), seed=0)
    if options.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = options["kv_transfer_config"]
    return kwargs


def _request(request: dict):
    """(TokensPrompt, SamplingParams) of one request of the protocol."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"kvbridge": request["kvbridge"]}} if request.get("kvbridge") else None
    scoring = {}
    if request.get("score_from") is not None:
        # the prompt's own log-probs (and top-1) from `score_from` on. vLLM turns prefix-cache and connector
        # reads off for such requests unless told otherwise; it computes log-probs only for the positions it
        # prefills (rows of loaded positions are left unset), so the reply checks that none of those is asked
        # for. No detokenising: those unset rows would be decoded too.
        scoring = {"prompt_logprobs": 1, "skip_reading_prefix_cache": False, "detokenize": False}
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], extra_args=extra, **scoring)
    prompt = TokensPrompt(prompt_token_ids=request["prompt_token_ids"])
    if request.get("cache_salt"):
        prompt["cache_salt"] = request["cache_salt"]
    return prompt, params


def _reply(out, seconds: float, request: dict) -> dict:
    kv = (out.kv_transfer_params or {}).get("kvbridge", {})
    reply = {"token_ids": list(out.outputs[0].token_ids), "seconds": seconds,
             "loaded_tokens": kv.get("loaded_tokens", 0), "kvbridge_error": kv.get("error", ""),
             "kvbridge_fetch_s": kv.get("fetch_s", 0.0), "kvbridge_wire_bytes": kv.get("wire_bytes", 0),
             "kvbridge_transport": kv.get("transport", ""),
             "kvbridge_scheduler_s": kv.get("scheduler_s", 0.0),
             "kvbridge_scheduler_max_s": kv.get("scheduler_max_s", 0.0),
             "kvbridge_prefix_cached": kv.get("prefix_cached", 0),
             "kvbridge_read_ahead": bool(kv.get("read_ahead", False)),
             "kvbridge_recomputed_tokens": kv.get("recomputed_tokens"), "num_cached_tokens": out.num_cached_tokens}
    if request.get("score_from") is not None:
        reply.update(_prompt_scores(out, request["prompt_token_ids"], request["score_from"]))
    return reply


def _generate_many(llm, requests: list[dict]) -> list[dict]:
    """Requests added to the engine at once and stepped together; each reply's "seconds" runs from the submission to
    that request's finish, and "finished" is its place in the order they finished (0 first)."""
    engine = llm.llm_engine
    ids = [f"kvbridge-many-{n}-{time.monotonic_ns()}" for n in range(len(requests))]
    t0 = time.perf_counter()
    for request_id, request in zip(ids, requests):
        engine.add_request(request_id, *_request(request))
    done: dict[str, dict] = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished and out.request_id in ids:
                done[out.request_id] = _reply(out, time.perf_counter() - t0, requests[ids.index(out.request_id)])
                done[out.request_id]["finished"] = len(done) - 1
    return [done[request_id] for request_id in ids]


def _prompt_scores(out, prompt: list[int], score_from: int) -> dict:
    """{"prompt_scores": [[log-prob of prompt[i], the top-1 token id at i] for i in score_from..len(prompt)-1]}, or
    {"score_error": a sentence} when vLLM computed no log-prob for one of them (it loaded that position's KV)."""
    if not 1 <= score_from < len(prompt):
        return {"score_error": f"score_from must be in [1, {len(prompt) - 1}], got {score_from}"}
    if out.num_cached_tokens >= score_from:  # position i's log-prob comes from the forward at i - 1
        return {"score_error": f"vLLM read {out.num_cached_tokens} prompt tokens from cache: the log-probs from "
                               f"position {score_from} on need the forward of position {score_from - 1}"}
    scores = []
    for i in range(score_from, len(prompt)):
        row = out.prompt_logprobs[i]
        top1 = min(row.items(), key=lambda item: item[1].rank)[0]
        scores.append([row[prompt[i]].logprob, int(top1)])
    return {"prompt_scores": scores}


if __name__ == "__main__":
    sys.exit(main())
