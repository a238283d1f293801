"""KVBridgeService and the adapter registry as a library, without gRPC (the servicer only converts messages)."""

from __future__ import annotations

import os

import pytest
import torch
from kvbridge.server.adapter_registry import AdapterRegistry, check_name
from kvbridge.server.errors import FailedPrecondition
from kvbridge.server.service import KVBridgeService, ServiceLimits
from kvbridge.transfer.store import NotFound, PagedStore, StoreConfig

TEXT = "Readers skip the fields they do not understand, and writers keep the order of the fields they were given."


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _service(tiny_source, tiny_target, folder, adapter=None, clock=None, **limits):
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"), clock=clock or Clock())
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    if adapter is not None:
        registry.add("fitted", adapter, make_default=True)
    return KVBridgeService(tiny_source, [tiny_target], store, registry, ServiceLimits(**limits))


def test_adapter_names_never_become_paths(tmp_path, tiny_source, tiny_target):
    for bad in ("", "../a", "a/b", "a\\b", ".hidden", "a..b", "/etc/passwd", "x" * 200, "a b", "é"):
        with pytest.raises(ValueError, match="adapter name"):
            check_name(bad)
    assert check_name("tiny-pair") == check_name("tiny-pair.safetensors") == "tiny-pair"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    folder = tmp_path / "adapters"
    folder.mkdir()
    os.symlink(outside, folder / "escape.safetensors")
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    with pytest.raises(ValueError, match="resolves outside the adapter folder"):
        registry.load("escape")
    with pytest.raises(FileNotFoundError, match="no adapter 'absent'"):
        registry.load("absent")


def test_registry_checks_pairs_lists_files_and_autoloads_the_newest(tmp_path, tiny_source, tiny_target, adapter):
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.adapters.io import save_adapter

    save_adapter(adapter, tmp_path / "old.safetensors")
    save_adapter(adapter, tmp_path / "new.safetensors")
    os.utime(tmp_path / "old.safetensors", (1, 1))
    save_adapter(identity_adapter(tiny_target), tmp_path / "other-pair.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not safetensors")
    save_adapter(adapter, tmp_path / "doubled.safetensors.safetensors")  # ignored: its name would strip twice
    os.utime(tmp_path / "doubled.safetensors.safetensors", (2e9, 2e9))  # the newest file
    registry = AdapterRegistry(tmp_path, tiny_source.spec, [tiny_target.spec])
    assert registry.autoload() == ["new"]
    listed = {a.name: a for a in registry.available()}
    assert set(listed) == {"old", "new", "other-pair"}  # junk is skipped
    assert listed["new"].is_default and listed["new"].loaded and not listed["old"].loaded
    with pytest.raises(ValueError, match="this server serves 'tiny-qwen2'"):
        registry.load("other-pair")
    assert registry.resolve("", tiny_source.spec, tiny_target.spec)[0] == "new@1"
    assert registry.resolve("old", tiny_source.spec, tiny_target.spec)[0] == "old@1"  # loaded on first use
    empty = AdapterRegistry(None, tiny_source.spec, [tiny_target.spec])
    with pytest.raises(FailedPrecondition, match="no adapter is loaded for 'tiny-qwen2' -> 'tiny-phi3'"):
        empty.resolve("", tiny_source.spec, tiny_target.spec)


def test_ingest_is_idempotent_and_refreshes_the_ttl(tmp_path, tiny_source, tiny_target):
    clock = Clock()
    service = _service(tiny_source, tiny_target, tmp_path, clock=clock)
    first = service.ingest("t", TEXT, ttl_s=10).entries[0][0]
    assert first.new_blocks > 0
    clock.now = 8
    again = service.ingest("t", TEXT, ttl_s=10).entries[0][0]
    assert again.key == first.key and again.new_blocks == 0 and again.expires_at == 18
    clock.now = 15
    assert service.lookup("t", TEXT)[0].key == first.key
    clock.now = 19
    assert service.lookup("t", TEXT)[0].key is None


def test_projection_by_key_without_the_text_and_delete_of_what_derives_from_it(tmp_path, tiny_source, tiny_target,
                                                                                adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter=adapter, text_memo_chars=10)  # remembers none
    key = service.ingest("t", TEXT).entries[0][0].key
    by_key = service.projected_cache("t", key=key)  # text recovered from the ids (they round-trip)
    by_text = service.projected_cache("t", text=TEXT)
    assert by_key.entry_key == by_text.entry_key and torch.equal(by_key.segment.kv, by_text.segment.kv)
    assert by_key.adapter == "fitted@1" and by_key.source_key == key
    assert len(service.store.keys("t")) == 2
    with pytest.raises(NotFound):
        service.projected_cache("other-tenant", key=key)
    assert service.delete("t", key) == 2  # the source entry and its projection
    assert service.store.keys("t") == [] and service.store.check() == []
    with pytest.raises(NotFound):
        service.delete("t", key)


