"""KVBridgeConnector: vLLM's v1 KV connector (`KVConnectorBase_V1`) that starts a request from kvbridge's projected
cache, so the vLLM-served target skips the prefill of a context that another model family read. (One class of ~400
lines: vLLM's connector interface is one class for both the scheduler's and the workers' side; the parts with logic
of their own are beside it: params (requests, matching), engine_config (what it reads of the engine, refusals), plans
(a request's state, its KV's release, what lookups received), handoff (where the KV is), loading (the workers' reads
and writes), layouts, saving, stats.)

Load it with

    LLM(model=TARGET, kv_transfer_config={"kv_connector": "KVBridgeConnector",
                                          "kv_connector_module_path": "kvbridge.vllm.connector",
                                          "kv_role": "kv_consumer",
                                          "kv_connector_extra_config": {"kvbridge_address": "127.0.0.1:50051"}})

(`kvbridge.vllm.engine.kv_transfer_config` builds the dict) and mark requests as `kvbridge.vllm.params` says. With
kv_role "kv_producer" or "kv_both" the engine also saves the KV of requests that ask into kvbridge (`saving`: the
source side, so the server need not run the source model on that text).

Scheduler side (the engine core process), never waiting on kvbridge: `get_num_new_matched_tokens` hands the request's
lookup to the connector's fetch threads (`kvbridge_fetch_threads`) and answers None (vLLM asks again at its next step,
meanwhile it schedules other requests); a fetch thread gets the projected cache from the server (`GetProjectedCache`
with the prompt's token ids: the server places the document where the prompt has it, after the target's own KV of the
tokens before it; bounded by `kvbridge_timeout_s`), matches its token ids against the prompt (`params.match_prompt`:
whole blocks, never the last token). A step that schedules nothing while lookups run waits for the first to end, up to
`kvbridge_idle_wait_ms` (vLLM would otherwise step an empty batch each millisecond); with asynchronous scheduling
only when the step before scheduled nothing either (a step scheduled while the previous one runs may be empty with
that one's output still to come: waiting would hold it back). A same-host server puts the KV in a shared-memory
segment of its own, which the fetch thread only checks it can open (the worker reads it, no second copy); a streamed
fetch's KV is staged in a private shared-memory file (`handoff`). Once the lookup is done the KV is on this
host, and the connector reports that many tokens as a synchronous load: the workers write them before the step's
forward, which computes the rest of the prompt in the same step (a sliding-window group's load is asynchronous instead,
its own step: see `get_transfer_results`); `update_state_after_alloc` tells the workers, through `build_connector_meta`,
where the KV is and the request's block ids; the server's segment is released once the workers report the load done
(`update_connector_output`): an asynchronous load's when it ends, a synchronous one's after its request ended (vLLM
keeps the request's blocks until then: `plans.Holds`, as an abort under asynchronous scheduling may come before the
worker ran the load). Anything that goes wrong (malformed kvbridge parameters, no server, a refused token, an unknown
key, other tokens, another model's shapes, a timeout) gives 0 tokens, one warning for the request, and a normal
prefill: a request never fails because of kvbridge.

Worker side: `start_load_kv` maps the server's segment (path, mode, size, layout and checksum checked) or reads the
staged file, and writes the KV into the paged buffers layer by layer through the attention backend's own cache
writer, `layer.impl.do_kv_cache_update(layer, key [T, H_kv, D], value, kv_cache, slot_mapping)`: the very call vLLM
makes for the KV it computes, so the bytes land in the backend's layout whatever it is. A load that fails (a segment
gone past its TTL, a bad checksum) is reported: a synchronous one's blocks by `get_block_ids_with_load_errors`
(vLLM drops the step's output for the request and computes it from the first of them), an asynchronous one by
`get_transfer_results` as a failed receive (vLLM computes the request from its first token); `kv_transfer_config`
sets `kv_load_failure_policy="recompute"` for that (vLLM's default "fail" would fail the request instead). Either
failure also reaches the scheduler side, with why, in the workers' metadata (`build_connector_worker_meta`): the
request's answer then says 0 tokens loaded and the error.
When a step runs empty while a lookup ends, its metadata names the KV for the workers to read and check ahead, while
the scheduler schedules the request (`loading`: the load then only writes).
The layouts the backends' writers put the bytes in (CPU_ATTN's vec and amx, FLASH_ATTN's NHD) are written out in
`layouts` and pinned by tests/test_vllm_layout.py.
KV cache groups, and what is refused (more than one group, MLA or Mamba, a quantized KV cache, tensor or pipeline
parallelism): `engine_config`.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from kvbridge.transfer import timeline
from kvbridge.vllm import handoff
from kvbridge.vllm.engine_config import EngineConfig
from kvbridge.vllm.loading import Load, Loads, Prefetch
from kvbridge.vllm.params import (
    PARAMS_KEY,
    ConnectorConfig,
    RequestContext,
    SaveRequest,
    match_prompt,
)
from kvbridge.vllm.plans import Covered, CoveredKey, Holds, Plan, Releases, served_recomputed
from kvbridge.vllm.saving import SaveChunk, Saver, SaveTracker
from kvbridge.vllm.stats import KVBridgeStats, build
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvbridge.vllm")


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)
    prefetch: list[Prefetch] = field(default_factory=list)  # for the workers to read ahead (loading.py)
    saves: list[SaveChunk] = field(default_factory=list)  # what the step's forward makes savable (saving.py)


@dataclass
class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """A worker's report after a step, for the scheduler side (`update_connector_output`)."""

    failed_loads: dict[str, str] = field(default_factory=dict)  # request id -> why its load failed

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVBridgeWorkerMetadata)
        return KVBridgeWorkerMetadata({**self.failed_loads, **other.failed_loads})


class KVBridgeConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = ConnectorConfig.from_extra(extra)
        engine = EngineConfig.read(vllm_config, kv_cache_config)  # ValueError: tensor or pipeline parallelism
        self.shape, self.block_size, self.wire_dtype = engine.shape, engine.block_size, engine.wire_dtype
        self.kv_cache_refusal = engine.refusal  # why the connector cannot load into this engine's KV cache ("": it can)
        self.sync_loads, self.prefix_caching = engine.sync_loads, engine.prefix_caching
        self.async_scheduling = engine.async_scheduling
        self._empty_before = True  # the previous schedule had no tokens (none yet: nothing runs; `_idle`)
        if role == KVConnectorRole.SCHEDULER and self.kv_cache_refusal:
            log.warning("kvbridge: the connector loads nothing into this engine (each request: 0 tokens): %s",
                        self.kv_cache_refusal)
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            log.warning("kvbridge: kv_load_failure_policy is %r: a load that fails on a worker fails its request; "
                        "with \"recompute\" (kvbridge.vllm.engine.kv_transfer_config sets it) vLLM prefills it",
                        self._kv_transfer_config.kv_load_failure_policy)
        # scheduler side
        self._plans: dict[str, Plan] = {}
        self._lookups: dict[str, Future] = {}  # lookups under way on the fetch threads
        self._scheduler_s: dict[str, tuple[float, float]] = {}  # (sum, longest) of its connector calls' seconds
        self._pending: dict[str, Load] = {}  # allocated this step, waiting for build_connector_meta
        self._loading: set[str] = set()  # asynchronous loads handed to the workers, not yet reported finished
        self._covered = Covered()  # the caches lookups received: what vLLM's own prefix cache may hold (plans.py)
        self._clients: dict[str, Any] = {}
        self._clients_lock = threading.Lock()
        self._fetchers = self._releases = self._staging = self._holds = None
        if role == KVConnectorRole.SCHEDULER:
            self._fetchers = ThreadPoolExecutor(self.config.fetch_threads, thread_name_prefix="kvbridge-fetch")
            self._releases = Releases(self._client)  # a plan's KV given up once (plans.py)
            self._holds = Holds(self._releases, self._evict)  # finished before the workers reported their loads
            handoff.sweep(self.config.staging_dir)  # what killed engines left
            self._staging = handoff.private_folder(self.config.staging_dir)
        self.saving = self._kv_transfer_config.is_kv_producer  # kv_producer / kv_both: requests may save their KV
        self._saves = SaveTracker()
        self._prefetched: set[str] = set()  # lookups whose KV the workers were told to read ahead
        # worker side
        self._loads = Loads(self.block_size)
        self._saver = (Saver(self.config, vllm_config.model_config.model, self.block_size,
                             refused=self.kv_cache_refusal) if self.saving and role == KVConnectorRole.WORKER else None)

    # ---------------------------------------------------------------------------------------- scheduler side

    def _client(self, name: str):
        with self._clients_lock:
            if name not in self._clients:
                self._clients[name] = self.config.open_client(name)
            return self._clients[name]

    def _plan(self, request_id: str, prompt: list[int], cache_salt: str | None, context: RequestContext,
              covered: CoveredKey) -> Plan:
        """On a fetch thread: fetch the projected cache, match it against the prompt and stage the tokens it covers;
        a failed plan (one warning) on any error. A same-host server's segment is left for the worker to read."""
        fetched = None
        try:
            if self.kv_cache_refusal:
                raise ValueError(self.kv_cache_refusal)
            if self.prefix_caching and not cache_salt:
                raise ValueError("prefix caching is on and the request has no cache_salt: projected KV would enter "
                                 "vLLM's prefix cache under the plain tokens' hash (give the prompt a cache_salt, "
                                 "e.g. kvbridge.vllm.engine.cache_salt(...))")
            t0 = time.perf_counter()
            fetched = self._client(context.server).fetch_projected(
                key=context.key, text=context.text, target_model=self.config.target_model, adapter=context.adapter,
                dtype=self.wire_dtype, mode=covered[2],
                prompt=prompt,  # the server places the document where the prompt has it (after a chat template)
                keep_shared=True)  # through shared memory: the worker maps the server's segment, no second copy
            timeline.event("fetched")
            seg = fetched.segment
            if not seg.rotated or (seg.num_layers, seg.num_kv_heads, seg.head_dim) != self.shape:
                raise ValueError(f"the server sent KV of {seg.model.name} with (layers, kv heads, head dim) "
                                 f"{(seg.num_layers, seg.num_kv_heads, seg.head_dim)}; this engine's model has "
                                 f"{self.shape}")
            if not torch.equal(seg.positions, torch.arange(seg.num_tokens)):
                raise ValueError("the projected cache does not start at position 0")
            cache_ids = seg.token_ids.tolist()
            match = match_prompt(prompt, cache_ids, self.block_size, covered[3])
            if match.loadable == 0:
                raise ValueError(match.reason)
            fetch_s = time.perf_counter() - t0
            source = (fetched.shared if fetched.shared is not None
                      else str(handoff.stage(seg.kv[:, :, :, :match.loadable], self._staging)))
            return Plan(source=source, loadable=match.loadable, server=context.server, fetch_s=fetch_s,
                        wire_bytes=fetched.wire_bytes, covered=covered, received_at=time.monotonic(),
                        # (a cache cut short of its document, the prompt not holding the rest, is another prompt's)
                        cache_tokens=len(cache_ids) if match.common == len(cache_ids) and not fetched.document_cut
                        else 0,
                        recomputed=None if fetched.recomputed is None
                        else served_recomputed(fetched.recomputed, fetched.document_position))
        except Exception as exc:  # noqa: BLE001 - whatever fails, vLLM prefills the request itself
            if fetched is not None and fetched.shared is not None:
                self._releases.now(Plan(source=fetched.shared, loadable=0, server=context.server))
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            log.warning("kvbridge: request %s: 0 tokens from kvbridge, vLLM prefills it: %s", request_id, reason)
            return Plan(source=None, loadable=0, error=reason)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """None while the request's lookup runs on a fetch thread; then (tokens to load, False): the KV is on this
        host by then (the server's segment or a staged file), and the workers write it before the step's forward,
        which computes the rest of the prompt in the same step; (tokens, True) in a sliding-window group (an
        asynchronous load: its own step); or (0, False): at once, with no lookup, when vLLM's own prefix cache
        already covers what the last cache fetched for this context, salt and prompt start would load
        (`plans.Covered`)."""
        t0 = time.perf_counter()
        try:
            return self._matched(request, num_computed_tokens)
        finally:
            self._timed(request.request_id, time.perf_counter() - t0)

    def _timed(self, req_id: str, seconds: float) -> None:
        """The scheduler's time inside this request's connector calls (kvbridge requests only)."""
        if req_id in self._plans or req_id in self._lookups:
            total, longest = self._scheduler_s.get(req_id, (0.0, 0.0))
            self._scheduler_s[req_id] = (total + seconds, max(longest, seconds))

    def _matched(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        req_id = request.request_id
        plan = self._plans.get(req_id)
        if plan is None:
            lookup = self._lookups.get(req_id)
            if lookup is None:
                if req_id in self._saves:
                    return 0, False
                try:
                    return self._begin(request, num_computed_tokens)
                except Exception as exc:  # noqa: BLE001 - a request's parameters never raise on the scheduler thread
                    reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
                    log.warning("kvbridge: request %s: 0 tokens from kvbridge, vLLM prefills it: %s", req_id, reason,
                                exc_info=not isinstance(exc, ValueError))  # a ValueError names what was wrong
                    self._plans[req_id] = Plan(source=None, loadable=0, error=reason)
                    return 0, False
            if not lookup.done():
                return None, False
            plan = self._plans[req_id] = lookup.result()  # _plan never raises
            del self._lookups[req_id]
            if self.prefix_caching and plan.cache_tokens:
                self._covered.remember(plan.covered, list(request.prompt_token_ids or []), plan.cache_tokens)
        if plan.source is None or plan.handed:  # failed, or loaded once already (after a preemption vLLM recomputes)
            return 0, False
        if plan.expiring(time.monotonic()):  # waited for blocks past its segment's TTL on the server: fetched again
            self._releases.soon(self._plans.pop(req_id))
            return self._begin(request, num_computed_tokens)
        tokens = max(0, plan.loadable - num_computed_tokens)
        if tokens:
            timeline.event("matched")
        elif plan.loadable:  # another request's load of the same KV is in vLLM's prefix cache now: said, as a Covered
            plan.prefix_cached = num_computed_tokens
        return tokens, tokens > 0 and not self.sync_loads

    def _begin(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """A request's first call: its parameters read (ValueError naming a malformed field), a save registered, or
        its lookup started (None), unless vLLM's prefix cache already holds what it would load."""
        req_id = request.request_id
        # first: it refuses a save beside a load's fields (or an unknown field), which the save's own parse ignores
        context = RequestContext.from_params(request.kv_transfer_params)
        save = SaveRequest.from_params(request.kv_transfer_params)
        if save is not None:
            if self.kv_cache_refusal or not self.saving:  # a KV cache the workers cannot read is refused too
                raise ValueError(self.kv_cache_refusal or "the request asks to save its KV and the engine's kv_role "
                                 f"{self._kv_transfer_config.kv_role!r} saves nothing (kv_producer or kv_both save)")
            self._saves.add(req_id, save, list(request.prompt_token_ids or []))
            return 0, False
        if context is None:
            return 0, False
        prompt = list(request.prompt_token_ids or [])
        covered = (context, request.cache_salt or "", context.mode if context.mode is not None else self.config.mode,
                   context.recompute_tokens if context.recompute_tokens is not None else self.config.recompute_tokens)
        if self.prefix_caching and num_computed_tokens:  # vLLM's own prefix cache may hold all it would load
            loadable = self._covered.loadable(covered, prompt, self.block_size, covered[3])
            if loadable is not None and num_computed_tokens >= loadable:
                self._plans[req_id] = Plan(source=None, loadable=loadable, prefix_cached=num_computed_tokens)
                return 0, False
        timeline.event("lookup")
        self._lookups[req_id] = self._fetchers.submit(self._plan, req_id, prompt, request.cache_salt, context, covered)
        return None, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        plan = self._plans.get(request.request_id)
        if num_external_tokens == 0 or plan is None or plan.source is None or plan.handed:
            return
        t0 = time.perf_counter()
        start = plan.loadable - num_external_tokens
        block_ids = list(blocks.get_block_ids()[0])
        plan.loaded, plan.load_start = num_external_tokens, start
        plan.load_blocks = block_ids[start // self.block_size:]  # what it writes, and the step's own after them
        self._pending[request.request_id] = Load(request.request_id, plan.source, block_ids, start,
                                                 num_external_tokens, sync=self.sync_loads)
        self._timed(request.request_id, time.perf_counter() - t0)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVBridgeConnectorMetadata(loads=list(self._pending.values()), saves=self._saves.chunks(scheduler_output))
        for load in meta.loads:
            self._plans[load.req_id].handed = True  # the worker removes a staged file once read
            if not load.sync:
                self._loading.add(load.req_id)
        self._pending.clear()
        empty_before, self._empty_before = self._empty_before, scheduler_output.total_num_scheduled_tokens == 0
        if (self._empty_before and not meta.loads and not meta.saves and not self._loading
                and (empty_before or not self.async_scheduling)):  # else the step before may still run: no wait
            self._idle(list(self._lookups.values()))
            meta.prefetch = self._prefetch()
        return meta

    def _prefetch(self) -> list[Prefetch]:
        """The KV of lookups that ended (after an empty step's wait), for the workers to read while the next step is
        scheduled: once per request."""
        items = []
        for req_id, lookup in self._lookups.items():
            if req_id not in self._prefetched and lookup.done():
                plan = lookup.result()
                if plan.source is not None:
                    self._prefetched.add(req_id)
                    items.append(Prefetch(req_id, plan.source, plan.loadable))
        return items

    def _idle(self, lookups: list[Future]) -> None:
        """A step with nothing to compute while lookups run: wait for the first to end, up to idle_wait_ms. Nothing
        is delayed by it (the step is empty; no worker load is in flight; with asynchronous scheduling the step
        before, which may still run, was empty too); it spares the cores an empty step each millisecond would take
        from a same-host kvbridge server."""
        if lookups and self.config.idle_wait_ms > 0:
            futures.wait(lookups, timeout=self.config.idle_wait_ms / 1e3, return_when=futures.FIRST_COMPLETED)

    def update_connector_output(self, connector_output) -> None:
        """The workers' failed loads (the request's answer says so; vLLM computes the tokens itself) and finished
        ones (the server's segments they read are released now). A synchronous load's failure reaches vLLM as
        invalid block ids, an asynchronous one's as a failed receive; both reach this side, with why, in the workers'
        own metadata (`KVBridgeWorkerMetadata`). A finished request's failed load leaves vLLM's prefix cache
        (`plans.Holds`)."""
        meta = connector_output.kv_connector_worker_meta
        failed = dict(meta.failed_loads) if isinstance(meta, KVBridgeWorkerMetadata) else {}
        for req_id in connector_output.failed_recving or ():
            failed.setdefault(req_id, "a failed receive")
        for req_id, reason in failed.items():
            if req_id in self._plans:
                self._plans[req_id].load_failed(reason)
            self._holds.failed(req_id, reason)
        for req_id in connector_output.finished_recving or ():
            self._loading.discard(req_id)
            if self._holds.done(req_id):
                continue
            plan = self._plans.get(req_id)
            if plan is not None and plan.handed:
                self._releases.soon(plan)

    def _evict(self, block_ids: set[int]) -> None:
        """Take blocks out of vLLM's prefix cache (the scheduler binds its KVCacheManager: `bind_kv_cache_manager`)."""
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is not None and self.prefix_caching:
            manager.evict_blocks(block_ids)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """(True: vLLM keeps the blocks until the workers name the request in finished_recving, for a request whose
        load went to them, `plans.Holds`; the request's kvbridge answer)."""
        t0 = time.perf_counter()
        req_id = request.request_id
        loading = req_id in self._loading
        self._loading.discard(req_id)
        read_ahead = req_id in self._prefetched
        self._prefetched.discard(req_id)
        lookup = self._lookups.pop(req_id, None)
        if lookup is not None:  # aborted while its lookup ran: what it fetches is given up when it is done
            self._releases.after(lookup)
        plan = self._plans.pop(req_id, None)
        in_calls, longest = self._scheduler_s.pop(req_id, (0.0, 0.0))
        saved = self._saves.finish(req_id)
        if saved is not None:  # the upload ends after the answer: saved_tokens went to it (saving.py)
            return False, {PARAMS_KEY: {**saved, "save_state": "queued" if saved["saved_tokens"] else "incomplete"}}
        if plan is None:
            return False, None
        held = plan.handed and (self.sync_loads or loading)
        if held:  # the workers may not have run the load yet (an abort under asynchronous scheduling)
            self._holds.hold(req_id, plan, block_ids, self.block_size, self.sync_loads)
        else:
            self._releases.soon(plan)  # loaded and reported, or never (vLLM computed the tokens itself)
        spent = time.perf_counter() - t0  # this call counts among the scheduler's, up to here
        in_calls, longest = in_calls + spent, max(longest, spent)
        transport = "" if plan.source is None else "stream" if isinstance(plan.source, str) else "shared_memory"
        return held, {PARAMS_KEY: {"loaded_tokens": plan.loaded, "error": plan.error, "fetch_s": plan.fetch_s,
                                  "wire_bytes": plan.wire_bytes, "transport": transport, "scheduler_s": in_calls,
                                  "scheduler_max_s": longest, "prefix_cached": plan.prefix_cached,
                                  "read_ahead": read_ahead, "recomputed_tokens": plan.recomputed}}

    def shutdown(self):
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=False, cancel_futures=True)
        if self._releases is not None:
            for lookup in self._lookups.values():  # what lookups that end after this fetch
                self._releases.after(lookup)
            for plan in self._plans.values():
                self._releases.now(plan)
            self._holds.release_all()
            self._releases.close()
        self._lookups.clear()
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        if self._saver is not None:
            self._saver.close()
        self._loads.close()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    # ---------------------------------------------------------------------------------------- worker side

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """The step's loads, written before its forward (`loading.Loads`); the KV it names to read ahead."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVBridgeConnectorMetadata)
        self._loads.prefetch(meta.prefetch)
        if not meta.loads:
            return
        layers = {extract_layer_index(name): layer for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None and hasattr(getattr(layer, "impl", None),
                                                                              "do_kv_cache_update")}
        self._loads.run(meta.loads, layers)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv wrote every layer before the forward; asynchronous loads wait for get_finished

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of synchronous loads that failed since the last call: vLLM recomputes the request from the
        first of them (kv_load_failure_policy "recompute") and drops the step's output for it."""
        failed, self._loads.invalid_blocks = self._loads.invalid_blocks, set()
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """The save side: this layer's positions of the step's saving requests, read out of its paged buffer."""
        if self._saver is None:
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.saves:
            return
        from vllm.forward_context import get_forward_context

        layer = get_forward_context().no_compile_layers.get(layer_name)
        self._saver.save_layer(extract_layer_index(layer_name), self.shape[0], layer, kv_layer, meta.saves)

    def wait_for_save(self):
        """After the step's forward: the saves it completed go to their upload thread (the forward never waits)."""
        timeline.event("forward_end")
        if self._saver is None:
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVBridgeConnectorMetadata) and meta.saves:
            self._saver.step_done(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(None: nothing is saved, the requests whose loads this worker finished since the last call, failed ones
        too: get_transfer_results tells which failed; a synchronous load's once its request has finished)."""
        self._loads.forget(finished_req_ids)
        if self._saver is not None:  # an aborted save's partial KV
            self._saver.forget(finished_req_ids)
        return None, self._loads.report(finished_req_ids) or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads, and among them the failed ones: vLLM computes those requests from their first token
        (with kv_load_failure_policy="recompute"). A whole request, not its blocks: in a sliding-window group the
        blocks before a failed one are null blocks that a recompute from that block would read."""
        failed, self._loads.failed = self._loads.failed, set()
        _, loaded = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=set(loaded or ()), failed_recving=failed)

    def get_kv_connector_stats(self) -> KVBridgeStats | None:
        """What this worker's save uploads did since the last step (`stats`), for vLLM's stat logger."""
        counts = self._saver.counts() if self._saver is not None else {}
        return build(counts) if counts else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBridgeStats:
        return build(data)

    def build_connector_worker_meta(self) -> KVBridgeWorkerMetadata | None:
        """The loads that failed since the last step and why, for the scheduler side (`update_connector_output`)."""
        failed, self._loads.errors = self._loads.errors, {}
        return KVBridgeWorkerMetadata(failed) if failed else None
