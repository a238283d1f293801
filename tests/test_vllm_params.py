"""The connector's vLLM-free parts: the request convention, its configuration, the prompt match, the hand-off."""

from __future__ import annotations

import stat

import pytest
import torch
from kvbridge.vllm import handoff
from kvbridge.vllm.engine import kv_transfer_config
from kvbridge.vllm.params import ConnectorConfig, RequestContext, match_prompt, request_params


def test_the_match_is_whole_blocks_and_never_the_last_token():
    cache = list(range(100))
    assert match_prompt(cache + [7, 8], cache, 32).loadable == 96  # 100 shared -> 3 blocks
    assert match_prompt(cache[:64], cache, 32).loadable == 32  # the prompt is all context: its last token is vLLM's
    assert match_prompt(cache[:65], cache, 32).loadable == 64
    assert match_prompt(cache + [1], cache, 32, recompute_tokens=40).loadable == 32
    diverged = cache[:50] + [999] + cache[51:]
    m = match_prompt(diverged, cache, 16)
    assert (m.common, m.loadable) == (50, 48)


def test_a_match_of_nothing_says_why():
    m = match_prompt([5, 1, 2, 3], [5, 9, 9, 9], 32)
    assert m.loadable == 0 and "shares only its first 1 tokens" in m.reason
    m = match_prompt(list(range(20)), list(range(10)), 32)
    assert m.loadable == 0 and "fill no whole block of 32" in m.reason


def test_request_params_round_trip_and_bad_ones_are_named():
    extra = request_params(key="abc", adapter="mix@1", server="eu", recompute_tokens=16)
    context = RequestContext.from_params(extra["kv_transfer_params"])
    assert context == RequestContext(key="abc", text=None, adapter="mix@1", server="eu", recompute_tokens=16)
    assert RequestContext.from_params(None) is None
    assert RequestContext.from_params({"other_connector": {}}) is None
    with pytest.raises(ValueError, match="exactly one of 'key' and 'text'"):
        RequestContext.from_params({"kvbridge": {"key": "a", "text": "b"}})
    with pytest.raises(ValueError, match="unknown fields"):
        RequestContext.from_params({"kvbridge": {"key": "a", "tokn": "b"}})
    with pytest.raises(ValueError, match="recompute_tokens"):
        request_params(text="t", recompute_tokens=-1)
    served = RequestContext.from_params(request_params(text="t", mode="blend:0.1")["kv_transfer_params"])
    assert served.mode == "blend:0.1" and context.mode is None  # None: the engine's default
    for bad in ("blend", "blend:0", "fuse:0.1", "replace:0.5", 3):
        with pytest.raises(ValueError, match="mode must be"):
            RequestContext.from_params({"kvbridge": {"text": "t", "mode": bad}})


@pytest.mark.parametrize("fields, named", [
    ({"key": ["x"]}, "key"), ({"key": 7}, "key"), ({"key": ""}, "key"), ({"text": {"t": 1}}, "text"),
    ({"text": ""}, "text"), ({"key": "k", "adapter": ["a"]}, "adapter"), ({"key": "k", "adapter": 3}, "adapter"),
    ({"key": "k", "server": ["s"]}, "server"), ({"key": "k", "server": ""}, "server"),
    ({"key": "k", "recompute_tokens": True}, "recompute_tokens"), ({"key": "k", "recompute_tokens": 1.5},
                                                                  "recompute_tokens")])
def test_a_context_field_of_the_wrong_type_is_refused_by_name(fields, named):
    """Every field is type-checked: a RequestContext is hashed on vLLM's scheduler thread (plans.Covered), where a
    list kept in it raised TypeError and killed the engine core."""
    with pytest.raises(ValueError, match=f"'{named}'"):
        RequestContext.from_params({"kvbridge": fields})
    with pytest.raises(ValueError, match=f"'{named}'"):
        request_params(**{"key": None, **fields})  # the same checks for whoever builds the parameters


def test_parameters_that_are_no_dict_are_refused_and_accepted_contexts_hash():
    from kvbridge.vllm.params import SaveRequest

    for bad in ("kvbridge", ["kvbridge"], 3):
        with pytest.raises(ValueError, match="kv_transfer_params must be a dict"):
            RequestContext.from_params(bad)
        with pytest.raises(ValueError, match="kv_transfer_params must be a dict"):
            SaveRequest.from_params(bad)
    context = RequestContext.from_params(request_params(key="k", adapter="a@1", server="eu", recompute_tokens=0,
                                                        mode="replace")["kv_transfer_params"])
    assert hash((context, "salt", "replace", 0)) == hash((context, "salt", "replace", 0))


