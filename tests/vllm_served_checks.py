"""The connector's answer for requests a real kvbridge server served (the tests' tiny identity server, tiny-phi3 ->
itself): run in the vLLM venv by tests/test_vllm_connector.py (`python vllm_served_checks.py CASE`, CASE a JSON object:
the server's address, the model's (layers, KV heads, head dim), a stored document's key, prompts by name that hold the
document (as stored, without the start token, after a head), and per mode the document tokens the correction's plan
recomputes). The
connector's scheduler side is called as vLLM's scheduler calls it (connector and helpers: vllm_connector_checks).
Prints one JSON object, check name -> "ok" or the failure's traceback.
"""

from __future__ import annotations

import json
import shutil
import sys
import traceback
from types import SimpleNamespace

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm_connector_checks import STAGING, answer, connector, finished, step_meta


def served(sched, req_id: str, key: str, mode: str, prompt: list[int]) -> dict:
    """A request's kvbridge answer after its lookup, its blocks' allocation and the step that hands its load on."""
    req = SimpleNamespace(request_id=req_id, kv_transfer_params={"kvbridge": {"key": key, "mode": mode}},
                          prompt_token_ids=prompt, cache_salt=f"salt-{req_id}")
    tokens, _ = answer(sched, req)
    if tokens:
        blocks = SimpleNamespace(get_block_ids=lambda: (list(range(1, len(prompt) // 32 + 2)),))
        sched.update_state_after_alloc(req, blocks, tokens)
        step_meta(sched)
    return finished(sched, req)


def check_the_answer_says_how_many_document_tokens_the_server_recomputed(case: dict):
    """Each prompt's and mode's answer: the KV loaded, and as recomputed_tokens the document tokens the server's
    header names (a correction's plan; 0 for replace; neither the start token nor a head counted); a request that
    fetched nothing says None."""
    sched = connector(KVConnectorRole.SCHEDULER, address=case["address"], shape=tuple(case["shape"]))
    try:
        for name, prompt in case["prompts"].items():
            for mode, want in case["recomputed"].items():
                got = served(sched, f"r-{name}-{mode}", case["key"], mode, prompt)
                assert got["error"] == "" and got["loaded_tokens"] > 0, (name, mode, got)
                assert got["recomputed_tokens"] == want, (name, mode, want, got)
        got = served(sched, "unknown", "no-such-key", "blend:0.25", case["prompts"]["as stored"])
        assert got["loaded_tokens"] == 0 and got["error"] and got["recomputed_tokens"] is None, got
    finally:
        sched.shutdown()


if __name__ == "__main__":
    case = json.loads(sys.argv[1])
    results = {}
    for name, check in [(n, f) for n, f in globals().items() if n.startswith("check_")]:
        try:
            check(case)
            results[name.removeprefix("check_")] = "ok"
        except Exception:  # noqa: BLE001 - reported per check
            results[name.removeprefix("check_")] = traceback.format_exc()
    shutil.rmtree(STAGING, ignore_errors=True)
    print(json.dumps(results))
