"""vLLM's OpenAI-compatible server (a real process, HTTP) with the kvbridge connector, as users call it: a completion
whose text prompt has no start token, and a chat completion whose template and system prompt come before the
document. The kvbridge server (the small pair: Gemma-3-270M -> SmolLM2, the shipped adapter) places the document
where the prompt has it, after the target's own KV of the tokens before it; vLLM's greedy tokens must equal the
in-process ones over the same served KV. The engine runs in float32, blocks of 32, prefix caching on (vLLM's
default: requests that load projected KV give a cache_salt).

Skipped when the vLLM venv is missing (`KVBRIDGE_VLLM=1 ./setup.sh` creates it).
"""

from __future__ import annotations

import pytest
import torch
from kvbridge.vllm.engine import vllm_available

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(vllm_available()), reason=vllm_available() or "vLLM venv present")]

BLOCK = 32
NEW = 16  # greedy tokens compared
INSTRUCTION = "\n\nSummary (one sentence):"


@pytest.fixture(scope="module")
def small_server(gemma, smollm2, tmp_path_factory):
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="small", listen="127.0.0.1:0", adapters=str(tmp_path_factory.mktemp("adapters")),
                         store_capacity_mb=256, selfcheck=False)
    running = start_server(build_service(config, source=gemma, targets=[smollm2]), config)
    _warm(running, smollm2)
    yield running
    running.stop(1)


def _warm(running, smollm2) -> None:
    """One fetch of another text before vLLM starts: the server's one-time work (the adapter's load, the first
    projection) is done while it has the cores to itself. A CPU vLLM worker busy-polls its queue for a second after
    every step, and the engine steps while a lookup is pending: a fetch during a request shares the two cores with it
    (measured here: 0.13 s alone, 2-8 s beside the engine)."""
    from kvbridge.server.client import KVBridgeClient

    with KVBridgeClient(running.address, timeout_s=300) as client:
        client.fetch_projected(text="A warm-up text the tests never ask for.", target_model=smollm2.name,
                               mode="replace")


@pytest.fixture(scope="module")
def api(small_server, tmp_path_factory):
    from kvbridge.transfer.models import prepare_gguf
    from kvbridge.vllm.engine import kv_transfer_config
    from kvbridge.vllm.openai_server import OpenAIServer

    # a generous bound: these tests check tokens, not speed, and a fetch shares the cores with the engine
    config = kv_transfer_config(address=small_server.address, timeout_s=300, mode="replace")
    with OpenAIServer(prepare_gguf("smollm2-135m-instruct-q4_1"), config,
                      tmp_path_factory.mktemp("vllm-openai") / "server.log", dtype="float32", max_model_len=1024,
                      block_size=BLOCK) as running:
        yield running


@pytest.fixture(scope="module")
def document(smollm2):
    """The demo's document, cut to about 200 target tokens at a sentence end."""
    from kvbridge.eval.demo import DEMO_DOC, SAMPLE
    from kvbridge.eval.summaries import read_records
    from kvbridge.transfer.data import data_path

    text = next(r for r in read_records(data_path(SAMPLE)) if r.id == DEMO_DOC).document
    ids = smollm2.tokenizer(text, add_special_tokens=False)["input_ids"][:200]
    cut = smollm2.tokenizer.decode(ids)
    return cut[:cut.rfind(".") + 1]


def _reference(smollm2, small_server, document: str, prompt: list[int], loaded: int) -> list[int]:
    """In-process greedy tokens: the served cache for this prompt (fetched as the connector fetches it), its first
    `loaded` tokens as context, the rest of the prompt prefilled by transformers over it."""
    from kvbridge.eval.summaries import greedy
    from kvbridge.server.client import KVBridgeClient

    with KVBridgeClient(small_server.address) as client:
        fetched = client.fetch_projected(text=document, target_model=smollm2.name, mode="replace", prompt=prompt)
    assert fetched.segment.token_ids[:loaded].tolist() == prompt[:loaded]
    tokens, _ = greedy(smollm2, fetched.segment.slice(0, loaded), torch.tensor(prompt[loaded:]), NEW, stop=set())
    return tokens