def test_the_engine_config_reads_back(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-0123456789\n")
    whole = kv_transfer_config(address="127.0.0.1:1", servers={"b": {"address": "127.0.0.1:2", "token": "t"}},
                               timeout_s=3, recompute_tokens=32, fetch_threads=2)
    assert whole["kv_load_failure_policy"] == "recompute"  # a failed load is recomputed, not a failed request
    extra = whole["kv_connector_extra_config"]
    extra["kvbridge_token_file"] = str(token_file)
    config = ConnectorConfig.from_extra(extra)
    assert config.servers["default"].address == "127.0.0.1:1"
    assert config.servers["default"].token == "s3cret-token-0123456789"
    assert config.servers["b"].token == "t" and config.timeout_s == 3 and config.recompute_tokens == 32
    assert config.fetch_threads == 2 and ConnectorConfig.from_extra({"kvbridge_address": "h:1"}).fetch_threads == 4
    with pytest.raises(ValueError, match="kvbridge_fetch_threads must be >= 1"):
        ConnectorConfig.from_extra({**extra, "kvbridge_fetch_threads": 0})
    assert config.idle_wait_ms == 10
    assert ConnectorConfig.from_extra({**extra, "kvbridge_idle_wait_ms": 0}).idle_wait_ms == 0
    with pytest.raises(ValueError, match="kvbridge_idle_wait_ms must be within"):
        ConnectorConfig.from_extra({**extra, "kvbridge_idle_wait_ms": -1})
    assert config.mode == "" and ConnectorConfig.from_extra({**extra, "kvbridge_mode": "blend:0.1"}).mode == "blend:0.1"
    with pytest.raises(ValueError, match="kvbridge_mode must be"):
        ConnectorConfig.from_extra({**extra, "kvbridge_mode": "blend:1.5"})
    with pytest.raises(ValueError, match="at least one server"):
        ConnectorConfig.from_extra({})
    with pytest.raises(ValueError, match="host:port"):
        ConnectorConfig.from_extra({"kvbridge_address": "localhost"})


def test_the_handoff_is_private_and_read_once(tmp_path):
    kv = torch.randn(2, 2, 3, 5, 4)  # [L, 2, H, T, D]
    path = handoff.stage(kv, tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(path.stem) > 32  # an unguessable name
    assert torch.equal(handoff.take(path), kv)
    assert not path.exists()
    with pytest.raises(ValueError, match=r"\[L, 2, H_kv, T, D\]"):
        handoff.stage(torch.zeros(2, 3, 4), tmp_path)


def test_kvbridge_demo_engine_vllm_without_the_vllm_venv_says_how_to_make_it(monkeypatch, tmp_path):
    from kvbridge.cli import build_parser, main

    assert build_parser().parse_args(["demo", "--engine", "vllm"]).engine == "vllm"
    monkeypatch.setenv("KVBRIDGE_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(SystemExit, match="KVBRIDGE_VLLM=1 ./setup.sh"):
        main(["demo", "--engine", "vllm"])


def test_staging_folders_are_private_and_a_dead_engines_folder_is_swept(tmp_path):
    """An engine's staging folder is 0700 and its own; the folder of an engine that is gone (a process that exited,
    as a SIGKILLed engine would leave it, files and all) is removed by the next engine's sweep, a live one's kept."""
    import os
    import subprocess
    import sys

    mine = handoff.private_folder(tmp_path)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700 and handoff.private_folder(tmp_path) == mine
    staged = handoff.stage(torch.zeros(1, 2, 1, 3, 4), mine)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = handoff.private_folder(tmp_path, pid=int(dead.stdout))
    left = handoff.stage(torch.zeros(1, 2, 1, 3, 4), gone)
    other = tmp_path / "unrelated"  # not a staging folder: never touched
    other.mkdir()
    assert handoff.sweep(tmp_path) == [gone]
    assert not left.exists() and not gone.exists() and staged.exists() and other.exists()
    loose = tmp_path / f"{handoff.PREFIX}{os.getuid()}-{os.getpid() + 10**7}"  # a shared folder under our name
    loose.mkdir(mode=0o755)
    with pytest.raises(PermissionError, match="not a private folder"):
        handoff.private_folder(tmp_path, pid=os.getpid() + 10**7)


def test_a_save_request_goes_alone_and_bad_ones_are_named():
    from kvbridge.vllm.params import SaveRequest

    assert SaveRequest.from_params({"kvbridge": {"save": {}}}) == SaveRequest()
    assert SaveRequest.from_params({"kvbridge": {"save": {"server": "src", "tokens": 7}}}) == SaveRequest("src", 7)
    assert SaveRequest.from_params({"kvbridge": {"text": "x"}}) is None and SaveRequest.from_params(None) is None
    assert RequestContext.from_params({"kvbridge": {"save": {}}}) is None  # a save is no load
    for bad, words in (({"save": {"tokens": 0}}, "tokens"), ({"save": {"tokens": True}}, "tokens"),
                       ({"save": {"server": ""}}, "server"), ({"save": {"other": 1}}, "optional"),
                       ({"save": []}, "must be a dict")):
        with pytest.raises(ValueError, match=words):
            SaveRequest.from_params({"kvbridge": bad})
    with pytest.raises(ValueError, match="goes alone"):
        RequestContext.from_params({"kvbridge": {"save": {}, "text": "x"}})
    with pytest.raises(ValueError, match="role"):
        kv_transfer_config(address="127.0.0.1:1", role="kv_sometimes")
    assert kv_transfer_config(address="127.0.0.1:1", role="kv_both")["kv_role"] == "kv_both"


def test_the_save_tracker_hands_out_each_position_once_across_chunked_steps():
    """A prompt of 100 tokens saving its first 70: a first step of 40 (10 of them from vLLM's prefix cache), a
    second of 50; a request that saves nothing is not listed."""
    from types import SimpleNamespace

    from kvbridge.vllm.params import SaveRequest
    from kvbridge.vllm.saving import SaveTracker

    def step(new=(), cached=(), scheduled=None):
        ids = [c[0] for c in cached]
        return SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=n, block_ids=(b,)) for r, n, b in new],
            scheduled_cached_reqs=SimpleNamespace(req_ids=ids, resumed_req_ids=set(),
                                                  new_block_ids=[(c[2],) if c[2] else None for c in cached],
                                                  num_computed_tokens=[c[1] for c in cached]),
            num_scheduled_tokens=scheduled or {})

    tracker = SaveTracker()
    tracker.add("a", SaveRequest(tokens=70), list(range(100)))
    first = tracker.chunks(step(new=[("a", 10, [3, 4]), ("b", 0, [5])], scheduled={"a": 30, "b": 9}))
    assert [(c.req_id, c.start, c.end, c.block_ids, c.token_ids) for c in first] == [("a", 0, 40, [3, 4], None)]
    second = tracker.chunks(step(cached=[("a", 40, [6, 7])], scheduled={"a": 50}))
    assert [(c.start, c.end, c.block_ids, c.total) for c in second] == [(40, 70, [3, 4, 6, 7], 70)]
    assert second[0].token_ids == list(range(70))
    assert tracker.chunks(step(cached=[("a", 90, None)], scheduled={"a": 1})) == []  # decoding: nothing new
    assert tracker.finish("a") == {"saved_tokens": 70, "save_server": "default"} and tracker.finish("a") is None


