"""A failed call leaves the store as it was (server/undo.py): what a request stored before one of its later steps was
refused (a correction, a prompt's head or a segment over the tenant's quota; a reply whose header the client's
message limit cannot take; the store's own write of new blocks) is removed again, and an upload or a same-host fetch
the client left stores or holds nothing."""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest
import served
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.chunks import dtype_name, iter_chunks
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.transfer.segment import KVSegment
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store import PagedStore, StoreConfig, pool_data
from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector


def _held(running):
    store = running.service.store
    return store.stats().entries, sorted(store.keys("alice")), store.check()


@pytest.mark.parametrize("case", ["blend", "prompt", "segments"])
def test_a_request_refused_over_quota_keeps_nothing_it_stored(tiny_source, tiny_target, server_adapters_dir, case):
    # the quota lets the request store its first entries (source, projection; or the prefix entry) and refuses the
    # one after (the correction; the prompt's head; the first segment)
    quota = {"blend": 2, "prompt": 2, "segments": 1}[case]
    running = served.start_on_cpu(tiny_source, [tiny_target], server_adapters_dir, tenant_max_entries=quota)
    try:
        if case == "segments":
            running.service.detector = SuffixDetector(DetectorConfig(threshold=2.8, min_segment=10))
        text = served.text(3)
        with KVBridgeClient(running.address, token=served.ALICE, timeout_s=120) as client:
            calls = {"blend": lambda: client.fetch_projected(text=text, mode="blend:0.1"),
                     "prompt": lambda: client.fetch_projected(
                         text=text, prompt=tiny_target.tokenizer("Q: " + text)["input_ids"]),
                     "segments": lambda: client.ingest(" ".join(served.text(i) for i in range(10, 14)),
                                                       detect_segments=True)}
            before = _held(running)
            with pytest.raises(KVBridgeError) as info:
                calls[case]()
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, info.value.details
            assert _held(running) == before == (0, [], [])
            if case != "segments":  # with room, the same request is served
                store = running.service.store
                store.config = dataclasses.replace(store.config, tenant_max_entries=None)
                assert calls[case]().segment.num_tokens > 0
    finally:
        running.stop(0)


@pytest.mark.parametrize("method", ["fetch_projected", "fetch_source"])
def test_a_reply_refused_for_the_clients_message_limit_keeps_nothing_the_fetch_stored(server, method):
    text = " ".join(served.text(i) for i in range(40, 52)) + " " + method  # a header of ids and positions > 5 KB
    before = _held(server)
    with KVBridgeClient(server.address, token=served.ALICE, timeout_s=120, max_message_mb=5000 / (1 << 20)) as small:
        with pytest.raises(KVBridgeError) as info:
            getattr(small, method)(text=text)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "header" in info.value.details
    assert _held(server) == before


def test_a_put_whose_block_write_fails_stores_nothing(monkeypatch):
    ident = ModelIdentity("m", "0" * 64)

    def segment(seed, t):
        g = torch.Generator().manual_seed(seed)
        return KVSegment(kv=torch.randn(2, 2, 2, t, 8, generator=g), positions=torch.arange(t), model=ident,
                         token_ids=torch.randint(0, 1000, (t,), generator=g), rotated=True)

    block = 2 * 2 * 2 * 16 * 8 * 4
    store = PagedStore(StoreConfig(capacity_bytes=8 * block, device="cpu", slab_bytes=8 * block))
    shared = store.put(segment(1, 32), "alice")  # its blocks are shared by nothing: the failed put's first 2 are not

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("out of memory (injected)")

    with monkeypatch.context() as patched:
        patched.setattr(pool_data.PoolData, "write_segment", out_of_memory)
        with pytest.raises(torch.cuda.OutOfMemoryError):
            store.put(segment(2, 64), "alice")
    assert store.check() == [] and store.keys("alice") == [shared.key]
    assert store.put(segment(5, 96), "alice").num_tokens == 96  # the whole rest of the store is there to be had
    assert store.check() == []


