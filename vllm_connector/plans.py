"""The connector's scheduler-side state of a request (`Plan`), the giving up of its KV once the request is done with
it (`Releases`; `Holds` for a request that finished before the workers reported its load), and what it remembers
across requests (`Covered`): the projected caches its lookups received, so that a request whose prompt vLLM's own
prefix cache already covers as far as the server's cache could load it starts at once, without asking the server.

With prefix caching on, the blocks a load writes are hashed like computed ones, under the request's `cache_salt`
(required then; `engine.cache_salt`). The next request with the same salt, context and prompt start finds them in
vLLM's prefix cache: `get_num_new_matched_tokens` is asked with `num_computed_tokens` past them, and a lookup would
cost a round trip to the server and an empty engine step only to learn that nothing is left to load. `Covered`
keeps, per (context, salt, mode, recompute), the token count of the last cache the server sent for it and a digest
of those tokens; a request whose prompt begins with exactly those tokens would get the same cache (the server's
answer is a function of the context and the prompt's tokens before the document's end), so what it could load is
known here (`params.match_prompt`'s rule), and when vLLM's local cache already covers that, the connector answers
(0, False) with no lookup. Anything else (another prompt start, fewer tokens cached locally, evicted blocks, a
context never fetched) takes the lookup as before.
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvbridge.vllm import handoff
from kvbridge.vllm.params import RequestContext

log = logging.getLogger("kvbridge.vllm")

CoveredKey = tuple[RequestContext, str, str, int]  # (context, cache salt, mode, recompute tokens)


@dataclass
class Plan:
    """The scheduler's state for one request with a kvbridge context (kept until the request finishes)."""

    source: handoff.KVSource | None  # the KV of prompt tokens 0..loadable-1 (or more); None: nothing to load
    loadable: int  # prompt tokens the cache covers (whole blocks, never the last token)
    server: str = ""  # the kvbridge server it came from (whose shared segment is released once loaded)
    error: str = ""
    loaded: int = 0  # tokens vLLM asked to load (num_external_tokens); 0 again when the workers' load failed
    fetch_s: float = 0.0  # a fetch thread's wait for the server (GetProjectedCache, to the assembled tensor)
    wire_bytes: int = 0  # KV bytes received from the server (0 through shared memory)
    handed: bool = False  # the load went to the workers (they remove a staged file)
    load_start: int = 0  # the first prompt position the load writes (vLLM's prefix cache held those before it)
    load_blocks: list[int] = field(default_factory=list)  # the request's blocks from load_start's, at allocation
    load_error: str = ""  # why the workers' load failed ("": it did not, or has not run yet)
    released: bool = False  # the KV's source is given up (a staged file removed, the server's segment released)
    # the server's whole cache matched the prompt's first cache_tokens tokens (0: it did not, nothing to remember)
    cache_tokens: int = 0
    # the prompt's tokens vLLM's own prefix cache held when the lookup was skipped (Covered), or when the lookup's
    # answer came (another request loaded the same KV meanwhile)
    prefix_cached: int = 0
    covered: CoveredKey | None = None  # what Covered remembers the cache under
    received_at: float = 0.0  # time.monotonic() when the server's answer came (its segment's TTL runs from then)
    recomputed: int | None = None  # document tokens the server says it recomputed (`served_recomputed`); None: no fetch

    def expiring(self, now: float, margin_s: float = 2.0) -> bool:
        """The server's segment is past (or within margin_s of) its TTL: a load now would find it gone."""
        ttl_s = getattr(self.source, "ttl_s", None)  # a staged file (a path) is the connector's own: no TTL
        return bool(ttl_s) and now - self.received_at > max(ttl_s - margin_s, ttl_s / 2)

    def load_failed(self, reason: str) -> None:
        """The workers could not write the KV (`update_connector_output`): nothing of it counts as loaded; vLLM
        computed those tokens itself (or, with kv_load_failure_policy "fail", failed the request)."""
        self.loaded = 0
        self.load_error = reason
        self.error = f"the workers' load of the KV failed: {reason}"


def served_recomputed(positions, document_position: int | None) -> int:
    """How many document tokens the server says its correction recomputed with the target: the distinct positions
    of the reply header's `recomputed_positions` (the fetched cache's `recomputed`, [R]) from its `document_position`
    on (the start token and a prompt's head before it are the target's own KV; the server lists the start token among
    a stored correction's). A server older than `document_position` sends none: its positions past 0 (exact unless a
    prompt without the start token puts a recomputed document token at 0). 0 for replace."""
    first = 1 if document_position is None else document_position
    return len({p for p in positions.tolist() if p >= first})


