"""The service end to end, transfer: a real gRPC server on a loopback port (port 0), real clients, the tiny pair
(tiny-qwen2 -> tiny-phi3) with a fitted adapter, and an identity server (tiny-phi3 -> itself) for exactness:
ingest, projected and source fetches by stream and through shared memory, bf16 on the wire, generation from a
fetched cache, segments. What the server refuses: tests/test_server_requests.py; health, metrics, deadlines,
shutdown and TLS: tests/test_server_plumbing.py. The servers are the session fixtures of tests/conftest.py.
"""

from __future__ import annotations

import dataclasses
import threading

import pytest
import served
import torch
from kvbridge.server.client import KVBridgeClient
from kvbridge.transfer import kvcache
from served import ALICE, TEXT

pytestmark = pytest.mark.integration


def _prompt(lm, text=" In short,"):
    return torch.tensor(lm.tokenizer(text, add_special_tokens=False)["input_ids"])


# ------------------------------------------------------------------------------------------------ transfer


def test_ingest_then_projected_fetch_then_target_generate(server, alice, tiny_source, tiny_target, adapter):
    from kvbridge.adapters.adapter import project
    from kvbridge.adapters.pairs import pair_text

    reply = alice.ingest(TEXT, session_id="s1")
    (entry,) = reply.entries
    paired = pair_text(TEXT, tiny_source.tokenizer, tiny_target.tokenizer)
    assert torch.equal(reply.source_token_ids, paired.source_ids) and entry.num_tokens == paired.source_ids.numel()
    assert entry.kind == "prefix" and entry.tier == "device" and entry.model == tiny_source.name

    fetched = alice.fetch_projected(key=entry.key)
    source_kv = kvcache.extract(tiny_source.model, tiny_source.spec, paired.source_ids)
    expected = project(adapter, source_kv, paired.alignment, paired.target_ids, tiny_source.rope, tiny_target.rope)
    assert fetched.segment.model == tiny_target.spec.identity
    assert torch.equal(fetched.segment.token_ids, paired.target_ids)
    assert torch.equal(fetched.segment.positions, torch.arange(paired.target_ids.numel()))
    assert torch.equal(fetched.segment.kv, expected.kv)  # the wire and the store change no bit
    assert fetched.dtype == tiny_target.spec.dtype == "float32"  # the target's dtype unless asked otherwise
    assert fetched.adapter == "tiny-pair@1" and fetched.source_key == entry.key and fetched.text == TEXT
    assert fetched.adapter_digest == adapter.digest  # what a fitted induction prior is checked against
    assert fetched.num_chunks > 1  # 64 KB chunks: never one giant message
    assert 0 < fetched.wire_bytes - expected.kv.numel() * 4 <= 128 * fetched.num_chunks  # + safetensors headers

    cache, target_ids = alice.projected_cache(tiny_target, key=entry.key)
    prompt = _prompt(tiny_target)
    ids = torch.cat((target_ids, prompt))[None]
    out = tiny_target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                                     max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert out.numel() == 8
    assert torch.equal(out, kvcache.generate(tiny_target.model, tiny_target.spec, expected, prompt, max_new_tokens=8))

    entries = server.service.store.stats().entries
    again = alice.fetch_projected(text=TEXT)  # by text: the same source entry, the cached projection
    assert again.entry_key == fetched.entry_key and torch.equal(again.segment.kv, fetched.segment.kv)
    assert server.service.store.stats().entries == entries


