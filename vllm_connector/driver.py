"""`python -m kvbridge.vllm.driver` (in the vLLM venv): one vLLM engine serving requests read from stdin, one JSON
object a line; replies on stdout, everything vLLM prints goes to stderr. The first line is the engine's options
(`engine.EngineOptions`); then {"op": "generate", ...} or {"op": "quit"}. Used by `engine.EngineProcess`.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # anything else printed goes to the log
    options = json.loads(sys.stdin.readline())
    try:
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        env = options.pop("env", {})
        os.environ.update(env)
        kwargs = dict(model=options["model"], dtype=options["dtype"], max_model_len=options["max_model_len"],
                      block_size=options["block_size"], enable_prefix_caching=options["enable_prefix_caching"],
                      enforce_eager=True, seed=0)
        if options.get("kv_transfer_config"):
            kwargs["kv_transfer_config"] = options["kv_transfer_config"]
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises with the log
        replies.write(json.dumps({"error": f"{type(exc).__name__}: {exc}", "fatal": True}) + "\n")
        return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        if request["op"] == "quit":
            break
        extra = {"kv_transfer_params": {"kvbridge": request["kvbridge"]}} if request.get("kvbridge") else None
        params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], extra_args=extra)
        prompt = TokensPrompt(prompt_token_ids=request["prompt_token_ids"])
        if request.get("cache_salt"):
            prompt["cache_salt"] = request["cache_salt"]
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t0
        kv = (out.kv_transfer_params or {}).get("kvbridge", {})
        replies.write(json.dumps({"token_ids": list(out.outputs[0].token_ids), "seconds": seconds,
                                  "loaded_tokens": kv.get("loaded_tokens", 0), "kvbridge_error": kv.get("error", ""),
                                  "kvbridge_fetch_s": kv.get("fetch_s", 0.0),
                                  "num_cached_tokens": out.num_cached_tokens}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
