"""The production pair's path on a CPU: the `production-shaped` preset (random-init Qwen2 -> Phi3 with Qwen2-7B's and
Phi-3-mini-4k's attention shapes and RoPE, a scaled-down window) through every step of the system: self-checks,
fitting, ingest, projection and a fetch over gRPC, generation from the projected cache, recompute of the last r and
selective recompute (exact at r = 100%), and suffix reuse with a projected document — with a context longer than the
window."""

from __future__ import annotations

import pytest
import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.shaped_pair import SHAPED_WINDOW, production_shapes

TEXT_REPEATS = 3  # the packaged tiny corpus's first paragraphs, enough for > SHAPED_WINDOW target tokens


@pytest.fixture(scope="module")
def pair():
    from kvbridge.transfer.presets import load_pair

    return load_pair("production-shaped", device="cpu")


@pytest.fixture(scope="module")
def long_text(pair):
    from kvbridge.transfer.tiny_pair import tiny_corpus_text

    _, target = pair
    text = ""
    for paragraph in tiny_corpus_text().split("\n\n"):
        text += paragraph + "\n\n"
        if len(target.tokenizer(text, add_special_tokens=False)["input_ids"]) > SHAPED_WINDOW + 64:
            return text.strip()
    raise AssertionError("the tiny corpus is too short")


@pytest.fixture(scope="module")
def served(pair, tmp_path_factory):
    """A fitted adapter and a real server on a loopback port 0 over the shaped pair."""
    from kvbridge.adapters.train import TrainConfig, train_adapter
    from kvbridge.server.app import build_service, start_server
    from kvbridge.server.config import ServeConfig
    from kvbridge.transfer.data import data_path

    source, target = pair
    adapter, report = train_adapter(source, target, [data_path("tiny_corpus.txt")],
                                    TrainConfig(max_tokens=2048, window_tokens=256), progress=False)
    config = ServeConfig(preset="production-shaped", listen="127.0.0.1:0", selfcheck=False,
                         adapters=str(tmp_path_factory.mktemp("adapters")), store_capacity_mb=1024,
                         store_device="cpu")
    service = build_service(config, source=source, targets=[target])
    service.adapters.add("shaped", adapter, make_default=True)
    running = start_server(service, config)
    yield running, adapter
    running.stop(1)