class BufferOut:
    """A KVOut that offers one buffer of its own and records the layers reported written."""

    def __init__(self, accept: bool = True):
        self.accept, self.buffer, self.layers = accept, None, []

    def reuse(self, tag, shape, dtype):
        return None  # keeps nothing from an earlier fetch: every warm fetch is gathered into tensor()'s buffer

    def tensor(self, shape, dtype):
        if not self.accept:
            return None
        self.buffer = torch.full(shape, float("nan"), dtype=dtype)
        return self.buffer

    def written(self, start, end):
        assert torch.isfinite(self.buffer[start:end]).all()  # those layers are final when reported
        self.layers.append((start, end))


def test_a_warm_projected_fetch_is_gathered_straight_into_the_buffer_it_is_offered(tmp_path, tiny_source,
                                                                                   tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter=adapter)
    key = service.ingest("t", TEXT).entries[0][0].key
    cold_out = BufferOut()
    cold = service.projected_cache("t", key=key, out=cold_out)  # projected now: the buffer is not used
    assert cold_out.buffer is None
    warm_out = BufferOut()
    warm = service.projected_cache("t", key=key, out=warm_out)
    assert warm.segment.kv.data_ptr() == warm_out.buffer.data_ptr()  # the store's one copy, into the buffer
    assert torch.equal(warm.segment.kv, cold.segment.kv)
    assert warm_out.layers == [(i, i + 1) for i in range(tiny_target.spec.num_layers)]
    shifted = BufferOut()  # another offset: shifted by RoPE after the read, so no buffer is asked for
    assert service.projected_cache("t", key=key, offset=3, out=shifted).segment.num_tokens == cold.segment.num_tokens
    assert shifted.buffer is None
    declined = service.projected_cache("t", key=key, out=BufferOut(accept=False))
    assert torch.equal(declined.segment.kv, cold.segment.kv)


def test_failed_requests_leave_the_store_as_it_was(tmp_path, tiny_source, tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path)  # no adapter loaded
    key = service.ingest("t", TEXT).entries[0][0].key
    before = (service.store.keys("t"), service.store.stats().bytes_used)
    with pytest.raises(FailedPrecondition, match="no adapter is loaded"):
        service.projected_cache("t", key=key)
    with pytest.raises(ValueError, match="more than this server takes"):
        _service(tiny_source, tiny_target, tmp_path, max_text_chars=10).ingest("t", TEXT)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        service.projected_cache("t", key=key, offset=-3)
    assert (service.store.keys("t"), service.store.stats().bytes_used) == before


def test_ingest_detects_segments_that_targets_fetch_by_their_text(tmp_path, tiny_source, tiny_target, adapter):
    from kvbridge.adapters.adapter import project
    from kvbridge.transfer import kvcache
    from kvbridge.transfer.align import align_tokens, tokenize
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector, segment_starts

    text = " ".join(open(__import__("kvbridge.transfer.data", fromlist=["x"]).data_path("tiny_corpus.txt"))
                    .read().split()[:120])
    detector = SuffixDetector(DetectorConfig(threshold=2.8, min_segment=10))  # cuts this text in 5 (random model)
    service = _service(tiny_source, tiny_target, tmp_path, adapter=adapter)
    service.detector = detector
    result = service.ingest("t", text, detect_segments=True)
    prefix, *segments = result.entries
    assert prefix[0].kind == "prefix" and prefix[1] == 0
    starts = segment_starts(detector.profile(tiny_source.model, tiny_source.spec, result.source_ids), detector.config)
    assert len(starts) >= 3, "the planted config should cut this text"
    assert segments and all(info.kind == "segment" for info, _ in segments)
    full = kvcache.extract(tiny_source.model, tiny_source.spec, result.source_ids)
    for info, start in segments:
        assert start in starts or start - 1 in starts  # a span starts there (after a leading special token)
        piece = service.store.info(info.key, "t").text
        source = service.source_cache("t", text=piece, require_cached=True)  # found by its text alone
        assert source.entry_key == info.key and int(source.segment.positions[0]) == start
        assert torch.equal(source.segment.kv, full.kv[:, :, :, start:start + info.num_tokens])
        projected = service.projected_cache("t", text=piece, offset=3, require_cached=True)
        src = tokenize(tiny_source.tokenizer, piece, add_special_tokens=False)
        tgt = tokenize(tiny_target.tokenizer, piece, add_special_tokens=False)
        expected = project(adapter, source.segment, align_tokens(src, tgt), tgt.ids, tiny_source.rope,
                           tiny_target.rope, offset=3)
        assert torch.equal(projected.segment.token_ids, tgt.ids)
        torch.testing.assert_close(projected.segment.kv, expected.kv, atol=5e-5, rtol=1e-5)
    assert service.store.check() == []


