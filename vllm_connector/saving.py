"""The connector's save side (kv_role "kv_producer" or "kv_both"): a vLLM engine serving the source model stores the
KV it computes for requests that ask (`params.SaveRequest`) in a kvbridge server as a source entry (PutSourceKV),
so that a target engine can load its projection without the server running the source model on that text.

Scheduler side (`SaveTracker`, in `build_connector_meta`): each step, for every saving request, the prompt positions
whose KV is in vLLM's cache once the step's forward has run — [saved so far, computed + scheduled) within the tokens
to save — with the request's block table. Chunked prefill saves over several steps; tokens vLLM's prefix cache had
are saved with the first step's.
Worker side (`Saver`): after each layer's attention (`save_kv_layer`) the step's positions are read out of the paged
buffer (`layouts.READERS`, the CPU backend's layout inverted; pinned against vLLM's writer) into a CPU tensor
[L, 2, H_kv, T, D]; after the request's last step (`wait_for_save`) a thread uploads it. The engine's model is named
by the server's model with the same config hash (`kvbridge.transfer.spec.config_hash` of the model folder's config,
the hash kvbridge identifies models by); the server checks name, hash, shapes and dtype as for any upload. Keys are
uploaded as vLLM caches them (rotated).

The upload ends after the request's answer (vLLM hands it out when the request finishes, and the upload of a
one-token request has barely started then): the answer's `saved_tokens` counts the tokens whose KV went to the upload
and says nothing of the upload itself, so it comes with `"save_state": "queued"` ("incomplete": the request ended
before all its tokens were computed, nothing is uploaded). Whether an upload stored: a failed one logs a warning
naming the request and why; the workers count stored and failed uploads (`Saver.counts`, vLLM's KV connector stats:
`stats`); a client asks the server (`KVBridgeClient.lookup(token_ids=...)` finds the entry once stored). The request
itself never fails.

No vLLM import at module level.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from kvbridge.vllm import layouts
from kvbridge.vllm.params import ConnectorConfig, SaveRequest

log = logging.getLogger("kvbridge.vllm")


@dataclass(frozen=True)
class SaveChunk:
    """Positions [start, end) of a saving request to read after this step's forward."""

    req_id: str
    server: str
    block_ids: list[int]  # the request's block table (first KV cache group)
    start: int
    end: int
    total: int  # the tokens the request saves (positions 0..total-1)
    token_ids: list[int] | None = None  # with the last chunk (end == total): the saved tokens' ids


@dataclass
class _Saving:
    request: SaveRequest
    token_ids: list[int]  # the prompt's first `total` tokens
    block_ids: list[int] = field(default_factory=list)
    saved: int = 0  # positions 0..saved-1 handed to the workers

    @property
    def total(self) -> int:
        return len(self.token_ids)


class SaveTracker:
    """The scheduler's saving requests and what each step saves of them."""

    def __init__(self):
        self._saving: dict[str, _Saving] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._saving

    def add(self, req_id: str, request: SaveRequest, prompt: list[int]) -> None:
        tokens = len(prompt) if request.tokens is None else min(request.tokens, len(prompt))
        self._saving[req_id] = _Saving(request, list(prompt[:tokens]))

    def chunks(self, scheduler_output) -> list[SaveChunk]:
        """What this step's forward makes savable, per saving request scheduled in it."""
        steps: dict[str, tuple[int, list[int] | None, bool]] = {}  # req_id -> (computed, new block ids, replace)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id in self._saving:
                steps[new.req_id] = (new.num_computed_tokens, list(new.block_ids[0]), True)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._saving:
                blocks = cached.new_block_ids[i]
                resumed = req_id in cached.resumed_req_ids  # after a preemption: the whole table anew
                steps[req_id] = (cached.num_computed_tokens[i], list(blocks[0]) if blocks else None, resumed)
        out = []
        for req_id, (computed, blocks, replace) in steps.items():
            s = self._saving[req_id]
            if blocks is not None:
                s.block_ids = blocks if replace else s.block_ids + blocks
            end = min(s.total, computed + scheduler_output.num_scheduled_tokens.get(req_id, 0))
            if end <= s.saved:
                continue
            out.append(SaveChunk(req_id, s.request.server, list(s.block_ids), s.saved, end, s.total,
                                 s.token_ids if end == s.total else None))
            s.saved = end
        return out

    def finish(self, req_id: str) -> dict[str, Any] | None:
        """The request's save, as its answer tells it (`saved_tokens`: handed to the upload, 0 if not all were);
        None for a request that saved nothing."""
        s = self._saving.pop(req_id, None)
        return None if s is None else {"saved_tokens": s.saved if s.saved == s.total else 0,
                                       "save_server": s.request.server}