def _salted(body: dict, document: str) -> dict:
    from kvbridge.vllm.engine import cache_salt

    return {**body, "max_tokens": NEW, "temperature": 0, "return_token_ids": True, "cache_salt": cache_salt(),
            "kv_transfer_params": {"kvbridge": {"text": document}}}


def test_a_completion_of_a_text_prompt_loads_the_document_and_gives_the_in_process_tokens(api, document, smollm2,
                                                                                           small_server):
    body = _salted({"model": api.model, "prompt": document + INSTRUCTION}, document)
    answer = api.post("/v1/completions", body)
    choice = answer["choices"][0]
    done = answer["kv_transfer_params"]["kvbridge"]
    prompt = choice["prompt_token_ids"]
    assert prompt[0] != smollm2.tokenizer.bos_token_id  # a text prompt: SmolLM2's tokenizer adds no start token
    assert done["error"] == "" and done["loaded_tokens"] >= 4 * BLOCK and done["loaded_tokens"] % BLOCK == 0
    reference = _reference(smollm2, small_server, document, prompt, done["loaded_tokens"])
    assert choice["token_ids"] == reference[:len(choice["token_ids"])] and len(choice["token_ids"]) >= 4


def test_a_chat_completion_loads_the_template_head_and_the_document(api, document, smollm2, small_server):
    messages = [{"role": "system", "content": "You are a concise assistant."},
                {"role": "user", "content": document + INSTRUCTION}]
    answer = api.post("/v1/chat/completions", _salted({"model": api.model, "messages": messages}, document))
    done = answer["kv_transfer_params"]["kvbridge"]
    prompt = answer["prompt_token_ids"]
    template = smollm2.tokenizer.apply_chat_template(messages[:1], tokenize=False)
    head = smollm2.tokenizer(template, add_special_tokens=False)["input_ids"]
    assert prompt[:len(head)] == head  # the template and the system prompt come first
    assert done["error"] == "" and done["loaded_tokens"] >= len(head) + 4 * BLOCK
    reference = _reference(smollm2, small_server, document, prompt, done["loaded_tokens"])
    tokens = answer["choices"][0]["token_ids"]
    assert tokens == reference[:len(tokens)] and len(tokens) >= 4


def test_a_request_without_kvbridge_context_is_unchanged(api, document, smollm2):
    """No kv_transfer_params: nothing loaded, no kvbridge answer, and vLLM's tokens are its own prefill's (the same
    greedy tokens as transformers' own prefill of the prompt)."""
    from kvbridge.eval.summaries import greedy
    from kvbridge.transfer import kvcache

    offset = api.log_size()
    answer = api.post("/v1/completions", {"model": api.model, "prompt": document + INSTRUCTION, "max_tokens": NEW,
                                          "temperature": 0, "return_token_ids": True})
    assert not (answer.get("kv_transfer_params") or {}).get("kvbridge")
    choice = answer["choices"][0]
    prompt = choice["prompt_token_ids"]
    context = kvcache.extract(smollm2.model, smollm2.spec, torch.tensor(prompt[:-1]))
    reference, _ = greedy(smollm2, context, torch.tensor(prompt[-1:]), NEW, stop=set())
    assert choice["token_ids"] == reference[:len(choice["token_ids"])]
    assert "kvbridge: request" not in api.log_text(offset)


def test_the_readmes_curl_requests_load_the_document(api):
    """README's two curl requests (its bash block as it stands, against this server's port): both load tokens."""
    import json
    import os
    import re
    import subprocess
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "curl -s localhost:8000" in b)
    script = block.replace("localhost:8000", f"127.0.0.1:{api.port}")
    env = {**os.environ, "KVBRIDGE_HOME": str(Path(api.model).parents[1])}
    out = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, env=env, timeout=300, check=True)
    answers, text, decoder = [], out.stdout.strip(), json.JSONDecoder()
    while text:
        answer, end = decoder.raw_decode(text)
        answers.append(answer)
        text = text[end:].strip()
    assert [a["object"] for a in answers] == ["text_completion", "chat.completion"], out.stdout[:500]
    for answer in answers:
        done = answer["kv_transfer_params"]["kvbridge"]
        assert done["error"] == "" and done["loaded_tokens"] >= 64, done