def test_the_shapes_are_the_production_pairs(pair):
    source, target = pair
    shapes = production_shapes()
    s, t = shapes["source"]["config"], shapes["target"]["config"]
    for spec, c, expected in ((source.spec, s, (28, 4, 128)), (target.spec, t, (32, 32, 96))):
        heads = c["num_attention_heads"]
        assert (spec.num_attention_heads, spec.num_kv_heads, spec.head_dim) == (
            heads, c["num_key_value_heads"], c["hidden_size"] // heads) == expected
    assert {layer.rope.base for layer in source.spec.layers} == {s["rope_theta"]} == {1e6}
    assert {layer.rope.base for layer in target.spec.layers} == {t["rope_theta"]} == {1e4}
    assert {layer.rope.rope_type for layer in target.spec.layers} == {"default"}  # the 4k model has no scaling
    assert {layer.sliding_window for layer in target.spec.layers} == {SHAPED_WINDOW}  # 2047 in production
    # KV bytes per token in bf16, per layer, are the production pair's
    assert source.spec.kv_bytes_per_token // source.spec.num_layers // 2 == 57_344 // 28
    assert target.spec.kv_bytes_per_token // target.spec.num_layers // 2 == 393_216 // 32


def test_self_checks_pass_beyond_the_window(pair):
    from kvbridge.transfer.selfcheck import run_selfcheck

    for lm in pair:
        results = run_selfcheck(lm)
        assert all(r.passed for r in results), "\n".join(r.line() for r in results if not r.passed)
        inject = next(r for r in results if r.check == "inject")
        if lm.spec.layers[0].sliding_window:
            assert "> sliding window" in inject.detail, inject.detail


@pytest.mark.integration  # the `served` server
def test_ingest_fetch_over_grpc_generate_and_recompute(pair, served, long_text):
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.transfer.suffix.blend import BlendConfig, blend
    from kvbridge.transfer.suffix.reuse import prefill_after

    source, target = pair
    running, _ = served
    with KVBridgeClient(running.address, timeout_s=300) as client:
        entry = client.ingest(text=long_text).entries[0]
        fetched = client.fetch_projected(key=entry.key, target_model=target.name)
    seg = fetched.segment
    t = seg.num_tokens
    assert t > SHAPED_WINDOW + 64 and seg.kv.shape == (3, 2, 32, t, 96) and seg.model == target.spec.identity
    assert torch.isfinite(seg.kv).all()
    question = torch.tensor(target.tokenizer("\nIn short,", add_special_tokens=False)["input_ids"])
    out = kvcache.generate(target.model, target.spec, seg, question, max_new_tokens=6, min_new_tokens=6)
    assert out.numel() == 6
    own = kvcache.extract(target.model, target.spec, seg.token_ids)
    # recompute:r — the last r over the projected head, exact causal attention to it
    r = 32
    tail = prefill_after(target, seg.slice(0, t - r), seg.token_ids[t - r:])
    assert tail.kv.shape == (3, 2, 32, r, 96) and not torch.allclose(tail.kv, own.kv[:, :, :, t - r:], atol=1e-3)
    # selective recompute: exact at r = 100% (one window on every layer: one mask); the attention rule's window
    # through every layer (eager attention on Phi3) and the deviation rules' first layer exact
    head, rest = seg.slice(0, 1), seg.slice(1, t)
    whole = blend(target, head, rest, BlendConfig(1.0))
    assert torch.allclose(whole.segment.kv, own.kv[:, :, :, 1:], atol=1e-4, rtol=1e-3)
    some = blend(target, head, rest, BlendConfig(0.1))
    assert some.selected.numel() == round(0.1 * (t - 1)) and some.selected[-16:].tolist() == list(range(t - 17, t - 1))
    by_deviation = blend(target, head, rest, BlendConfig(0.1, rule="sinks+deviation"))
    assert torch.allclose(by_deviation.segment.kv[:1], own.kv[:1, :, :, 1:], atol=1e-4, rtol=1e-3)


@pytest.mark.integration  # the `served` server
def test_suffix_reuse_with_a_projected_document(pair, served, long_text):
    from kvbridge.server.client import KVBridgeClient
    from kvbridge.server.projected_context import ProjectedContext
    from kvbridge.transfer.store import PagedStore, StoreConfig
    from kvbridge.transfer.suffix.cache_manager import SuffixCacheManager
    from kvbridge.transfer.suffix.generator import Part, SuffixReuseGenerator
    from kvbridge.transfer.suffix.value_score import FixedScorer

    _, target = pair
    running, _ = served
    manager = SuffixCacheManager(PagedStore(StoreConfig(capacity_bytes=256 << 20, device="cpu")),
                                 scorer=FixedScorer(0.9))
    system = "You answer questions about the text in one short sentence."
    with KVBridgeClient(running.address, timeout_s=300) as client:
        gen = SuffixReuseGenerator(target, manager, context_source=ProjectedContext(client, target),
                                   recompute_fraction=0.1)
        turn = [Part(system, "system"), Part(long_text, "document", projected=True),
                Part("\nWhat does the text say about Python?")]
        _, first = gen.generate("s", turn, max_new_tokens=4)
        # an on-topic follow-up (a change of topic would flush the session's segments)
        _, second = gen.generate("s", turn[:2] + [Part("\nWhat does the text say about Python lists?")],
                                 max_new_tokens=4)
    assert first.parts == ["prefilled", "projected", "prefilled"] and first.tokens_projected > SHAPED_WINDOW
    assert second.parts == ["exact", "projected", "prefilled"] and second.tokens_reused_exact > 0


def test_production_counts_from_the_shipped_shapes(capsys):
    from kvbridge.cli import main
    from kvbridge.transfer.shaped_pair import capacity_lines, kv_bytes_per_token, parameter_count

    shapes = production_shapes()
    s, t = shapes["source"]["config"], shapes["target"]["config"]
    assert (kv_bytes_per_token(s), kv_bytes_per_token(t)) == (57_344, 393_216)
    assert 7.5e9 < parameter_count(s) < 7.7e9 and 3.7e9 < parameter_count(t) < 3.9e9  # 7.6B and 3.8B published
    assert "0.49 M source tokens" in capacity_lines(80)[0] and "1.03 M source tokens" in capacity_lines(141)[0]
    assert "0.062 M tokens with their projection" in capacity_lines(80)[0] and "0.12 M source" in capacity_lines(80)[1]
    assert "do not fit" in capacity_lines(16)[0]
    assert main(["models", "info", "--preset", "production", "--source", "/nonexistent/qwen",
                 "--target", "/nonexistent/phi3"]) == 1
    out = capsys.readouterr().out
    assert "57,344 KV bytes/token" in out and "393,216 KV bytes/token" in out and "141 GB GPU" in out
    assert "weights: not on this machine" in out and "/nonexistent/qwen" in out
