"""A projected fetch for a target prompt that holds the document after other tokens (server/prompt_place.py,
`Projecting.prompt_cache`): the target's own KV of the prompt's head, exactly, then the projected document at its
positions in the prompt; a prompt that begins with the stored cache's tokens gets the cache as stored."""

from __future__ import annotations

import grpc
import pytest
import torch
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.prompt_place import locate
from kvbridge.server.service import KVBridgeService
from kvbridge.transfer import kvcache
from kvbridge.transfer.store import PagedStore, StoreConfig

TEXT = ("Readers skip the fields they do not understand, and writers keep the order of the fields they were given. "
        "A reader may stop at any field; a writer never reorders what it was handed.")


def test_locate_finds_the_document_after_a_head_and_skips_a_cut_first_token():
    cache = [0, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # start token 0, document 10..18
    assert locate([0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 99], cache).as_stored
    assert locate([0, 10, 11, 12, 13, 14, 15, 16, 17, 18, 99], cache, probe=3).as_stored
    where = locate([5, 6, 7, 10, 11, 12, 13, 14, 15, 16, 17, 18, 99], cache)
    assert (where.head, where.skip, where.as_stored) == (3, 0, False)
    where = locate([10, 11, 12, 13, 14, 15, 16, 17, 18], cache)  # a text prompt without the start token
    assert (where.head, where.skip, where.as_stored) == (0, 0, False)
    where = locate([5, 6, 77, 11, 12, 13, 14, 15, 16, 17, 18, 99], cache)  # the head's last token ate the first one
    assert (where.head, where.skip) == (3, 1)
    where = locate([1, 10, 11, 2, 10, 11, 12, 13, 14, 15, 16, 17, 3], cache)  # a partial run earlier is no match
    assert (where.head, where.skip) == (4, 0)
    assert locate([7, 10, 11, 12], [0, 10, 11, 12]).head == 1  # a document shorter than the probe: all of it
    with pytest.raises(ValueError, match="does not hold the document"):  # never placed by its last token alone
        locate([7, 8, 12, 9], [0, 10, 11, 12])
    with pytest.raises(ValueError, match="does not hold the document"):
        locate([1, 2, 3, 4, 5, 6, 7, 8, 9], cache)
    with pytest.raises(ValueError, match="no document tokens"):
        locate([1, 2], [0])


def test_locate_never_serves_document_tokens_the_prompt_does_not_hold():
    cache = [0] + list(range(10, 30))  # start token 0, document 10..29
    doc = cache[1:]
    for prompt, placed in (([0, *doc[:-2], 98, 99], (1, 0, 2, False)),  # goes on otherwise before the last two
                           ([5, 6, *doc[:-1], 99], (2, 0, 1, False)),
                           ([5, *doc, 99], (1, 0, 0, False)),
                           ([0, *doc[:12], 77, *doc[13:]], (1, 0, 8, False)),  # an edited text: served up to the edit
                           ([5, 6, *doc[:12]], (2, 0, 8, False)),  # a document cut short: what the prompt holds
                           ([*doc[:9]], (0, 0, 11, False))):
        where = locate(prompt, cache)
        assert (where.head, where.skip, where.cut, where.as_stored) == placed, prompt
        served = doc[where.skip:len(doc) - where.cut]
        assert prompt[where.head:where.head + len(served)] == served


def _service(tiny_source, tiny_target, folder, adapter) -> KVBridgeService:
    store = PagedStore(StoreConfig(capacity_bytes=32 << 20, device="cpu"))
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    return KVBridgeService(tiny_source, [tiny_target], store, registry)


@pytest.mark.parametrize("mode", ["replace", "blend:0.2"])
def test_a_prompt_with_a_head_gets_its_own_kv_then_the_document_at_its_positions(tmp_path, tiny_source, tiny_target,
                                                                                adapter, mode):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    stored = service.projected_cache("t", text=TEXT, mode=mode)
    ids = stored.segment.token_ids.tolist()  # start token, then the document
    head = [ids[0], 17, 23, 5, 42]  # a template's tokens before the document
    prompt = head + ids[1:] + [7, 8]
    served = service.prompt_cache("t", prompt, text=TEXT, mode=mode)
    seg = served.segment
    h = len(head)
    assert seg.token_ids.tolist() == prompt[:h] + ids[1:]
    assert torch.equal(seg.positions, torch.arange(seg.num_tokens))
    own = kvcache.extract(tiny_target.model, tiny_target.spec, torch.tensor(head))
    torch.testing.assert_close(seg.kv[:, :, :, :h], own.kv.to(seg.dtype), rtol=0, atol=0)  # exactly the target's
    # the document: the stored KV moved by RoPE, as an offset fetch moves it (that one keeps the start token)
    moved = service.projected_cache("t", text=TEXT, mode=mode, offset=h - 1).segment
    torch.testing.assert_close(seg.kv[:, :, :, h:].float(), moved.kv[:, :, :, 1:].float(), rtol=1e-5, atol=1e-5)
    assert served.mode == stored.mode and served.entry_key == stored.entry_key
    assert list(served.recomputed) == [p + h - 1 for p in stored.recomputed if p >= 1]
    assert (stored.document_index, served.document_index) == (1, h)  # after the start token; after the head


def test_a_prompt_as_stored_gets_the_stored_cache_and_one_without_start_token_begins_with_the_document(
        tmp_path, tiny_source, tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    stored = service.projected_cache("t", text=TEXT, mode="replace")
    ids = stored.segment.token_ids.tolist()
    same = service.prompt_cache("t", ids + [9, 9], text=TEXT, mode="replace")
    assert torch.equal(same.segment.kv, stored.segment.kv) and same.segment.token_ids.tolist() == ids
    assert same.document_index == 1  # the start token first
    bare = service.prompt_cache("t", ids[1:] + [9], key=stored.source_key, mode="replace")
    assert bare.segment.token_ids.tolist() == ids[1:] and bare.document_index == 0  # the document from position 0
    assert torch.equal(bare.segment.positions, torch.arange(len(ids) - 1))
    moved = tiny_target.rope.shift_all(stored.segment.keys.float()[:, :, 1:], stored.segment.positions[1:],
                                       torch.arange(len(ids) - 1))
    torch.testing.assert_close(bare.segment.keys.float(), moved, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bare.segment.values, stored.segment.values[:, :, 1:], rtol=0, atol=0)


@pytest.mark.integration  # a real server on a loopback port
def test_bad_prompts_are_invalid_argument_naming_the_prompt(tmp_path, tiny_source, tiny_target, adapter):
    from kvbridge.server.app import start_server
    from kvbridge.server.client import KVBridgeClient, KVBridgeError
    from kvbridge.server.config import ServeConfig

    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", selfcheck=False, adapters=str(tmp_path),
                         store_capacity_mb=32, store_device="cpu", shm_dir=None)
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    running = start_server(service, config)
    try:
        with KVBridgeClient(running.address, retries=0) as client:
            key = client.ingest(TEXT).entries[0].key
            ids = client.fetch_projected(key=key, mode="replace").segment.token_ids.tolist()
            keys_before = sorted(service.store.keys(""))
            vocab = tiny_target.spec.vocab_size
            for prompt, offset, words in (([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0, "does not hold the document"),
                                          ([vocab, *ids], 0, "vocabulary"), ([], 0, "no token ids"),
                                          ([5, *ids[1:]], 3, "offset or prompt")):
                with pytest.raises(KVBridgeError) as info:
                    client.fetch_projected(key=key, mode="replace", prompt=prompt, offset=offset)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details, prompt
            assert sorted(service.store.keys("")) == keys_before  # nothing stored, nothing removed
            head = [ids[0], 30, 31]
            fetched = client.fetch_projected(key=key, mode="replace", prompt=head + ids[1:] + [4])
            assert fetched.segment.token_ids.tolist() == head + ids[1:]
            # a prompt whose document's last token is another, or that is edited inside: the cache ends before the
            # first token the prompt does not share with it (every served token is the prompt's)
            for prompt, served, cut in ((ids[:-1] + [4, 5], len(ids) - 1, 1),
                                        (head + ids[1:-1] + [4], len(head) + len(ids) - 2, 1),
                                        (head + ids[1:12] + [4] + ids[13:], len(head) + 11, len(ids) - 12),
                                        (head + ids[1:] + [4], len(head) + len(ids) - 1, 0)):
                fetched = client.fetch_projected(key=key, mode="replace", prompt=prompt)
                assert fetched.segment.token_ids.tolist() == prompt[:served], prompt
                assert fetched.document_cut == cut  # the reply says so (what the vLLM connector remembers, Covered)
    finally:
        running.stop(grace_s=1)


def test_a_placed_cache_is_kept_and_a_heads_own_kv_is_computed_once(tmp_path, tiny_source, tiny_target, adapter):
    """A chat template and system prompt repeat across requests: the second prompt with the same head and document
    (another tail) is served from the kept placed cache (no target forward, no RoPE move, the same KV and facts); the
    same head before another document reuses the head's own KV; deleting the source entry deletes what was placed."""
    from test_corrections import Forwards

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    other_text = TEXT.replace("Readers", "Parsers").replace("writers", "encoders")
    for mode in ("replace", "blend:0.2"):
        ids = service.projected_cache("t", text=TEXT, mode=mode).segment.token_ids.tolist()
        head = [ids[0], 17, 23, 5, 42, 9]
        first = service.prompt_cache("t", head + ids[1:] + [7], text=TEXT, mode=mode)
        placed = service.token_counts[("placement", "reused")]
        forwards = Forwards(tiny_target)
        try:
            again = service.prompt_cache("t", head + ids[1:] + [8, 8], text=TEXT, mode=mode)
            assert forwards.count == 0
        finally:
            forwards.close()
        torch.testing.assert_close(again.segment.kv, first.segment.kv, rtol=0, atol=0)
        assert service.token_counts[("placement", "reused")] == placed + len(head) + len(ids) - 1
        assert again.segment.token_ids.tolist() == first.segment.token_ids.tolist()
        assert (again.entry_key, again.source_key, again.adapter, again.mode, again.recomputed,
                again.adapter_digest, again.document_index) == (first.entry_key, first.source_key, first.adapter,
                                                                 first.mode, first.recomputed, first.adapter_digest,
                                                                 len(head))
        assert first.adapter_digest == adapter.digest  # a reader checks its prior against it
    heads = service.token_counts[("prompt_head", "computed")]
    other = service.projected_cache("t", text=other_text, mode="replace").segment.token_ids.tolist()
    service.prompt_cache("t", head + other[1:], text=other_text, mode="replace")  # the same head, another document
    assert service.token_counts[("prompt_head", "computed")] == heads
    assert service.token_counts[("prompt_head", "reused")] >= len(head)
    service.prompt_cache("t", head[:-1] + ids[1:], text=TEXT, mode="replace")  # another head: computed
    assert service.token_counts[("prompt_head", "computed")] == heads + len(head) - 1
    kept = {k: service.store.info(k, "t").source_key for k in service.store.keys("t")
            if service.store.info(k, "t").adapter.startswith("placed|")}
    assert len(kept) == 4  # (head, TEXT) in two modes, (head, the other text), (head[:-1], TEXT)
    service.delete("t", first.source_key)
    left = set(service.store.keys("t"))
    assert {k for k in kept if k in left} == {k for k, source in kept.items() if source != first.source_key}
    assert len([k for k in kept if k in left]) == 1


def test_a_placed_correction_is_never_served_by_a_service_of_another_prior(tmp_path, tiny_source, tiny_target,
                                                                           adapter):
    """Replicas share placed caches through one store (Redis); one that corrects without the prior must not serve
    the placed correction another computed with it (as the stored corrections' namespace already says). A placed
    `replace` holds no correction: it is shared."""
    from kvbridge.server.corrections import CorrectionLimits, Corrections

    with_prior = _service(tiny_source, tiny_target, tmp_path / "a", adapter)
    registry = AdapterRegistry(tmp_path / "b", tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    without = KVBridgeService(tiny_source, [tiny_target], with_prior.store, registry,
                              corrections=Corrections(CorrectionLimits(prior=False)))
    ids = with_prior.projected_cache("t", text=TEXT, mode="replace").segment.token_ids.tolist()
    prompt = [ids[0], 17, 23, 5, 42] + ids[1:] + [7]
    for mode, shared in (("blend:0.2", False), ("replace", True)):
        with_prior.prompt_cache("t", prompt, text=TEXT, mode=mode)
        reused = without.token_counts[("placement", "reused")]
        without.prompt_cache("t", prompt, text=TEXT, mode=mode)
        assert (without.token_counts[("placement", "reused")] > reused) == shared, mode


def _segment_entry(tmp_path, tiny_source, tiny_target, adapter):
    """(service, the text of a segment entry an Ingest with DETECT_SEGMENTS stored, its target tokens)."""
    from kvbridge.transfer.align import tokenize
    from kvbridge.transfer.data import data_path
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector

    text = " ".join(open(data_path("tiny_corpus.txt")).read().split()[:120])
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    service.detector = SuffixDetector(DetectorConfig(threshold=2.8, min_segment=10))  # cuts this text (random model)
    _, *segments = service.ingest("t", text, detect_segments=True).entries
    info = max((info for info, _ in segments), key=lambda i: i.num_tokens)
    piece = service.store.info(info.key, "t").text
    return service, piece, tokenize(tiny_target.tokenizer, piece, add_special_tokens=False).ids.tolist()


def test_a_segment_entry_is_placed_after_the_prompts_start_token(tmp_path, tiny_source, tiny_target, adapter):
    """A segment of an Ingest with DETECT_SEGMENTS is stored and projected without a start token (its document
    tokens at positions 0..n-1); a prompt that begins with the start token and then that text gets the target's own
    KV of the start token and the document at positions 1.., not the stored projection one place early."""
    from kvbridge.transfer.align import start_token_id

    service, piece, doc = _segment_entry(tmp_path, tiny_source, tiny_target, adapter)
    stored = service.projected_cache("t", text=piece, require_cached=True).segment
    assert stored.token_ids.tolist() == doc  # no start token before a segment's tokens
    assert service.projected_cache("t", text=piece, require_cached=True).document_index == 0
    start = start_token_id(tiny_target.tokenizer)
    for head in ([start], [start, 17, 23, 5]):
        prompt = head + doc + [7]
        placed = service.prompt_cache("t", prompt, text=piece)
        seg = placed.segment
        assert placed.document_index == len(head)
        assert seg.token_ids.tolist() == prompt[:-1]
        assert torch.equal(seg.positions, torch.arange(len(prompt) - 1))
        own = kvcache.extract(tiny_target.model, tiny_target.spec, torch.tensor(head))
        torch.testing.assert_close(seg.kv[:, :, :, :len(head)], own.kv.to(seg.dtype), rtol=0, atol=0)
        moved = service.projected_cache("t", text=piece, offset=len(head), require_cached=True).segment
        torch.testing.assert_close(seg.kv[:, :, :, len(head):], moved.kv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["recompute:0.2", "blend:0.2"])
def test_a_segment_entrys_correction_is_computed_after_the_targets_start_token(tmp_path, tiny_source, tiny_target,
                                                                              adapter, mode):
    """A segment entry's projection holds its document tokens alone (at 0..n-1); a prompt places it after the start
    token. Its served correction is the one of the start token's own KV and the projection moved to 1..n (as a
    stored document's is): every recomputed position a document token, as many as the correction takes of n, and
    placed after the start token it is that correction's KV exactly where a prompt has it."""
    from kvbridge.transfer.align import start_token_id
    from kvbridge.transfer.segment import KVSegment
    from kvbridge.transfer.suffix.correction import Correction, correct
    from kvbridge.transfer.suffix.induction import InductionPrior

    service, piece, doc = _segment_entry(tmp_path, tiny_source, tiny_target, adapter)
    plain = service.projected_cache("t", text=piece, require_cached=True)  # replace: the document at 0..n-1
    served = service.projected_cache("t", text=piece, mode=mode, require_cached=True)
    n = len(doc)
    assert served.segment.token_ids.tolist() == doc and torch.equal(served.segment.positions, torch.arange(n))
    assert served.document_index == 0
    assert len(served.recomputed) == Correction.parse(mode).tokens(n)  # of the n document tokens, no start token
    start = start_token_id(tiny_target.tokenizer)
    own = kvcache.extract(tiny_target.model, tiny_target.spec, torch.tensor([start]))
    moved = plain.segment.with_keys(tiny_target.rope.shift_all(plain.segment.keys.float(), plain.segment.positions,
                                                               torch.arange(1, n + 1)).to(plain.segment.dtype),
                                    torch.arange(1, n + 1), rotated=True)
    want = correct(tiny_target, KVSegment.concat([own.to(dtype=moved.dtype), moved]), Correction.parse(mode),
                   prior=InductionPrior.for_model(tiny_target))
    assert list(served.recomputed) == (~want.still_projected[1:]).nonzero()[:, 0].tolist()  # the start token's not
    placed = service.prompt_cache("t", [start] + doc + [7], text=piece, mode=mode)
    assert placed.document_index == 1 and list(placed.recomputed) == [p + 1 for p in served.recomputed]
    torch.testing.assert_close(placed.segment.kv.float(), want.segment.kv.float(), rtol=1e-5, atol=1e-5)
    namespaces = {service.store.info(k, "t").adapter for k in service.store.keys("t")}
    placed_in = [ns for ns in namespaces if ns.startswith("placed|")]
    # as the correction's own namespace: a placement an older server made from its wrong correction is not adopted
    assert len(placed_in) == 1 and "/after-start#" in placed_in[0]


def _upload(service, tiny_source, text):
    """The source KV of `text` stored as PutSourceKV stores an upload: its ids and KV, no text."""
    from kvbridge.server.service import SourceUpload

    spec = tiny_source.spec
    ids = torch.tensor(tiny_source.tokenizer(text)["input_ids"])
    kv = kvcache.extract(tiny_source.model, spec, ids).kv
    upload = SourceUpload(model=spec.name, config_hash="", dtype=kv.dtype, num_layers=spec.num_layers,
                          num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, token_ids=ids, positions=None,
                          rotated=True, kind="prefix")
    return service.put_source("t", upload, kv)[0].key


@pytest.mark.parametrize("mode", ["replace", "recompute:0.2"])
def test_a_refused_prompt_computes_and_stores_nothing(tmp_path, tiny_source, tiny_target, adapter, mode):
    """A prompt that does not hold an uploaded document (PutSourceKV keeps no text) is refused before anything is
    projected or corrected (it was refused only after the projection, and its correction, were stored). (A prompt that
    held a text's document past the target's positions was refused so too; the cache now ends where the prompt stops
    holding the document, test_locate_never_serves_document_tokens_the_prompt_does_not_hold, so none does.)"""
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = _upload(service, tiny_source, TEXT)
    before = sorted(service.store.keys("t"))
    with pytest.raises(ValueError, match="does not hold the document"):
        service.prompt_cache("t", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], key=key, mode=mode)
    assert sorted(service.store.keys("t")) == before


def test_an_uploaded_documents_placement_is_kept_as_a_texts_is(tmp_path, tiny_source, tiny_target, adapter):
    """The server knows an uploaded entry's target tokens from its source ids (decoded as its projection pairs
    them), so the second prompt with the same head is served from the kept placed cache, as for a text."""
    from test_corrections import Forwards

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    key = _upload(service, tiny_source, TEXT)
    ids = service.projected_cache("t", key=key).segment.token_ids.tolist()
    head = [ids[0], 17, 23, 5]
    first = service.prompt_cache("t", head + ids[1:] + [7], key=key)
    forwards = Forwards(tiny_target)
    try:
        again = service.prompt_cache("t", head + ids[1:] + [8, 8], key=key)
        assert forwards.count == 0
    finally:
        forwards.close()
    assert service.token_counts[("placement", "reused")] == len(head) + len(ids) - 1
    torch.testing.assert_close(again.segment.kv, first.segment.kv, rtol=0, atol=0)
    assert again.document_index == first.document_index == len(head)


def test_a_tenant_never_reads_the_document_ids_another_tenant_kept(tmp_path, tiny_source, tiny_target, adapter,
                                                                   monkeypatch):
    """A refused prompt probe of a text is answered faster when its target ids are kept: kept per tenant, so that
    speed never tells one tenant which texts another asked about."""
    from kvbridge.server import prompt_place

    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    made = []
    real = prompt_place._target_ids
    monkeypatch.setattr(prompt_place, "_target_ids", lambda *a: made.append(1) or real(*a))
    ids = service.projected_cache("alice", text=TEXT, mode="replace").segment.token_ids.tolist()
    service.prompt_cache("alice", [5, *ids[1:], 9], text=TEXT, mode="replace")
    service.prompt_cache("alice", [6, *ids[1:], 9], text=TEXT, mode="replace")
    assert len(made) == 1  # kept for alice
    with pytest.raises(ValueError, match="does not hold the document"):
        service.prompt_cache("bob", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], text=TEXT, mode="replace")
    assert len(made) == 2  # bob's probe tokenized the text itself


def test_a_cut_placement_keeps_only_the_recomputed_positions_it_serves(tmp_path, tiny_source, tiny_target, adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    stored = service.projected_cache("t", text=TEXT, mode="blend:0.5")
    ids = stored.segment.token_ids.tolist()
    head, k = [ids[0], 17, 23], len(ids) // 2  # the prompt edits the document's token k (of the stored cache)
    placed = service.prompt_cache("t", head + ids[1:k] + [4] + ids[k + 1:], text=TEXT, mode="blend:0.5")
    assert placed.segment.num_tokens == len(head) + k - 1 and placed.document_cut == len(ids) - k
    assert list(placed.recomputed) == [p + len(head) - 1 for p in stored.recomputed if 1 <= p < k]
    assert any(p >= k for p in stored.recomputed)  # some were cut