def test_identity_transfer_gives_the_targets_own_tokens(identity_server, tiny_target):
    with KVBridgeClient(identity_server.address) as client:  # an open server: no token
        text = served.text(1)
        client.ingest(text)
        fetched = client.fetch_projected(text=text, require_cached=True)
        own = kvcache.extract(tiny_target.model, tiny_target.spec, fetched.segment.token_ids)
        torch.testing.assert_close(fetched.segment.kv, own.kv, atol=2e-5, rtol=1e-5)
        prompt = _prompt(tiny_target)
        got = kvcache.generate(tiny_target.model, tiny_target.spec, fetched.segment, prompt, max_new_tokens=16)
        ref = kvcache.generate_plain(tiny_target.model, tiny_target.spec,
                                     torch.cat((fetched.segment.token_ids, prompt)), max_new_tokens=16)
        assert torch.equal(got, ref)
        # placed after 7 tokens of the target's own: keys rotated for positions 7.., still its own KV there
        shifted = client.fetch_projected(text=text, offset=7)
        assert torch.equal(shifted.segment.positions, torch.arange(7, 7 + own.num_tokens))
        own_at_7 = kvcache.extract(tiny_target.model, tiny_target.spec, own.token_ids, start_position=7)
        # the model's own prefill at 7.. differs from shifted keys by float rounding only (its selfcheck: ~4e-6)
        assert (shifted.segment.kv - own_at_7.kv).norm() / own_at_7.kv.norm() < 1e-5


def test_projection_on_the_server_and_on_the_client_agree(alice, tiny_source, tiny_target, adapter):
    text = served.text(2)
    on_server = alice.fetch_projected(text=text)
    local = alice.fetch_projected_locally(tiny_source, tiny_target, adapter, text=text)
    assert torch.equal(local.segment.kv, on_server.segment.kv)
    assert torch.equal(local.segment.token_ids, on_server.segment.token_ids)
    assert local.source_key == on_server.source_key
    assert local.wire_bytes < on_server.wire_bytes  # the source KV is the smaller one here (as in production)
    shifted = alice.fetch_projected(text=text, offset=5)
    local5 = alice.fetch_projected_locally(tiny_source, tiny_target, adapter, text=text, offset=5)
    torch.testing.assert_close(shifted.segment.kv, local5.segment.kv, atol=5e-5, rtol=1e-5)
    assert torch.equal(shifted.segment.positions, local5.segment.positions)


def test_bfloat16_on_the_wire(alice):
    text = served.text(3)
    full = alice.fetch_projected(text=text)
    half = alice.fetch_projected(text=text, dtype="bfloat16")
    assert half.segment.dtype == torch.bfloat16 and abs(half.wire_bytes * 2 / full.wire_bytes - 1) < 0.01
    assert torch.equal(half.segment.kv, full.segment.kv.to(torch.bfloat16))


def test_a_bfloat16_target_gets_bfloat16_on_the_wire_by_default(tmp_path):
    """The wire dtype defaults to the target's own (issue 16, part 4): a target run in bf16 streams half the bytes,
    and a same-host fetch maps the same bf16 KV."""
    from kvbridge.adapters.identity import identity_adapter
    from kvbridge.transfer.tiny_pair import tiny_target

    target = tiny_target(device="cpu", dtype="bfloat16")
    # no self-check: its RoPE checks are float32-tight
    running = served.start(target, [target], tmp_path, tokens=None, selfcheck=False)
    running.service.adapters.add("identity", identity_adapter(target), make_default=True)
    try:
        with KVBridgeClient(running.address) as client:
            text = served.text(2)
            default = client.fetch_projected(text=text)
            wide = client.fetch_projected(text=text, dtype="float32")
            shared = client.fetch_projected(text=text, transport="shared_memory")
        assert default.dtype == "bfloat16" and abs(default.wire_bytes * 2 / wide.wire_bytes - 1) < 0.01
        assert shared.transport == "shared_memory" and shared.dtype == "bfloat16"
        assert torch.equal(shared.segment.kv, default.segment.kv)
    finally:
        running.stop(1)