class Releases:
    """Gives up a plan's KV once: a staged file nobody loaded is removed (a loaded one the worker removed), the
    server's segment is released (`client(server).release_segment`, not waited for: the server removes it after its
    TTL otherwise). `soon` does it on a thread of its own: a ReleaseSegment call costs the scheduler's thread 0.6-1 ms
    on 2 cores, between a finished request's last step and its output."""

    def __init__(self, client: Callable[[str], Any]):
        self._client = client  # the kvbridge client of a server, by name
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvbridge-release")

    def now(self, plan: Plan) -> None:
        if self._claim(plan):
            self._give_up(plan)

    def soon(self, plan: Plan) -> None:
        if self._claim(plan):
            self._pool.submit(self._give_up, plan)

    def after(self, lookup: Future) -> None:
        """A lookup whose request ended first: what it fetched is given up when it is done."""
        lookup.add_done_callback(lambda done: None if done.cancelled() else self.now(done.result()))

    def close(self) -> None:
        self._pool.shutdown(wait=True)  # the releases of finished requests: each a call not waited for

    @staticmethod
    def _claim(plan: Plan) -> bool:
        if plan.source is None or plan.released:
            return False
        plan.released = True  # here, so that it is released once
        return True

    def _give_up(self, plan: Plan) -> None:
        if isinstance(plan.source, str):
            if not plan.handed:
                handoff.discard(plan.source)
            return
        try:
            self._client(plan.server).release_segment(plan.source)
        except Exception as exc:  # noqa: BLE001 - the server's sweeper removes the segment after its TTL
            log.warning("kvbridge: releasing segment %s failed, the server removes it after %g s: %s",
                        plan.source.name, plan.source.ttl_s, exc)


@dataclass
class Held:
    """A finished request whose load the workers have not reported yet (`Holds`)."""

    plan: Plan
    # the blocks its synchronous load wrote and every one after them (computed on top of them): evicted from vLLM's
    # prefix cache if the load failed. [] for an asynchronous load: vLLM caches those blocks only once loaded
    written: list[int]


class Holds:
    """Finished requests whose loads the workers may not have run yet. With asynchronous scheduling (vLLM 0.32's
    `EngineCore.step_with_batch_queue`) vLLM takes an abort while the step that carries a request's load is queued
    or running: released then, the server's segment could be gone when the worker maps it. So `request_finished`
    answers True for a request whose load went to the workers (vLLM keeps its blocks), the workers name it in
    finished_recving once its load has run and its finish reached them (`loading.Loads.report`), and only then is
    its segment released (`done`).

    A held request whose load failed has the blocks it wrote, and those after them, evicted from vLLM's prefix cache
    (`evict`: `KVCacheManager.evict_blocks`): vLLM caches a synchronous load's blocks when it allocates them, and with
    kv_load_failure_policy "recompute" it evicts nothing, counting on the request to compute them again; a finished
    request never does, and a later request with the same salt and prompt would read the garbage. (Conservative: a
    request that did compute them again before finishing loses them from the prefix cache too.) Scheduler thread
    only."""

    def __init__(self, releases: Releases, evict: Callable[[set[int]], None]):
        self._releases = releases
        self._evict = evict
        self._held: dict[str, Held] = {}

    def hold(self, req_id: str, plan: Plan, block_ids: list[int], block_size: int, sync: bool) -> None:
        """A finished request whose load went to the workers; `block_ids`: its blocks as vLLM hands them to
        request_finished (those of its computed tokens: fewer than it wrote when vLLM cut them after a failed load)."""
        first = plan.load_start // block_size
        written = list(dict.fromkeys(plan.load_blocks + block_ids[first:])) if sync else []
        self._held[req_id] = Held(plan, written)
        if plan.load_error:  # reported failed while it ran
            self.failed(req_id, plan.load_error)

    def failed(self, req_id: str, reason: str) -> None:
        """The workers report the held request's load failed: its blocks leave vLLM's prefix cache now."""
        held = self._held.get(req_id)
        if held is None:
            return
        held.plan.load_failed(reason)
        if held.written:
            self._evict(set(held.written))
            held.written = []

    def done(self, req_id: str) -> bool:
        """The workers report the request's load finished (vLLM frees its blocks next): its KV given up. False: the
        request is not held."""
        held = self._held.pop(req_id, None)
        if held is not None:
            self._releases.soon(held.plan)
        return held is not None

    def release_all(self) -> None:
        """At shutdown: every held request's KV given up now."""
        for held in self._held.values():
            self._releases.now(held.plan)
        self._held.clear()


def digest(ids: list[int]) -> bytes:
    """A 16-byte digest of token ids (BLAKE2b of their int64 bytes)."""
    return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()


class Covered:
    """The last projected cache fetched per (context, salt, mode, recompute): its token count and their digest;
    least recently used dropped past `capacity` keys. Scheduler thread only."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._known: OrderedDict[CoveredKey, tuple[int, bytes]] = OrderedDict()

    def remember(self, key: CoveredKey, prompt: list[int], cache_tokens: int) -> None:
        """A lookup for `key` received a cache whose `cache_tokens` tokens are the prompt's first ones."""
        if cache_tokens <= 0 or cache_tokens > len(prompt):
            return
        self._known[key] = (cache_tokens, digest(prompt[:cache_tokens]))
        self._known.move_to_end(key)
        while len(self._known) > self.capacity:
            self._known.popitem(last=False)

    def loadable(self, key: CoveredKey, prompt: list[int], block_size: int, recompute: int) -> int | None:
        """What a lookup for `key` would load of this prompt (match_prompt's rule on the remembered cache), or None
        when that is not known here (never fetched, or the prompt does not begin with the remembered tokens)."""
        known = self._known.get(key)
        if known is None:
            return None
        tokens, want = known
        if len(prompt) < tokens or digest(prompt[:tokens]) != want:
            return None
        self._known.move_to_end(key)
        usable = min(tokens - recompute, len(prompt) - 1)
        return max(0, usable) // block_size * block_size

    def __len__(self) -> int:
        return len(self._known)