class Saver:
    """The worker's saves: KV read out of the paged buffers layer by layer, uploaded once complete."""

    def __init__(self, config: ConnectorConfig, model_path: str, block_size: int, refused: str = ""):
        self.config, self.model_path, self.block_size = config, model_path, block_size
        # req_id -> [L, 2, H, T, D] being filled; dropped once uploaded, or when its request finishes (`forget`)
        self._kv: dict[str, torch.Tensor] = {}
        self._uploads = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-save")
        self._clients: dict[str, Any] = {}
        self._models: dict[str, tuple[str, str]] = {}  # server -> (its name of this model, config hash)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}  # stats.COUNTERS since the last `counts()`, under _counts_lock
        self._counts_lock = threading.Lock()  # the upload thread adds, the model runner's thread takes
        # why this engine cannot save ("": it can; `refused`: what the connector found at its start, e.g. a quantized
        # KV cache), warned at each step that had saves
        self._refused = refused
        # req_id -> why this request cannot be saved (its table lacks blocks: a sliding window dropped them); the
        # engine saves its other requests, and this one's last chunk counts it failed
        self._unsaved: dict[str, str] = {}

    def save_layer(self, index: int, num_layers: int, layer, kv_cache: torch.Tensor, chunks: list[SaveChunk]) -> None:
        """Read layer `index`'s positions of every chunk out of its paged buffer (kv_cache)."""
        if self._refused:
            return
        isa = getattr(layer, "isa", None)
        reader = layouts.READERS.get(isa) if kv_cache.device.type == "cpu" else None
        if reader is None:
            self._refused = (f"saving reads the CPU attention backend's layouts; this engine's is {isa!r} on "
                             f"{kv_cache.device.type}")
            return
        for chunk in chunks:
            if chunk.req_id in self._unsaved:
                continue
            kept, slots = layouts.slot_mapping(chunk.block_ids, chunk.start, chunk.end - chunk.start, self.block_size)
            if kept.numel() != chunk.end - chunk.start:  # a sliding window dropped blocks: this request's KV is gone
                self._unsaved[chunk.req_id] = (f"its block table holds {chunk.end - chunk.start - kept.numel()} "
                                               f"positions of {chunk.start}..{chunk.end} in no block (a sliding "
                                               "window dropped them): saving needs every block")
                self._kv.pop(chunk.req_id, None)
                continue
            key, value = reader(kv_cache, slots)  # [n, H, D] each
            kv = self._kv.get(chunk.req_id)
            if kv is None:
                kv = self._kv[chunk.req_id] = torch.empty((num_layers, 2, key.shape[1], chunk.total, key.shape[2]),
                                                          dtype=kv_cache.dtype)
            kv[index, 0, :, chunk.start:chunk.end] = key.transpose(0, 1)
            kv[index, 1, :, chunk.start:chunk.end] = value.transpose(0, 1)

    def step_done(self, chunks: list[SaveChunk]) -> None:
        """After the step's forward: upload the requests whose last chunk it read."""
        if self._refused:
            for chunk in chunks:
                self._kv.pop(chunk.req_id, None)
            if chunks:
                refused = len({c.req_id for c in chunks if c.token_ids is not None})  # their last chunk: not saved
                log.warning("kvbridge: %d request(s) not saved: %s", len({c.req_id for c in chunks}), self._refused)
                self._count(saves_failed=refused)
            return
        for chunk in chunks:
            if chunk.token_ids is None:
                continue
            why = self._unsaved.pop(chunk.req_id, None)
            if why is not None:
                log.warning("kvbridge: request %s not saved: %s", chunk.req_id, why)
                self._count(saves_failed=1)
            elif chunk.req_id in self._kv:
                kv = self._kv.pop(chunk.req_id)
                self._uploads.submit(self._upload, chunk.req_id, chunk.server, kv, chunk.token_ids)

    def forget(self, req_ids: set[str]) -> None:
        """Finished requests: the KV of a save they never completed (aborted before their last chunk) is dropped."""
        for req_id in req_ids & self._kv.keys():
            del self._kv[req_id]
        for req_id in req_ids & self._unsaved.keys():
            del self._unsaved[req_id]

    def _upload(self, req_id: str, server: str, kv: torch.Tensor, token_ids: list[int]) -> None:
        try:
            client = self._client(server)
            name, config_hash = self._model(server, client, kv)
            entry = client.put_kv(kv, token_ids, model=name, config_hash=config_hash)
            log.info("kvbridge: request %s: saved %d tokens as %s", req_id, len(token_ids), entry.key[:16])
            self._count(saves_stored=1, saved_tokens_stored=len(token_ids))
        except Exception as exc:  # noqa: BLE001 - a save that fails never fails the request
            log.warning("kvbridge: request %s: saving %d tokens failed: %s", req_id, len(token_ids), exc)
            self._count(saves_failed=1)

    def _count(self, **counts: int) -> None:
        with self._counts_lock:
            for name, n in counts.items():
                self._counts[name] = self._counts.get(name, 0) + n

    def counts(self) -> dict[str, int]:
        """What the uploads did since the last call (stored, their tokens, failed: `stats.COUNTERS`)."""
        with self._counts_lock:
            counts, self._counts = self._counts, {}
        return counts

    def _client(self, name: str):
        with self._lock:
            if name not in self._clients:
                self._clients[name] = self.config.open_client(name)
            return self._clients[name]

    def _model(self, server: str, client, kv: torch.Tensor) -> tuple[str, str]:
        """The server's name of this engine's model: its source model with this model folder's config hash."""
        if server not in self._models:
            from kvbridge.transfer.spec import config_hash
            from transformers import AutoConfig

            ours = config_hash(AutoConfig.from_pretrained(self.model_path, local_files_only=True).get_text_config())
            found = [m for m in client.list_models() if "source" in m.role.split(",") and m.config_hash == ours]
            if not found:
                raise ValueError(f"the server serves no source model with this engine's config (hash {ours[:16]}...)")
            self._models[server] = (found[0].name, ours)
        return self._models[server]

    def close(self) -> None:
        self._uploads.shutdown(wait=True)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