def test_an_upload_the_client_cancels_after_its_last_chunk_stores_nothing(server):
    with KVBridgeClient(server.address, token=served.ALICE, timeout_s=60) as client:
        key = client.ingest(served.text(0, 60) + " cancelled").entries[0].key
        seg = client.fetch_source(key=key).segment
        client.delete(key)
    before = _held(server)
    kv = seg.kv
    header = pb2.KVHeader(model=pb2.ModelRef(name=seg.model.name), dtype=dtype_name(kv.dtype), num_layers=kv.shape[0],
                          num_kv_heads=kv.shape[2], head_dim=kv.shape[4], token_ids=seg.token_ids.tolist(),
                          positions=list(range(seg.num_tokens)), rotated=True, kind="prefix")
    sent, hold = threading.Event(), threading.Event()

    def messages():
        yield pb2.PutSourceKVRequest(header=header)
        for r, blob in iter_chunks(kv, 4096):
            yield pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                           token_start=r.token_start, token_end=r.token_end,
                                                           data=blob))
        sent.set()
        hold.wait()  # never half-closed: the client cancels instead

    cancelled = served.server_count(server, "PutSourceKV", "CANCELLED")
    with grpc.insecure_channel(server.address) as channel:
        call = pb2_grpc.KVBridgeStub(channel).PutSourceKV.future(
            messages(), metadata=(("authorization", f"Bearer {served.ALICE}"),), timeout=30)
        sent.wait(10)
        time.sleep(0.5)  # the server has read every chunk
        call.cancel()
        hold.set()
        served.wait_for(lambda: served.server_count(server, "PutSourceKV", "CANCELLED") > cancelled,
                        "the server's end of the cancelled upload")
    assert _held(server) == before


def test_a_same_host_fetch_the_client_leaves_while_the_server_works_leaves_no_segment(server, monkeypatch):
    if server.segments is None:
        pytest.skip("no shared-memory segments on this machine")
    entered, release = threading.Event(), threading.Event()
    projected_cache = server.service.projected_cache

    def slow(*args, **kwargs):
        entered.set()
        release.wait(30)
        return projected_cache(*args, **kwargs)

    monkeypatch.setattr(server.service, "projected_cache", slow)
    cancelled = served.server_count(server, "GetProjectedCache", "CANCELLED")
    live = len(server.segments)
    with grpc.insecure_channel(server.address) as channel:
        call = pb2_grpc.KVBridgeStub(channel).GetProjectedCache(
            pb2.GetProjectedCacheRequest(text=served.text(7, 80), transport=pb2.SHARED_MEMORY),
            metadata=(("authorization", f"Bearer {served.ALICE}"),), timeout=60)
        assert entered.wait(30)
        call.cancel()
        release.set()
        served.wait_for(lambda: served.server_count(server, "GetProjectedCache", "CANCELLED") > cancelled,
                        "the cancelled fetch counted CANCELLED")
    assert len(server.segments) == live


def test_an_offset_past_a_longrope_targets_switch_is_refused_before_projecting(tiny_source, tmp_path, monkeypatch):
    from kvbridge.server import projecting
    from kvbridge.server.adapter_registry import AdapterRegistry
    from kvbridge.server.service import KVBridgeService
    from kvbridge.transfer.models import random_model
    from kvbridge.transfer.tiny_pair import build_tiny_tokenizer
    from test_adapters import random_adapter
    from transformers import Phi3Config

    tok = build_tiny_tokenizer("sentencepiece")
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.05 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)], "original_max_position_embeddings": 256}
    config = Phi3Config(vocab_size=len(tok), hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=4096,
                        original_max_position_embeddings=256, rope_parameters=rope, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id, tie_word_embeddings=False)
    target = random_model(config, "tiny-phi3-longrope", seed=1, tokenizer=tok, device="cpu")
    store = PagedStore(StoreConfig(capacity_bytes=64 << 20, device="cpu"))
    registry = AdapterRegistry(tmp_path, tiny_source.spec, [target.spec])
    registry.add("random", random_adapter(tiny_source, target), make_default=True)
    service = KVBridgeService(tiny_source, [target], store, registry)
    key = service.ingest("t", text=served.text(2, 30)).entries[0][0].key
    projected = []
    real = projecting.project
    monkeypatch.setattr(projecting, "project", lambda *a, **k: projected.append(1) or real(*a, **k))
    for mode in ("replace", "blend:0.1"):
        with pytest.raises(ValueError, match="longrope RoPE rotates every key.*switch past 256"):
            service.projected_cache("t", key=key, target_model=target.name, offset=250, mode=mode)
    assert projected == [] and store.keys("t") == [key]