@pytest.mark.parametrize("transport", ["stream", "shared_memory"])
def test_a_fetched_cache_writes_the_next_tokens_after_the_fetched_kv_without_a_copy(server, alice, tiny_target,
                                                                                    transport):
    """The first cache made of a fetch takes the prompt's tokens into the slots the fetch left after each row (a
    same-host segment's file mapped copy-on-write, or the stream's buffer): the layers still begin at the fetched
    KV, which is unchanged, and the logits are those of a cache of a plain copy. A second cache of the same fetch
    copies at its first forward."""
    key = alice.ingest(served.text(7)).entries[0].key
    fetched = alice.fetch_projected(key=key, transport=transport)
    assert fetched.transport == transport
    kept = fetched.segment.kv.clone()
    t, prompt = fetched.segment.num_tokens, _prompt(tiny_target)
    positions = torch.arange(t, t + prompt.numel())[None]

    def forward(cache):
        return tiny_target.model(input_ids=prompt[None], position_ids=positions, cache=cache, use_cache=True).logits

    with torch.no_grad():
        cache = fetched.to_cache(tiny_target)
        logits = forward(cache)
        plain = forward(kvcache.to_cache(dataclasses.replace(fetched.segment, kv=kept.clone()), tiny_target.model,
                                         tiny_target.spec))
        for i, layer in enumerate(cache.layers):
            assert layer.keys.data_ptr() == fetched.segment.kv[i, 0].data_ptr()  # in place, after the fetched KV
            assert layer.values.data_ptr() == fetched.segment.kv[i, 1].data_ptr()
            assert layer.get_seq_length() == t + prompt.numel()
        assert torch.equal(fetched.segment.kv, kept) and torch.equal(logits, plain)
        again = fetched.to_cache(tiny_target)
        assert torch.equal(forward(again), plain)
        assert again.layers[0].keys.data_ptr() != fetched.segment.kv[0, 0].data_ptr()


def test_a_same_host_fetch_returns_before_its_release_is_answered_and_close_waits_for_it(server, alice,
                                                                                         monkeypatch):
    """The file is mapped before ReleaseSegment goes out, so the fetch does not wait for its answer (a release held
    in the server stays pending after the fetch returns); the client's close() waits, and the file is gone."""
    segments, gate, arrived, released = server.segments, threading.Event(), [], threading.Event()
    real = segments.release

    def held_release(tenant, name):
        arrived.append(name)
        gate.wait(10)
        try:
            return real(tenant, name)
        finally:
            released.set()

    monkeypatch.setattr(segments, "release", held_release)
    key = alice.ingest(served.text(8)).entries[0].key
    expected = alice.fetch_projected(key=key, transport="stream").segment.kv
    with KVBridgeClient(server.address, token=ALICE) as client:
        fetched = client.fetch_projected(key=key, transport="shared_memory")
        assert fetched.transport == "shared_memory" and torch.equal(fetched.segment.kv, expected)
        assert not released.is_set()  # the fetch did not wait for its release
        served.wait_for(lambda: bool(arrived), "the release to reach the server", timeout_s=10)
        path = segments.folder / f"{arrived[0]}.safetensors"
        assert path.exists()
        gate.set()
    assert released.is_set() and not path.exists()  # close() waited for the release
    assert torch.equal(fetched.segment.kv, expected)  # the map outlives the file


def test_the_generator_takes_projected_context_through_the_service(identity_server, tiny_target):
    from kvbridge.server.projected_context import ProjectedContext
    from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator

    doc = served.text(9)
    with KVBridgeClient(identity_server.address) as client:
        source = ProjectedContext(client, tiny_target)
        gen = SuffixReuseGenerator(tiny_target, context_source=source)
        out, metrics = gen.generate("s", [Part(doc, "document", projected=True), Part(" In short,")],
                                    max_new_tokens=12)
    ids = torch.cat((torch.tensor([gen.start_token]), gen.tokens(doc), gen.tokens(" In short,")))
    # identity adapter: the projected document is the target's own KV, so the tokens are those of its own prefill
    assert torch.equal(out, kvcache.generate_plain(tiny_target.model, tiny_target.spec, ids, max_new_tokens=12))
    assert metrics.parts == ["projected", "prefilled"] and metrics.tokens_projected == gen.tokens(doc).numel()
    assert source.calls == 1 and source.first is source.last and source.last.first_position == 0
    assert not any(isinstance(v, list) for v in vars(source).values())  # nothing that grows with a session