def test_lookup_finds_a_segment_by_its_text_when_the_source_adds_a_start_token(tmp_path, tiny_target):
    """A segment entry holds its piece's tokens without the tokenizer's special tokens; Lookup by text tokenized
    the piece with them, so for a source that adds a start token (Gemma's <bos>; the tiny Qwen2 adds none) it
    never found a segment the fetch by the same text finds."""
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector

    lm = tiny_target  # its tokenizer adds "<s>": served as the source, and as the target through the identity map
    assert lm.tokenizer("x")["input_ids"][0] == lm.tokenizer.bos_token_id
    registry = AdapterRegistry(tmp_path, lm.spec, [lm.spec])
    registry.add("identity", identity_adapter(lm), make_default=True)
    service = KVBridgeService(lm, [lm], PagedStore(StoreConfig(capacity_bytes=64 << 20, device="cpu")), registry)
    service.detector = SuffixDetector(DetectorConfig(threshold=2.0, min_segment=10))
    text = " ".join(open(data_path("tiny_corpus.txt")).read().split()[:120])
    _, *segments = service.ingest("t", text, detect_segments=True).entries
    info = max((info for info, _ in segments), key=lambda i: i.num_tokens)  # the detector cuts this text
    piece = service.store.info(info.key, "t").text
    assert service.projected_cache("t", text=piece).source_key == info.key  # the fetch by text finds it
    found, query_tokens = service.lookup("t", text=piece, kind="segment")
    assert (found.key, query_tokens) == (info.key, info.num_tokens)
    assert service.lookup("t", text=piece)[0].key is None  # no prefix entry holds the piece with the start token


def test_an_uploads_refused_token_ids_are_named_as_the_header_field(tmp_path, tiny_source, tiny_target):
    """A PutSourceKV has no text: its refusals name header.token_ids (they said "the text" and "token_ids[i]")."""
    from kvbridge.server.service import SourceUpload

    service = _service(tiny_source, tiny_target, tmp_path)
    spec = tiny_source.spec
    too_many = service.models[spec.name].max_positions + 1

    def upload(ids):
        return SourceUpload(model=spec.name, config_hash="", dtype=torch.float32, num_layers=spec.num_layers,
                            num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, token_ids=torch.tensor(ids),
                            positions=None, rotated=True, kind="prefix")

    for ids, what in (([1] * too_many, f"header.token_ids holds {too_many} tokens, more than"),
                      ([1, spec.vocab_size], f"header.token_ids\\[1\\] = {spec.vocab_size} is outside")):
        with pytest.raises(ValueError, match=f"^{what}"):
            service.check_upload(upload(ids))


def test_an_upload_past_the_range_of_the_models_dtype_is_refused_and_stores_nothing(tmp_path, tiny_target):
    """An upload's chunks are checked for NaN and infinity in the dtype they came in; converted to the served model's
    (narrower) dtype a finite float32 value past bfloat16's range became infinity, and was stored."""
    from kvbridge.server.service import SourceUpload
    from kvbridge.transfer.tiny_pair import tiny_source

    source = tiny_source(device="cpu", dtype="bfloat16")
    service = _service(source, tiny_target, tmp_path)
    spec = source.spec
    kv = torch.randn(spec.num_layers, 2, spec.num_kv_heads, 20, spec.head_dim)
    kv[0, 0, 0, 0, 0] = 3.4e38  # finite in float32 (largest 3.4028e38), past bfloat16's largest (3.3895e38)
    upload = SourceUpload(model=spec.name, config_hash="", dtype=kv.dtype, num_layers=spec.num_layers,
                          num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, token_ids=torch.arange(3, 23),
                          positions=None, rotated=True, kind="prefix")
    with pytest.raises(ValueError, match="past the range of bfloat16, the dtype 'tiny-qwen2' is"):
        service.put_source("t", upload, kv)
    assert service.store.keys("t") == []
    kv[0, 0, 0, 0, 0] = 1.0
    assert service.put_source("t", upload, kv)[0].num_tokens == 20
