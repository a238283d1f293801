"""The connector's scheduler-side and worker-side methods called directly, as vLLM 0.32's scheduler and model runner
call them, with no engine (tests/vllm_connector_checks.py, run once in the vLLM venv): malformed request parameters
never raise on the scheduler's thread, a finished request's partial save is dropped, a quantized KV cache is refused
by name, a load that failed on a worker is reported as failed in the request's kvbridge answer, a request that
waited past its segment's TTL on the server fetches it again, an abort under async scheduling keeps the server's
segment until the worker read it and takes a failed load's blocks out of vLLM's prefix cache, an empty step under
async scheduling waits only when nothing runs, a save's answer says its upload is queued and the workers count
uploads, tensor parallelism is refused at construction, and a lookup whose KV another request loaded meanwhile
says prefix_cached.

Skipped when the vLLM venv is missing (`KVBRIDGE_VLLM=1 ./setup.sh` creates it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from kvbridge.vllm.engine import CPU_ENV, vllm_available, vllm_python

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(bool(vllm_available()), reason=vllm_available() or "vLLM venv present")]


@pytest.fixture(scope="module")
def checks() -> dict[str, str]:
    env = {**os.environ, **CPU_ENV}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([str(vllm_python()), str(Path(__file__).with_name("vllm_connector_checks.py"))],
                         capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["malformed_parameters_never_reach_the_scheduler_thread",
                                  "the_worker_drops_the_partial_save_of_a_finished_request",
                                  "a_quantized_kv_cache_is_refused_by_name",
                                  "a_load_that_failed_on_the_worker_is_reported_as_failed",
                                  "a_segment_past_its_ttl_is_fetched_again_not_loaded",
                                  "an_abort_under_async_scheduling_keeps_the_segment_until_the_worker_read_it",
                                  "a_failed_load_of_a_finished_request_leaves_the_prefix_cache",
                                  "an_empty_step_under_async_scheduling_waits_only_when_nothing_runs",
                                  "a_save_answer_says_queued_and_the_workers_count_uploads",
                                  "tensor_parallelism_is_refused_at_construction",
                                  "a_lookup_whose_kv_another_request_loaded_meanwhile_says_prefix_cached"])
def test_connector_method(checks, name):
    assert checks.get(name) == "ok", checks.get(name, f"no check {name}")


def test_the_connector_answer_says_how_many_document_tokens_a_served_correction_recomputed(identity_server,
                                                                                          tiny_target):
    """tests/vllm_served_checks.py, against the tiny identity server: each request's kvbridge answer carries the
    document tokens the server's reply header says it recomputed, those from the header's document position on (the
    start token's position 0, which the header lists among a stored correction's, not counted; nor a chat template's
    head), the number the evaluator checks against the correction's plan: for a prompt as stored, one without the
    start token (the document's first token, always recomputed, at position 0) and one with a head before the
    document."""
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.transfer.suffix.correction import Correction

    text = " ".join(f"served{i} count" for i in range(40))  # a document no other test stores
    instruction = tiny_target.tokenizer(" Summarize it.", add_special_tokens=False)["input_ids"]
    with KVBridgeClient(identity_server.address, timeout_s=60) as client:
        key = client.ingest(text=text).entries[0].key
        ids = client.fetch_projected(key=key, mode="replace").segment.token_ids.tolist()  # [start] + document
        head = [ids[0], *instruction]  # a template's tokens before the document
        prompts = {"as stored": ids + instruction, "no start token": ids[1:] + instruction,
                   "after a head": head + ids[1:] + instruction}
        headers = {(name, mode): client.fetch_projected(key=key, mode=mode, prompt=prompt)
                   for name, prompt in prompts.items() for mode in ("replace", "blend:0.25", "recompute:0.25")}
    plan = {mode: Correction.parse(mode).tokens(len(ids) - 1) for _, mode in headers}
    assert plan["replace"] == 0 and all(0 < k < len(ids) - 1 for k in list(plan.values())[1:])
    assert {name: headers[name, "replace"].document_position for name in prompts} == {
        "as stored": 1, "no start token": 0, "after a head": len(head)}
    assert 0 in headers["as stored", "blend:0.25"].recomputed  # the start token, as stored
    assert 0 in headers["no start token", "blend:0.25"].recomputed  # the document's first token
    for (name, mode), fetched in headers.items():
        assert fetched.document_position == headers[name, "replace"].document_position, (name, mode)
        doc = fetched.recomputed[fetched.recomputed >= fetched.document_position]
        assert doc.unique().numel() == plan[mode], (name, mode, fetched.recomputed)
    spec = tiny_target.spec
    case = {"address": identity_server.address, "shape": [spec.num_layers, spec.num_kv_heads, spec.head_dim],
            "key": key, "prompts": prompts, "recomputed": plan}
    env = {**os.environ, **CPU_ENV}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([str(vllm_python()), str(Path(__file__).with_name("vllm_served_checks.py")),
                          json.dumps(case)], capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    checks = json.loads(run.stdout.strip().splitlines()[-1])
    assert checks == {"the_answer_says_how_many_document_tokens_the_server_recomputed": "ok"}, checks