@pytest.mark.parametrize("fraction", [0.0, 0.2])
def test_the_generator_reads_a_served_corrections_recomputed_kv_as_the_targets_own(identity_server, tiny_target,
                                                                                   fraction):
    """ProjectedContext(mode=...) asks the server for a served correction; the generator marked every fetched position
    as projected, so its prior read the target's own recomputed KV as projected (FetchedCache.still_projected, which
    the evaluation reads, leaves them out). Now it reads them as the server says, blending its own share on top."""
    from kvbridge.server.projected_context import ProjectedContext
    from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator
    from kvbridge.transfer.suffix.induction import InductionPrior

    class Recording(InductionPrior):  # the masks the generator reads the cache with
        masks: list = []

        def reading(self, lm, ids, still):
            self.masks.append(still.clone())
            return super().reading(lm, ids, still)

        def from_layer(self, m):
            return self if m == 0 else super().from_layer(m)

    prior = Recording(torch.zeros(4, tiny_target.spec.num_layers, tiny_target.model.config.num_attention_heads))
    doc = served.text(9)
    with KVBridgeClient(identity_server.address) as client:
        served_still = client.fetch_projected(text=doc, mode="recompute:0.5").still_projected()
        assert 0 < int(served_still.sum()) < served_still.numel() - 1  # some document positions recomputed
        source = ProjectedContext(client, tiny_target, mode="recompute:0.5")
        gen = SuffixReuseGenerator(tiny_target, context_source=source, induction_prior=prior,
                                   recompute_fraction=fraction)
        gen.generate("s", [Part(doc, "document", projected=True), Part(" In short,")], max_new_tokens=2)
    read = prior.masks[-1][:served_still.numel()]  # the generation's mask over the start token and the document
    if fraction:  # the generator's blend recomputes more of them: a subset of what the server left projected
        assert bool((read <= served_still).all()) and int(read.sum()) < int(served_still.sum())
    else:
        assert torch.equal(read, served_still)


def test_the_generator_says_when_its_prior_was_fitted_for_another_adapter(identity_server, tiny_target, caplog):
    from kvbridge.server.projected_context import ProjectedContext
    from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator
    from kvbridge.transfer.suffix.induction import InductionPrior

    terms = torch.zeros(4, tiny_target.spec.num_layers, tiny_target.model.config.num_attention_heads)
    prior = InductionPrior(terms, origin="fitted.safetensors", adapter={"name": "other", "digest": "0" * 64})
    with KVBridgeClient(identity_server.address) as client, caplog.at_level("WARNING"):
        source = ProjectedContext(client, tiny_target)
        gen = SuffixReuseGenerator(tiny_target, context_source=source, induction_prior=prior)
        for doc in (served.text(9), served.text(10)):
            gen.generate("s", [Part(doc, "document", projected=True), Part(" In short,")], max_new_tokens=2)
    assert len(source.adapter_digest) == 64  # the server's adapter, as the fetch's header says
    said = [r.getMessage() for r in caplog.records if "fitted for adapter other" in r.getMessage()]
    assert len(said) == 1 and source.adapter_digest[:16] in said[0]  # once per adapter


def _ingest_cut(server, alice, text: str):
    """alice's Ingest of text with DETECT_SEGMENTS, the server's detector set to one that cuts the tiny pair's text
    (the random model's own finds no segments)."""
    from kvbridge.transfer.suffix.detector import DetectorConfig, SuffixDetector

    previous = server.service.detector
    server.service.detector = SuffixDetector(DetectorConfig(threshold=2.8, min_segment=10))
    try:
        return alice.ingest(text, detect_segments=True)
    finally:
        server.service.detector = previous


