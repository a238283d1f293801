"""A correction holds its target model for its forwards: the induction prior's reading hooks every forward of the
model, so a prompt fetch's head computed meanwhile ran under it (wrong KV for the head) and reset what the reading
had counted (the correction failed: "the cache holds 53 tokens but the induction prior knows 8")."""

from __future__ import annotations

import contextlib
import threading

import torch
from kvbridge.transfer import kvcache
from kvbridge.transfer.suffix import induction
from test_service_races import TEXT, _service


def _head_during_correction(service, monkeypatch, tiny_target, fetch):
    """fetch() (a corrected fetch) with a prior that biases every head, as the shipped SmolLM2 prior does (the tiny
    target's own probe finds none); once its correction reads the model, a prompt fetch's head is computed on another
    thread. (the fetch's result, whether the head ran while the correction read, the head's KV, the model's own)"""
    target = service.model("", "target")
    layers, heads = tiny_target.spec.num_layers, tiny_target.model.config.num_attention_heads
    service.corrections.prior(tiny_target)  # built (and tagged) as a served target's is
    service.corrections._priors[tiny_target.name] = induction.InductionPrior.from_weights(
        torch.full((layers, heads), 0.5), origin="test")
    head_ids = [5, 6, 7, 5, 6, 7, 5, 6]
    expected = kvcache.extract(tiny_target.model, tiny_target.spec, torch.tensor(head_ids))
    real_reading, seen = induction.InductionPrior.reading, {}

    @contextlib.contextmanager
    def reading(self, lm, token_ids, projected):
        with real_reading(self, lm, token_ids, projected):
            if "thread" not in seen:  # the correction's forwards are about to run: a prompt fetch's head meanwhile
                def head():
                    seen["head"] = service._own_head("t", target, head_ids)
                thread = seen["thread"] = threading.Thread(target=head)
                thread.start()
                thread.join(0.5)
                seen["ran inside"] = not thread.is_alive()
            yield

    monkeypatch.setattr(induction.InductionPrior, "reading", reading)
    served = fetch()
    seen["thread"].join(60)
    assert not seen["thread"].is_alive()
    return served, seen["ran inside"], seen["head"], expected


def test_a_prompt_head_waits_for_a_correction_reading_its_model(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                                 adapter):
    service = _service(tiny_source, tiny_target, tmp_path, adapter)
    served, ran_inside, head, expected = _head_during_correction(
        service, monkeypatch, tiny_target, lambda: service.projected_cache("t", text=TEXT, mode="blend:0.1"))
    assert served.mode == "blend:0.1" and served.segment.num_tokens > 0
    assert ran_inside is False  # the head waited for the model
    assert torch.allclose(head.kv, expected.kv, atol=1e-6)  # its own KV, under no prior


def test_a_prompt_head_waits_for_a_correction_of_a_segment_entry(tmp_path, monkeypatch, tiny_source, tiny_target,
                                                                 adapter):
    """The same for a segment entry (lead 0: the correction computed after the target's own start token), whose
    compute() was not given the model's lock."""
    from test_prompt_place import _segment_entry

    service, piece, _ = _segment_entry(tmp_path, tiny_source, tiny_target, adapter)
    served, ran_inside, head, expected = _head_during_correction(
        service, monkeypatch, tiny_target,
        lambda: service.projected_cache("t", text=piece, require_cached=True, mode="blend:0.1"))
    assert served.document_index == 0  # a segment entry: the lead-0 correction
    assert served.mode == "blend:0.1" and served.segment.num_tokens > 0
    assert ran_inside is False
    assert torch.allclose(head.kv, expected.kv, atol=1e-6)
