"""A failed call leaves the store as it was (server/undo.py): what a request stored before one of its later steps was
refused (a correction, a prompt's head or a segment over the tenant's quota; a reply whose header the client's
message limit cannot take; the store's own write of new blocks) is removed again, and an upload or a same-host fetch
the client left stores or holds nothing."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import time

import grpc
import pytest
import served
import torch
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.chunks import dtype_name, iter_chunks
from kvbridge.server.client import KVBridgeClient, KVBridgeError
from kvbridge.transfer.errors import CapacityError, NotFound
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


@pytest.mark.parametrize("trial", range(40))
def test_a_store_write_that_fails_leaves_the_store_as_it_was(monkeypatch, trial):
    """A device's out-of-memory error (say) while a put writes its new blocks, or while a read promotes an entry's
    blocks back from the CPU tier: the blocks are given back, the CPU tier's copies put back, and every entry reads
    back its own KV (random stores, with and without a CPU tier, shared prefixes, pins)."""
    from kvbridge.transfer.store import block_pool

    ident = ModelIdentity("m", "0" * 64)

    def segment(tokens):  # each token's KV a function of the tokens up to it (a prefix's KV is the same in all)
        kv = torch.zeros(2, 2, 2, len(tokens), 8)
        for i in range(len(tokens)):
            kv[..., i, :] = float(hash(tuple(tokens[:i + 1])) % 100003)
        return KVSegment(kv=kv, positions=torch.arange(len(tokens)), model=ident, token_ids=torch.tensor(tokens),
                         rotated=True)

    rnd = random.Random(trial)
    block = 2 * 2 * 2 * 16 * 8 * 4
    store = PagedStore(StoreConfig(capacity_bytes=6 * block, device="cpu", slab_bytes=2 * block,
                                   cpu_capacity_bytes=rnd.choice([0, 3 * block, 8 * block])))
    base = [rnd.randrange(1000) for _ in range(16 * 6)]
    kept = {}
    for _ in range(rnd.randrange(2, 7)):
        n = rnd.randrange(1, 6) * 16 + rnd.randrange(0, 16)
        tokens = base[:n] if rnd.random() < 0.6 else [rnd.randrange(1000) for _ in range(n)]
        with contextlib.suppress(CapacityError):
            kept[store.put(segment(tokens), "a", pin=rnd.random() < 0.15).key] = tokens
    before = sorted(store.keys("a"))
    where, calls, fail_at = rnd.choice(["write_segment", "set_hash", "write"]), [0], rnd.randrange(0, 3)
    real_set_hash = block_pool.BlockPool.set_hash

    def fault(*args):
        calls[0] += 1
        if calls[0] > fail_at or where != "set_hash":
            raise torch.cuda.OutOfMemoryError("out of memory (injected)")
        return real_set_hash(*args)

    with monkeypatch.context() as patched:
        patched.setattr(*((block_pool.BlockPool, "set_hash", fault) if where == "set_hash"
                          else (pool_data.PoolData, where, fault)))
        n = rnd.randrange(1, 6) * 16 + rnd.randrange(0, 16)
        tokens = base[:n] if rnd.random() < 0.7 else [rnd.randrange(1000) for _ in range(n)]
        with contextlib.suppress(torch.cuda.OutOfMemoryError, CapacityError):
            stored = store.put(segment(tokens), "a")
            kept[stored.key] = tokens
        for key in list(kept) if where == "write" else ():  # reads that promote demoted blocks
            with contextlib.suppress(torch.cuda.OutOfMemoryError, CapacityError, NotFound):
                store.get(key, "a")
    assert store.check() == []
    assert set(store.keys("a")) <= set(before) | set(kept)
    for key in store.keys("a"):
        with contextlib.suppress(CapacityError):  # a tight device: some entries cannot be read at once
            assert torch.equal(store.get(key, "a").kv, segment(kept[key]).kv)
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


@pytest.mark.parametrize("meanwhile", ["served", "stored again"])
def test_a_failed_calls_undo_leaves_what_another_call_was_served(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                                 adapter, meanwhile):
    """A corrected fetch by text stores the source entry and the projection, then its correction fails. Meanwhile
    another request (a thread of its own) was served those very entries, or, after a Delete, stored the same text's
    again under the same keys: the failed call's undo leaves them (it removed them, and the other request's client
    was handed keys of entries that were gone)."""
    from test_service_races import TEXT, _service

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    other = {}

    def another_request():
        if meanwhile == "stored again":
            service.delete("t", service._cached_source_key("t", TEXT))
        other["result"] = service.projected_cache("t", text=TEXT, mode="replace")

    def failing_correction(*args, **kwargs):
        runner = threading.Thread(target=another_request)
        runner.start()
        runner.join()
        raise RuntimeError("the correction failed")

    monkeypatch.setattr(service, "_computed_correction", failing_correction)
    with pytest.raises(RuntimeError, match="the correction failed"):
        service.projected_cache("t", text=TEXT, mode="blend:0.1")
    served = other["result"]
    assert sorted(service.store.keys("t")) == sorted([served.entry_key, served.source_key])
    again = service.projected_cache("t", key=served.source_key, mode="replace")
    assert again.entry_key == served.entry_key and torch.equal(again.segment.kv, served.segment.kv)
    assert service.store.check() == []