def test_ingest_with_segment_detection_over_the_wire(server, alice):
    reply = _ingest_cut(server, alice, " ".join(served.text(i) for i in range(10, 14)))
    prefix, *segments = reply.entries
    assert prefix.kind == "prefix" and prefix.num_tokens == reply.source_token_ids.numel()
    assert segments and all(e.kind == "segment" and e.start > 0 for e in segments[1:])
    starts = [e.start for e in segments]
    assert starts == sorted(starts) and starts[-1] + segments[-1].num_tokens <= prefix.num_tokens
    back = alice.fetch_source(key=segments[-1].key)
    assert int(back.segment.positions[0]) == segments[-1].start and back.text
    assert alice.fetch_source(text=back.text, require_cached=True).entry_key == segments[-1].key


def test_a_segment_entry_projected_on_the_client_is_the_servers_projection(server, alice, tiny_source, tiny_target,
                                                                           adapter):
    """fetch_projected_locally paired a segment entry (a piece of a text) as a whole text, with special tokens and
    the target's start token: another projection than the server's, silently (or, for a source with a start token,
    refused as 'not the source tokenization'). The source fetch now says the entry's kind."""
    reply = _ingest_cut(server, alice, " ".join(served.text(i) for i in range(30, 34)))
    segments = [e for e in reply.entries if e.kind == "segment"]
    assert segments, "the planted detector config should cut this text"
    assert alice.fetch_source(key=segments[-1].key).entry_kind == "segment"
    assert alice.fetch_source(key=reply.entries[0].key).entry_kind == "prefix"
    for entry in segments:
        on_server = alice.fetch_projected(key=entry.key, mode="replace")
        local = alice.fetch_projected_locally(tiny_source, tiny_target, adapter, key=entry.key)
        assert torch.equal(local.segment.token_ids, on_server.segment.token_ids)
        assert torch.equal(local.segment.positions, on_server.segment.positions)
        assert torch.equal(local.segment.kv, on_server.segment.kv)


def test_projected_context_of_a_text_known_only_as_a_detected_segment(server, alice, tiny_target):
    """A text the server holds only as a segment of a longer ingest projects without the start token: the context
    source fetches it at its own position and keeps every one of its tokens (not the first dropped as a start
    token, the rest one place early)."""
    from kvbridge.server.projected_context import ProjectedContext
    from kvbridge.transfer.align import tokenize
    reply = _ingest_cut(server, alice, " ".join(served.text(i) for i in range(20, 24)))
    segments = [e for e in reply.entries if e.kind == "segment" and e.start > 0]
    assert segments, "the planted detector config should cut this text"
    piece = alice.fetch_source(key=max(segments, key=lambda e: e.num_tokens).key).text
    ids = tokenize(tiny_target.tokenizer, piece, add_special_tokens=False).ids
    source = ProjectedContext(alice, tiny_target)
    older = ProjectedContext(alice, tiny_target)  # replies as a server before `document_position` sends them
    fetch = older._fetch
    older._fetch = lambda *args: dataclasses.replace(fetch(*args), document_position=None)
    for context in (source, older):
        for offset in (1, 5):
            seg = context.projected_segment(piece, offset)
            assert torch.equal(seg.token_ids, ids)
            assert torch.equal(seg.positions, torch.arange(offset, offset + ids.numel()))
    assert source.calls == older.calls == 4  # each: the fetch after the start token, then the one at its position
    doc = source.projected_segment(" ".join(served.text(i) for i in range(20, 24)), 3)  # the whole text: a prefix
    assert doc.num_tokens == tokenize(tiny_target.tokenizer, " ".join(served.text(i) for i in range(20, 24)),
                                      add_special_tokens=False).ids.numel() and source.calls == 5