def test_the_saver_drops_the_partial_kv_of_a_request_that_finished_before_its_last_chunk():
    """A saving request aborted mid-prompt: the worker's partial buffer ([L, 2, H, total, D], GBs for a long prompt)
    goes when the request is reported finished, not only when its last chunk is read."""
    from types import SimpleNamespace

    from kvbridge.vllm.layouts import write_cpu_vec
    from kvbridge.vllm.saving import SaveChunk, Saver

    saver = Saver(ConnectorConfig.from_extra({"kvbridge_address": "127.0.0.1:1"}), "unused", 32)
    cache = torch.zeros(4, 2, 32, 16)  # [blocks, H_kv, block_size, 2 D], the CPU "vec" layout
    key = torch.randn(32, 2, 8)  # [T, H_kv, D]
    write_cpu_vec(cache, key, torch.randn(32, 2, 8), torch.arange(32, 64))  # into block 1
    first = [SaveChunk("a", "default", [1, 2], 0, 32, 64), SaveChunk("b", "default", [3], 0, 32, 32)]
    for index in range(2):
        saver.save_layer(index, 2, SimpleNamespace(isa="vec"), cache, first[:1])
    assert saver._kv["a"].shape == (2, 2, 2, 64, 8)  # [L, 2, H_kv, total, D]: the whole prompt's, from chunk one
    assert torch.equal(saver._kv["a"][1, 0, :, :32], key.transpose(0, 1))
    saver.save_layer(0, 2, SimpleNamespace(isa="vec"), cache, first[1:])
    saver.step_done(first)  # "a" waits for its second chunk, "b" for its token ids: both kept
    assert set(saver._kv) == {"a", "b"}
    saver.forget({"a", "b", "never-saved"})  # aborted, both
    assert saver._kv == {}
    saver.close()


