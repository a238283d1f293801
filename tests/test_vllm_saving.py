"""The vLLM saver: a request that cannot be saved does not stop the same step's other requests from being read,
and never leaves KV behind in the worker's buffers."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kvbridge.vllm.params import ConnectorConfig


def _saver():
    from kvbridge.vllm.saving import Saver

    saver = Saver(ConnectorConfig.from_extra({"kvbridge_address": "127.0.0.1:1"}), "unused", 32)
    uploaded = []
    saver._upload = lambda req_id, server, kv, token_ids: uploaded.append((req_id, kv.clone(), token_ids))
    return saver, uploaded


def _cache():
    from kvbridge.vllm.layouts import write_cpu_vec

    cache = torch.zeros(4, 2, 32, 16)
    key, value = torch.randn(32, 2, 8), torch.randn(32, 2, 8)
    write_cpu_vec(cache, key, value, torch.arange(64, 96))  # block 2
    return cache, key, value


def test_a_step_with_an_unsaveable_request_saves_its_other_requests():
    """The windowed request comes first in the step's chunk list."""
    from kvbridge.vllm.saving import SaveChunk

    saver, uploaded = _saver()
    cache, key, value = _cache()
    windowed = SaveChunk("w", "default", [0, 2], 0, 64, 64, token_ids=list(range(64)))
    whole = SaveChunk("b", "default", [2], 0, 32, 32, token_ids=list(range(32)))
    for index in range(2):
        saver.save_layer(index, 2, SimpleNamespace(isa="vec"), cache, [windowed, whole])
    saver.step_done([windowed, whole])
    saver.close()
    assert [r for r, _, _ in uploaded] == ["b"] and saver.counts() == {"saves_failed": 1}
    for layer in range(2):  # every layer read (not torch.empty's leftovers in the first)
        assert torch.equal(uploaded[0][1][layer, 0], key.transpose(0, 1))
        assert torch.equal(uploaded[0][1][layer, 1], value.transpose(0, 1))


def test_an_unsaveable_request_leaves_no_kv_behind_after_its_last_chunk():
    from kvbridge.vllm.saving import SaveChunk

    cache, _, _ = _cache()
    # first chunk lacks a block (null block 0 before the window), the second reads block 2
    for chunks in ([SaveChunk("a", "default", [0, 2], 0, 32, 64), SaveChunk("a", "default", [0, 2], 32, 64, 64,
                                                                            token_ids=list(range(64)))],
                   # first chunk reads block 2, the second finds its block gone
                   [SaveChunk("a", "default", [2, 0], 0, 32, 64), SaveChunk("a", "default", [2, 0], 32, 64, 64,
                                                                            token_ids=list(range(64)))]):
        saver, uploaded = _saver()
        for chunk in chunks:
            for index in range(2):
                saver.save_layer(index, 2, SimpleNamespace(isa="vec"), cache, [chunk])
            saver.step_done([chunk])
        saver.close()
        assert uploaded == [] and saver.counts() == {"saves_failed": 1}
        assert saver._kv == {} and saver._unsaved == {}
