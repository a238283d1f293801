"""The worker side's loads (the connector's `start_load_kv` hands them here): the KV a load writes is read (the
server's segment mapped and its checksum checked, or a staged file) and written into every layer's paged buffer
through the attention backend's own cache writer, `layer.impl.do_kv_cache_update(layer, key [T, H_kv, D], value,
kv_cache, slot_mapping)`.

Prefetch: when a step runs empty while a lookup ends (the engine had nothing else to compute), the scheduler names
the looked-up KV in that empty step's metadata (`Prefetch`), and a thread of this worker maps and checks it while the
scheduler schedules the request; the load then only writes. The step is empty, so the
thread takes the cores from no forward; in a busy engine nothing is prefetched (the read would compete with the
forwards of the other requests). A prefetch that fails fails its load the same way a read there would.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from kvbridge.transfer import timeline
from kvbridge.vllm import handoff, layouts

log = logging.getLogger("kvbridge.vllm")


@dataclass(frozen=True)
class Load:
    """One request's load, sent from the scheduler to the workers."""

    req_id: str
    # the KV of the prompt's first tokens [L, 2, H_kv, >= start + num_tokens, D]: the server's own segment (same host,
    # handoff.read maps it and checks its checksum), else a file the scheduler staged (handoff.stage)
    source: handoff.KVSource
    block_ids: list[int]  # the request's blocks from position 0 (first KV cache group)
    start: int  # the first prompt position to write (tokens before it were cached locally)
    num_tokens: int
    # loaded before the step's forward, which then computes the rest of the prompt (no step of its own); a failure is
    # reported as invalid blocks, which vLLM recomputes. False (a sliding-window group): an asynchronous load, a
    # failure is the whole request's (`get_transfer_results`)
    sync: bool = False


@dataclass(frozen=True)
class Prefetch:
    """KV a finished lookup will load: read ahead by the worker during an empty step."""

    req_id: str
    source: handoff.KVSource
    num_tokens: int  # the prompt's first tokens it covers (the plan's loadable)


def write(load: Load, kv: torch.Tensor, layers: dict[int, torch.nn.Module], block_size: int) -> None:
    """Write kv [L, 2, H_kv, n, D] for positions start..start+n-1 of the request into every layer's buffer: the
    positions that have a real block (a sliding-window group's table holds the null block, id 0, before the window;
    nothing is written there). Layer by layer, each layer's keys and values made token-major ([n, H_kv, D], what the
    cache writer takes) just before its write, while they are in cache (one token-major copy of the whole KV first
    cost more than these 60 small ones and the writes together)."""
    if kv.shape[0] != len(layers) or kv.shape[3] != load.num_tokens:
        raise ValueError(f"staged KV {tuple(kv.shape)} does not fit {len(layers)} layers x {load.num_tokens} "
                         "tokens")
    kept, slots = layouts.slot_mapping(load.block_ids, load.start, load.num_tokens, block_size)  # [n'], [n']
    if kept.numel() == 0:
        return
    if kept.numel() < load.num_tokens:
        kv = kv.index_select(3, kept)  # [L, 2, H_kv, n', D]
    for index in sorted(layers):  # layer by layer
        layer = layers[index]
        cache = layer.kv_cache
        key = kv[index, 0].transpose(0, 1).to(device=cache.device, dtype=cache.dtype).contiguous()  # [n', H, D]
        value = kv[index, 1].transpose(0, 1).to(device=cache.device, dtype=cache.dtype).contiguous()
        layer.impl.do_kv_cache_update(layer, key, value, cache, slots.to(cache.device))


class Loads:
    """A worker's loads: prefetches under way, and what the loads since the last report did (finished asynchronous
    loads, failed ones, blocks of failed synchronous loads, why each failed), and the synchronous loads run whose
    request has not finished yet (`report`)."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.finished: set[str] = set()  # asynchronous loads done (failed or not)
        # requests whose synchronous load ran (failed or not): reported finished once the request is (`report`)
        self.ran_sync: set[str] = set()
        self.failed: set[str] = set()  # asynchronous loads that failed
        self.invalid_blocks: set[int] = set()  # blocks of failed synchronous loads, for vLLM to recompute
        self.errors: dict[str, str] = {}  # why each load failed (synchronous or not), for the scheduler side
        self._prefetches: dict[str, tuple[Prefetch, Future]] = {}
        self._reader: ThreadPoolExecutor | None = None

    def prefetch(self, items: list[Prefetch]) -> None:
        for item in items:
            if item.req_id in self._prefetches:
                continue
            if self._reader is None:
                self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-prefetch")
            self._prefetches[item.req_id] = (item, self._reader.submit(self._prepare, item))

    @staticmethod
    def _prepare(item: Prefetch) -> torch.Tensor:
        timeline.event("prefetch_begin")
        kv = handoff.read(item.source)
        timeline.event("prefetched")
        return kv

    def _kv(self, load: Load) -> torch.Tensor:
        """The load's KV [L, 2, H_kv, n, D]: read ahead (waited for), else read now."""
        ahead = self._prefetches.pop(load.req_id, None)
        end = load.start + load.num_tokens
        kv = None
        if ahead is not None and ahead[0].source == load.source and ahead[0].num_tokens >= end:
            kv = ahead[1].result()
        if kv is None:
            kv = handoff.read(load.source)  # [L, 2, H_kv, >= end, D]: the tokens from position 0
        return kv[:, :, :, load.start:end]

    def run(self, loads: list[Load], layers: dict[int, torch.nn.Module]) -> None:
        for load in loads:
            try:
                timeline.event("load_begin")
                kv = self._kv(load)
                timeline.event("mapped")
                write(load, kv, layers, self.block_size)
                timeline.event("written")
            except Exception as exc:  # noqa: BLE001 - reported as failed: vLLM recomputes the tokens
                log.warning("kvbridge: request %s: loading %d tokens failed, vLLM recomputes them: %s", load.req_id,
                            load.num_tokens, exc)
                self.errors[load.req_id] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                if load.sync:  # every block the load covers: vLLM recomputes from the first
                    first, last = load.start // self.block_size, (load.start + load.num_tokens - 1) // self.block_size
                    self.invalid_blocks.update(load.block_ids[first:last + 1])
                else:
                    self.failed.add(load.req_id)
            if load.sync:
                self.ran_sync.add(load.req_id)
            else:
                self.finished.add(load.req_id)  # done, failed or not

    def report(self, finished_req_ids: set[str]) -> set[str]:
        """The loads to name in finished_recving now: asynchronous ones done since the last report, and synchronous
        ones whose request has finished (`finished_req_ids`: vLLM's finished requests, named in a step after the one
        that carried their load). The scheduler side held each of those (its blocks and its KV, `plans.Holds`) until
        this report."""
        done = self.ran_sync & finished_req_ids
        self.ran_sync -= done
        reported, self.finished = self.finished | done, set()
        return reported

    def forget(self, req_ids: set[str]) -> None:
        """Finished requests: a prefetch they never loaded is dropped."""
        for req_id in req_ids & self._prefetches.keys():
            self._prefetches.pop(req_id)[1].cancel()

    def close(self) -> None:
        self._prefetches.clear()
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)