def test_a_request_whose_table_lacks_blocks_is_not_saved_and_the_engine_saves_the_others():
    """A sliding-window engine's table holds the null block (id 0) before the window after a prefix-cache hit: that
    request cannot be saved. It used to stop the engine's saving for good (every later request refused); now only that
    request is counted failed, and the next is read and uploaded."""
    from types import SimpleNamespace

    from kvbridge.vllm.layouts import write_cpu_vec
    from kvbridge.vllm.saving import SaveChunk, Saver

    saver = Saver(ConnectorConfig.from_extra({"kvbridge_address": "127.0.0.1:1"}), "unused", 32)
    uploaded = []
    saver._upload = lambda req_id, server, kv, token_ids: uploaded.append((req_id, kv.clone(), token_ids))
    cache = torch.zeros(4, 2, 32, 16)  # [blocks, H_kv, block_size, 2 D], the CPU "vec" layout
    key, value = torch.randn(32, 2, 8), torch.randn(32, 2, 8)
    write_cpu_vec(cache, key, value, torch.arange(64, 96))  # into block 2
    windowed = SaveChunk("w", "default", [0, 2], 0, 64, 64, token_ids=list(range(64)))  # block 0: the null block
    whole = SaveChunk("b", "default", [2], 0, 32, 32, token_ids=list(range(32)))
    for index in range(2):
        saver.save_layer(index, 2, SimpleNamespace(isa="vec"), cache, [windowed])
    saver.step_done([windowed])
    assert saver.counts() == {"saves_failed": 1} and "w" not in saver._kv
    for index in range(2):
        saver.save_layer(index, 2, SimpleNamespace(isa="vec"), cache, [whole])
    saver.step_done([whole])
    saver.close()  # waits for the upload thread
    assert [(r, t) for r, _, t in uploaded] == [("b", list(range(32)))]
    assert torch.equal(uploaded[0][1][1, 0], key.transpose(0, 1)) and torch.equal(uploaded[0][1][0, 1],
                                                                                   value.transpose(0, 1))
    assert saver.counts() == {} and not saver._unsaved
    first = SaveChunk("a", "default", [0, 2], 0, 64, 96)  # its first chunk: aborted before its last
    saver.save_layer(0, 2, SimpleNamespace(isa="vec"), cache, [first])
    assert set(saver._unsaved) == {"a"}
    saver.forget({"a"})
    assert not saver._unsaved and not saver._kv


def test_covered_knows_what_a_lookup_would_load_only_for_the_prompt_start_it_saw():
    from kvbridge.vllm.plans import Covered

    covered = Covered(capacity=2)
    context = RequestContext(key="k", text=None)
    key = (context, "salt", "replace", 0)
    doc = list(range(300))
    assert covered.loadable(key, doc + [1, 2], 128, 0) is None  # never fetched: the lookup decides
    covered.remember(key, doc + [1, 2], 300)  # the server's cache was the prompt's first 300 tokens
    assert covered.loadable(key, doc + [7, 8, 9], 128, 0) == 256  # another question after the same document
    assert covered.loadable(key, doc + [7], 128, 64) == 128  # 64 tokens left to recompute: two blocks of 128
    assert covered.loadable(key, doc[:299] + [5, 1], 128, 0) is None  # the document differs: ask the server
    assert covered.loadable(key, doc[:200], 128, 0) is None  # shorter than the cache: ask the server
    assert covered.loadable((context, "other salt", "replace", 0), doc + [1], 128, 0) is None
    covered.remember(key, doc, 0)  # a cache that did not match whole: nothing remembered over the last
    assert covered.loadable(key, doc + [1], 128, 0) == 256
    for n in range(3):  # least recently used dropped past the capacity
        covered.remember((RequestContext(key=str(n), text=None), "", "", 0), doc, 10)
    assert len(covered) == 2 and covered.loadable(key, doc + [1], 128, 0) is None


def test_the_recomputed_document_tokens_count_from_the_document_position():
    from kvbridge.vllm.plans import served_recomputed

    listed = torch.tensor([0, 1, 2, 5, 5, 9])  # a repeated position counts once
    assert served_recomputed(listed, 1) == 4  # as stored: the start token at 0 is not the document's
    assert served_recomputed(listed, 0) == 5  # no start token: the document's first token, recomputed, at 0
    assert served_recomputed(listed, 3) == 2  # after a head of 3 tokens (their KV the target's own)
    assert served_recomputed(listed, None) == 4  # a server without the field: past position 0, as before it
    assert served_recomputed(torch.tensor([], dtype=torch.int64), 1) == 0  # replace


