"""A correction's marking says per layer whose KV is there: a blend with a deviation rule makes the target's first
layer its own at every token (its selection pass), so those tokens are projected from that layer on only; exact reuse
(transfer/suffix/provenance.py) tells such a blend from one that kept the first layer projected."""

from __future__ import annotations

import torch
from kvbridge.server.adapter_registry import AdapterRegistry
from kvbridge.server.service import KVBridgeService
from kvbridge.transfer.store import PagedStore, StoreConfig
from kvbridge.transfer.suffix.blend import BlendConfig, blend
from kvbridge.transfer.suffix.correction import Correction, correct
from kvbridge.transfer.suffix.induction import InductionPrior
from kvbridge.transfer.suffix.provenance import Provenance
from kvbridge.transfer.suffix.reuse import first_layers_kv

TEXT = ("Readers skip the fields they do not understand, and writers keep the order of the fields they were given. "
        "A reader may stop at any field; a writer never reorders what it was handed.")


def _projection(tiny_source, tiny_target, folder, adapter):
    """[L, 2, H, 1 + d, D]: the service's projection of TEXT (the target's start token at 0, the document after)."""
    registry = AdapterRegistry(folder, tiny_source.spec, [tiny_target.spec])
    registry.add("fitted", adapter, make_default=True)
    service = KVBridgeService(tiny_source, [tiny_target], PagedStore(StoreConfig(capacity_bytes=32 << 20,
                                                                                 device="cpu")), registry)
    return service.projected_cache("t", text=TEXT, mode="replace").segment


def test_a_deviation_correction_marks_its_first_layer_as_the_targets_own(tmp_path, tiny_source, tiny_target, adapter):
    plain = _projection(tiny_source, tiny_target, tmp_path, adapter)
    d, layers = plain.num_tokens - 1, tiny_target.spec.num_layers
    prior = InductionPrior.for_model(tiny_target)
    fixed = correct(tiny_target, plain, Correction("blend", 0.25, "sinks+deviation"), prior=prior)
    marks = fixed.projected  # [L, 1 + d]
    assert fixed.exact_layers == 1 and tuple(marks.shape) == (layers, d + 1)
    assert not marks[0].any() and not marks[:, 0].any()  # the selection pass's layer; the start token
    assert torch.equal(marks[1:], fixed.still_projected[None].expand(layers - 1, d + 1))
    # what the marking says is what the KV is: the projection's where marked, another elsewhere
    for layer in range(layers):
        for p in range(1, d + 1):
            same = torch.equal(fixed.segment.kv[layer, :, :, p], plain.kv[layer, :, :, p])
            assert same == bool(marks[layer, p]), (layer, p)
    own = first_layers_kv(tiny_target, plain.slice(0, 1), plain.token_ids[1:], 1)  # [1, 2, H, d, D]
    torch.testing.assert_close(fixed.segment.kv[:1, :, :, 1:], own.to(fixed.segment.kv), atol=1e-5, rtol=1e-5)
    # a reader reads the still-projected positions with the prior from the first layer that holds projected KV
    read = fixed.reading_prior(prior)
    assert not read.terms[:, :1].any() and torch.equal(read.terms[:, 1:], prior.terms[:, 1:])
    # the served default (attention rule) makes no layer exact: its marking is the same in every layer
    served = correct(tiny_target, plain, Correction.parse("blend:0.25"), prior=prior)
    assert served.exact_layers == 0 and torch.equal(served.projected, served.still_projected[None].expand(layers, -1))
    assert served.reading_prior(prior) is prior


def test_exact_reuse_tells_a_blend_with_an_exact_first_layer_from_one_without(tmp_path, tiny_source, tiny_target,
                                                                            adapter):
    """Two blends of one projection that recompute the same tokens, one with its first layer made the target's own:
    other KV, so a segment computed after one is not exact after the other."""
    plain = _projection(tiny_source, tiny_target, tmp_path, adapter)
    head, doc = plain.slice(0, 1), plain.slice(1, plain.num_tokens)
    prior = InductionPrior.for_model(tiny_target)
    results = [blend(tiny_target, head, doc, BlendConfig(fraction=0.25, rule="last", layers=m), prior=prior)
               for m in (0, 1)]
    assert torch.equal(results[0].selected, results[1].selected)  # the same tokens recomputed
    assert not torch.equal(results[0].segment.kv[0], results[1].segment.kv[0])  # other KV in the first layer
    ids = plain.token_ids
    keys = []
    for result in results:
        made = Provenance()
        made.projected(1, plain.num_tokens, doc.kv, "digest", 0.25, result.projected, prior)
        keys.append(made.key(ids))
    assert keys[0] != keys[1]
    # a marking that is the same in every layer names the part as the [T] marking did (existing keys still match)
    made = Provenance()
    made.projected(1, plain.num_tokens, doc.kv, "digest", 0.25, results[0].still_projected, prior)
    assert made.key(ids) == keys[0]
