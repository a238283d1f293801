"""The connector's worker side (`kvbridge.vllm.loading`, no vLLM import): loads written into paged buffers
through the CPU layout's writer, read ahead (prefetch) or not, a corrupt file failing its load, unused prefetches
dropped."""

from __future__ import annotations

import torch
from kvbridge.vllm import handoff
from kvbridge.vllm.layouts import write_cpu_vec
from kvbridge.vllm.loading import Load, Loads, Prefetch

L, H, T, D, BLOCK = 3, 2, 96, 8, 32
BLOCKS = [4, 1, 6]  # the request's block table


class Impl:
    def do_kv_cache_update(self, layer, key, value, cache, slots):
        assert key.is_contiguous() and value.is_contiguous() and key.shape == (slots.numel(), H, D)
        write_cpu_vec(cache, key, value, slots)


class Layer:
    def __init__(self):
        self.kv_cache, self.impl = torch.zeros(8, H, BLOCK, 2 * D), Impl()  # [blocks, H_kv, block_size, 2 D]


def expected(kv: torch.Tensor, start: int) -> list[torch.Tensor]:
    """Every layer's buffer after positions start..T-1 of kv [L, 2, H, T, D] went into BLOCKS."""
    out = []
    positions = torch.arange(start, T)
    slots = torch.tensor(BLOCKS)[positions // BLOCK] * BLOCK + positions % BLOCK
    for layer in range(L):
        cache = torch.zeros(8, H, BLOCK, 2 * D)
        write_cpu_vec(cache, kv[layer, 0, :, start:].transpose(0, 1), kv[layer, 1, :, start:].transpose(0, 1), slots)
        out.append(cache)
    return out


def test_a_prefetched_load_and_a_plain_one_write_the_same_bytes(tmp_path):
    kv = torch.randn(L, 2, H, T, D)
    for start in (0, 32):  # 32: vLLM's own prefix cache held the first block
        loads = Loads(BLOCK)
        plain, ahead = {i: Layer() for i in range(L)}, {i: Layer() for i in range(L)}
        loads.run([Load("a", str(handoff.stage(kv, tmp_path)), BLOCKS, start, T - start, sync=True)], plain)
        path = str(handoff.stage(kv, tmp_path))
        loads.prefetch([Prefetch("b", path, T)])
        loads._prefetches["b"][1].result()
        assert not (tmp_path / path).exists()  # read ahead (a staged file is removed once read)
        loads.run([Load("b", path, BLOCKS, start, T - start, sync=True)], ahead)
        assert not loads.invalid_blocks and not loads._prefetches
        for layer, want in enumerate(expected(kv, start)):
            assert torch.equal(plain[layer].kv_cache, want) and torch.equal(ahead[layer].kv_cache, want)
        loads.close()


def test_a_prefetch_that_fails_fails_its_load_and_an_unused_one_is_dropped(tmp_path):
    kv = torch.randn(L, 2, H, T, D)
    loads = Loads(BLOCK)
    bad = handoff.stage(kv, tmp_path)
    bad.write_bytes(bad.read_bytes()[:-100])  # truncated: safetensors refuses it
    loads.prefetch([Prefetch("bad", str(bad), T), Prefetch("gone", str(handoff.stage(kv, tmp_path)), T)])
    layers = {i: Layer() for i in range(L)}
    loads.run([Load("bad", str(bad), BLOCKS, 0, T, sync=True)], layers)
    assert loads.invalid_blocks == set(BLOCKS)  # vLLM recomputes them
    assert all(not layer.kv_cache.any() for layer in layers.values())
    loads.run([Load("bad", str(bad), BLOCKS, 0, T, sync=False)], layers)  # asynchronous: the request's failure
    assert loads.failed == {"bad"} and loads.finished == {"bad"}
    loads.forget({"gone", "other"})  # finished before its load
    assert not loads._prefetches
    loads._reader.shutdown(wait=True)  # its read, if it had started, ends before the next test
    loads.close()