def test_the_engine_options_reach_vllms_arguments_eager_unless_told():
    """The driver builds LLM(...) from EngineOptions: eager by default (engines up in seconds for tests and
    evaluations), compiled when asked (as `vllm serve` runs the model: bench_vllm.py), the connector when given."""
    from dataclasses import asdict

    from kvbridge.vllm.driver import llm_arguments
    from kvbridge.vllm.engine import EngineOptions

    quick = llm_arguments(asdict(EngineOptions(model="m")))
    assert quick["enforce_eager"] is True and "kv_transfer_config" not in quick
    assert quick["model"] == "m" and quick["seed"] == 0
    config = kv_transfer_config(address="127.0.0.1:1")
    deployed = llm_arguments(asdict(EngineOptions(model="m", enforce_eager=False, enable_prefix_caching=True,
                                                  kv_transfer_config=config)))
    assert deployed["enforce_eager"] is False and deployed["enable_prefix_caching"] is True
    assert deployed["kv_transfer_config"] == config


def test_cache_salts_part_every_choice_that_changes_the_loaded_kv():
    """A salt per server, adapter, correction and recompute_tokens: under one salt, vLLM's prefix cache hands a
    request the blocks an earlier one loaded, so a request that leaves more of the context's tokens to vLLM's own
    prefill (recompute_tokens) needs a salt of its own, or it reads projected KV where it asked for its own."""
    from kvbridge.vllm.engine import cache_salt

    assert cache_salt() == "kvbridge:default:"  # salts of earlier releases read as before
    assert cache_salt("a", "s", "blend:0.1") == "kvbridge:s:a:blend:0.1"
    salts = {cache_salt(*choice) for choice in (("",), ("a",), ("a", "s"), ("a", "s", "blend:0.1"),
                                                 ("a", "s", "blend:0.1", 0), ("a", "s", "blend:0.1", 64))}
    assert len(salts) == 6


def test_demo_through_vllm_shows_a_failed_servers_log(monkeypatch, capsys):
    """The demo read the log of a server that exited non-zero after the folder holding it was gone: it died with
    FileNotFoundError (exit 2) and the reason the server failed was lost. Only the server's exit is staged here (and
    what the demo would need vLLM and the packaged models for): it shows the log and exits 1."""
    from pathlib import Path

    import kvbridge.eval.demo_vllm as demo_vllm
    import kvbridge.server.client as client
    import kvbridge.transfer.models as models
    import kvbridge.transfer.presets as presets
    import kvbridge.vllm.engine as engine
    from kvbridge.cli import main
    from kvbridge.transfer.tiny_pair import tiny_source, tiny_target

    class Server:  # exits with 1 after writing its reason into its folder's log
        def __init__(self, args, workdir):
            self.log, self.address = workdir / "serve.log", "127.0.0.1:1"
            self.log.write_text("Traceback ...\nRuntimeError: the server failed while draining\n")

        def tail(self, lines=30):
            return self.log.read_text()

        def stop(self):
            return 1

    class Quiet:  # the client and the engine: nothing to reach
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def ingest(self, **kwargs):
            pass

        def generate(self, prompt, max_tokens=1, kvbridge=None):
            return {"token_ids": [5, 6, 7][:max_tokens], "loaded_tokens": 0, "seconds": 0.1,
                    "kvbridge_fetch_s": 0.01, "kvbridge_error": ""}

    for module, name, value in ((engine, "vllm_available", lambda: ""), (engine, "engine_dtype", lambda: "float32"),
                                (engine, "kv_transfer_config", lambda **k: {}), (engine, "EngineOptions", dict),
                                (engine, "EngineProcess", Quiet), (client, "KVBridgeClient", Quiet),
                                (models, "prepare_gguf", lambda name: Path("/nonexistent")),
                                (presets, "load_pair", lambda preset: (tiny_source("cpu"), tiny_target("cpu"))),
                                (demo_vllm, "_ensure_adapter", lambda *a: "staged"),
                                (demo_vllm, "BackgroundServer", Server)):
        monkeypatch.setattr(module, name, value)
    assert main(["demo", "--engine", "vllm", "--no-selfcheck"]) == 1
    assert "RuntimeError: the server failed while draining" in capsys.readouterr().out
