"""The connector's methods called the way vLLM 0.32's scheduler and model runner call them, with no engine: run in the
vLLM venv by tests/test_vllm_connector.py (`python vllm_connector_checks.py`), on a stand-in for the VllmConfig
fields the connector reads and vLLM's own KVCacheConfig and KVConnectorOutput. Prints one JSON object, check name ->
"ok" or the failure's traceback. No kvbridge server: every check stops before a fetch would reach one.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import tempfile
import time
import traceback
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import torch
from kvbridge.server import shm_layout
from kvbridge.server.replies import SharedSegment
from kvbridge.vllm import handoff
from kvbridge.vllm.connector import KVBridgeConnector
from kvbridge.vllm.layouts import write_cpu_vec
from kvbridge.vllm.plans import Plan
from kvbridge.vllm.saving import SaveChunk
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput

L, H, D, BLOCK = 2, 2, 8, 32
STAGING = tempfile.mkdtemp(prefix="kvbridge-checks-")


class Warnings(logging.Handler):
    """The connector's log lines, kept."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("kvbridge.vllm").addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())


def connector(role: KVConnectorRole, cache_dtype: str = "auto", kv_role: str = "kv_both", async_scheduling=False,
              idle_wait_ms: float = 0, tensor_parallel_size: int = 1, address: str = "127.0.0.1:1",
              shape: tuple[int, int, int] = (L, H, D)) -> KVBridgeConnector:
    """A connector of a bfloat16 model (`shape`: layers, KV heads, head dim) with one full-attention group of
    BLOCK-token blocks, prefix caching on, and a server at `address` (by default one nothing listens at)."""
    layers, heads, head_dim = shape
    transfer = SimpleNamespace(kv_connector_extra_config={"kvbridge_address": address,
                                                          "kvbridge_staging_dir": STAGING,
                                                          "kvbridge_idle_wait_ms": idle_wait_ms},
                               kv_load_failure_policy="recompute", kv_role=kv_role,
                               is_kv_producer=kv_role in ("kv_producer", "kv_both"))
    model = SimpleNamespace(get_num_layers=lambda parallel: layers, get_num_kv_heads=lambda parallel: heads,
                            get_head_size=lambda: head_dim, dtype=torch.bfloat16, model="no-model-folder")
    config = SimpleNamespace(kv_transfer_config=transfer, model_config=model,
                             parallel_config=SimpleNamespace(tensor_parallel_size=tensor_parallel_size,
                                                             pipeline_parallel_size=1),
                             scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
                             cache_config=SimpleNamespace(block_size=BLOCK, enable_prefix_caching=True,
                                                          cache_dtype=cache_dtype))
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=heads, head_size=head_dim,
                             dtype=torch.uint8 if cache_dtype.startswith("fp8") else torch.bfloat16)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(layers)], spec)]
    return KVBridgeConnector(config, role, KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups))


def request(req_id: str, params, prompt_len: int = 100) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, prompt_token_ids=list(range(prompt_len)),
                           cache_salt="salt")


def answer(sched: KVBridgeConnector, req, computed: int = 0) -> tuple[int | None, bool]:
    """get_num_new_matched_tokens until the lookup (if any) has ended, as the scheduler asks again each step."""
    for _ in range(500):
        got = sched.get_num_new_matched_tokens(req, computed)
        if got[0] is not None:
            return got
        time.sleep(0.01)
    raise AssertionError("the lookup never ended")


def finished(sched: KVBridgeConnector, req) -> dict:
    _, params = sched.request_finished(req, [])
    return params["kvbridge"]


def check_malformed_parameters_never_reach_the_scheduler_thread():
    """A malformed context on a request that vLLM's prefix cache partly covers (num_computed_tokens > 0, the path
    that hashes the context): 0 tokens and a warning naming the field, never an exception."""
    sched, warned = connector(KVConnectorRole.SCHEDULER), Warnings()
    for i, params in enumerate(({"kvbridge": {"key": ["x"]}}, {"kvbridge": {"text": "t", "server": {"a": 1}}},
                                {"kvbridge": {"key": "k", "adapter": ["a"]}}, "kvbridge", ["kvbridge"])):
        req = request(f"bad{i}", params)
        assert sched.get_num_new_matched_tokens(req, 64) == (0, False), params
        error = finished(sched, req)["error"]
        assert "must be" in error and error in warned.lines[-1], (error, warned.lines[-1:])
    assert "'key'" in warned.lines[0] and "'server'" in warned.lines[1] and "'adapter'" in warned.lines[2]
    # whatever else a request's parameters make fail on the way to its lookup: that request gets 0 tokens
    def broken(*args):
        raise RuntimeError("unexpected")

    sched._covered.loadable = broken
    req = request("odd", {"kvbridge": {"key": "k"}})
    assert sched.get_num_new_matched_tokens(req, 64) == (0, False)
    assert "unexpected" in finished(sched, req)["error"]
    sched.shutdown()
    # a save beside a load's fields, or beside an unknown one, is refused by name (it was taken for a save, silently)
    both = connector(KVConnectorRole.SCHEDULER, kv_role="kv_both")
    for i, (params, named) in enumerate((({"kvbridge": {"save": {}, "key": "k"}}, "goes alone"),
                                         ({"kvbridge": {"save": {}, "typo": 1}}, "unknown fields ['typo']"))):
        req = request(f"mixed{i}", params)
        assert both.get_num_new_matched_tokens(req, 0) == (0, False)
        answer = finished(both, req)
        assert named in answer["error"] and "save_state" not in answer, answer
    both.shutdown()


def check_the_worker_drops_the_partial_save_of_a_finished_request():
    """get_finished (through get_transfer_results, as the model runner calls it) drops the saver's partial buffer
    of a request that finished (aborted) before its last chunk."""
    worker = connector(KVConnectorRole.WORKER)
    cache = torch.zeros(8, H, BLOCK, 2 * D, dtype=torch.bfloat16)  # the CPU layout, [blocks, H_kv, block_size, 2 D]
    chunk = SaveChunk("aborted", "default", [1, 2, 3], 0, 64, 96)
    for index in range(L):
        worker._saver.save_layer(index, L, SimpleNamespace(isa="vec"), cache, [chunk])
    worker._saver.step_done([chunk])
    assert set(worker._saver._kv) == {"aborted"}
    worker.get_transfer_results({"aborted"})
    assert worker._saver._kv == {}
    worker.shutdown()


def check_a_quantized_kv_cache_is_refused_by_name():
    """--kv-cache-dtype fp8: the connector says so at its start and loads nothing (a request gets 0 tokens and the
    reason; it would have cast bf16 KV into fp8 bytes); the workers save nothing."""
    warned = Warnings()
    sched = connector(KVConnectorRole.SCHEDULER, cache_dtype="fp8")
    assert "fp8" in sched.kv_cache_refusal and any("fp8" in line for line in warned.lines)
    req = request("r", {"kvbridge": {"key": "k"}})
    assert answer(sched, req) == (0, False)
    assert "fp8" in finished(sched, req)["error"]
    req = request("save", {"kvbridge": {"save": {}}})  # a save is refused as well: its answer says so
    assert answer(sched, req) == (0, False)
    assert "fp8" in finished(sched, req)["error"]
    sched.shutdown()
    own = connector(KVConnectorRole.SCHEDULER, cache_dtype="bfloat16")  # the model's own dtype, named
    assert own.kv_cache_refusal == ""
    own.shutdown()
    worker = connector(KVConnectorRole.WORKER, cache_dtype="fp8")
    chunk = SaveChunk("s", "default", [1], 0, 32, 32, list(range(32)))
    worker._saver.save_layer(0, L, SimpleNamespace(isa="vec"), torch.zeros(8, H, BLOCK, 2 * D, dtype=torch.uint8),
                             [chunk])
    worker._saver.step_done([chunk])
    assert worker._saver._kv == {} and "fp8" in warned.lines[-1], warned.lines[-1:]
    worker.shutdown()


def loaded_plan(sched: KVBridgeConnector, req_id: str, source, sync: bool = True):
    """A request whose lookup found 64 tokens: answered, allocated, handed to the workers in a step's metadata."""
    sched.sync_loads = sync
    sched._plans[req_id] = Plan(source=source, loadable=64, server="default", received_at=time.monotonic())
    req = request(req_id, {"kvbridge": {"key": "k"}})
    assert sched.get_num_new_matched_tokens(req, 0) == (64, not sync)
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3, 4],))
    sched.update_state_after_alloc(req, blocks, 64)
    return req


def step_meta(sched: KVBridgeConnector, tokens: int = 64):
    """build_connector_meta of a step that schedules `tokens` (of requests that neither save nor load)."""
    return sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                                                      scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
                                                      total_num_scheduled_tokens=tokens))


class Layer:
    """An attention layer as start_load_kv finds it: its paged buffer and the CPU backend's cache writer."""

    def __init__(self):
        self.kv_cache = torch.zeros(8, H, BLOCK, 2 * D, dtype=torch.bfloat16)  # [blocks, H_kv, block_size, 2 D]
        self.impl = SimpleNamespace(do_kv_cache_update=lambda layer, key, value, cache, slots:
                                    write_cpu_vec(cache, key, value, slots))


def worker_step(worker: KVBridgeConnector, meta, layers: dict[str, Layer], finished=frozenset()) -> KVConnectorOutput:
    """The model runner's step on the worker side (`_get_kv_connector_output`): loads, then what it reports;
    `finished`: the step's scheduler_output.finished_req_ids."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(SimpleNamespace(no_compile_layers=layers))
    results = worker.get_transfer_results(set(finished))
    output = KVConnectorOutput(finished_recving=results.finished_recving, failed_recving=results.failed_recving,
                               invalid_block_ids=worker.get_block_ids_with_load_errors(),
                               kv_connector_worker_meta=worker.build_connector_worker_meta())
    worker.clear_connector_metadata()
    return output


def check_a_load_that_failed_on_the_worker_is_reported_as_failed():
    """A synchronous load whose KV is gone when the worker reads it (vLLM recomputes its blocks) and an asynchronous
    one (a failed receive): each request's kvbridge answer says 0 tokens loaded and why; a load that worked says
    its tokens."""
    sched, worker = connector(KVConnectorRole.SCHEDULER), connector(KVConnectorRole.WORKER)
    layers = {f"model.layers.{i}.self_attn.attn": Layer() for i in range(L)}
    gone = str(Path(STAGING) / "gone.safetensors")
    for req_id, sync in (("sync", True), ("async", False)):
        req = loaded_plan(sched, req_id, gone, sync)
        output = worker_step(worker, step_meta(sched), layers)
        assert output.invalid_block_ids == ({1, 2} if sync else set())
        assert output.failed_recving == (set() if sync else {"async"})
        sched.update_connector_output(output)  # what vLLM's scheduler hands the scheduler side
        got = finished(sched, req)
        assert got["loaded_tokens"] == 0 and "gone.safetensors" in got["error"], got
    kv = torch.randn(L, 2, H, 64, D, dtype=torch.bfloat16)  # [L, 2, H_kv, T, D]
    req = loaded_plan(sched, "fine", str(handoff.stage(kv, handoff.private_folder(STAGING))))
    output = worker_step(worker, step_meta(sched), layers)
    assert not output.invalid_block_ids and all(layer.kv_cache[1:3].any() for layer in layers.values())
    sched.update_connector_output(output)
    got = finished(sched, req)
    assert got["loaded_tokens"] == 64 and got["error"] == "", got
    sched.shutdown()
    worker.shutdown()


def check_a_segment_past_its_ttl_is_fetched_again_not_loaded():
    """A request that waited for blocks until the server's segment was (nearly) past its TTL: the connector looks it
    up again (None: pending) instead of handing the workers a file the server has removed; a fresh one loads."""
    from kvbridge.server.replies import SharedSegment

    sched = connector(KVConnectorRole.SCHEDULER)
    segment = SharedSegment(path=str(Path(STAGING) / "kvbridge-x" / "s.safetensors"), name="s", size=1, checksum="",
                            shape=(L, 2, H, 64, D), dtype="bfloat16", ttl_s=30.0)
    for req_id, age, want in (("fresh", 1.0, (64, False)), ("stale", 29.0, (None, False))):
        sched._plans[req_id] = Plan(source=segment, loadable=64, server="default",
                                    received_at=time.monotonic() - age)
        req = request(req_id, {"kvbridge": {"key": "k"}})
        assert sched.get_num_new_matched_tokens(req, 0) == want, (req_id, want)
    assert req_id in sched._lookups and "stale" not in sched._plans  # looked up again (no server here: 0 tokens)
    assert answer(sched, req) == (0, False)
    sched.shutdown()


def check_a_lookup_whose_kv_another_request_loaded_meanwhile_says_prefix_cached():
    """Identical requests submitted together each look up; once the first has loaded, vLLM's prefix cache holds the
    others' tokens, which load none: their answers said 0 loaded and nothing of why (prefix_cached 0)."""
    from kvbridge.server.replies import SharedSegment

    sched = connector(KVConnectorRole.SCHEDULER)
    segment = SharedSegment(path=str(Path(STAGING) / "kvbridge-x" / "s.safetensors"), name="s", size=1, checksum="",
                            shape=(L, 2, H, 64, D), dtype="bfloat16", ttl_s=30.0)
    for req_id, computed in (("late", 64), ("later", 96)):  # vLLM's cache may hold more than the lookup found
        sched._plans[req_id] = Plan(source=segment, loadable=64, server="default", received_at=time.monotonic())
        req = request(req_id, {"kvbridge": {"key": "k"}})
        assert sched.get_num_new_matched_tokens(req, computed) == (0, False)
        got = finished(sched, req)
        assert got["loaded_tokens"] == 0 and got["prefix_cached"] == computed and got["error"] == "", got
    sched.shutdown()


class Scheduler:
    """vLLM 0.32's scheduler around the scheduler-side connector, as far as these checks need: request_finished's
    True keeps the request and its blocks until the workers name it in finished_recving (an id it no longer keeps
    there fails `_update_from_kv_xfer_finished`'s assertion); a request's blocks stay in the prefix cache once freed
    (a synchronous load's are hashed when allocated) unless evicted (`KVCacheManager.evict_blocks`, bound by
    `bind_kv_cache_manager`); the next step's finished_req_ids name the requests finished since the last step."""

    def __init__(self, sched: KVBridgeConnector):
        self.connector, self.kept, self.cached, self.finished = sched, set(), set(), set()
        self.block_pool = None
        sched.bind_kv_cache_manager(self)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.cached -= block_ids

    def finish(self, req, block_ids: list[int]) -> dict:
        keep, params = self.connector.request_finished(req, block_ids)
        if keep:
            self.kept.add(req.request_id)
        self.finished.add(req.request_id)
        return params

    def update(self, output: KVConnectorOutput) -> None:
        self.connector.update_connector_output(output)
        for req_id in output.finished_recving or ():
            assert req_id in self.kept, f"finished_recving names {req_id}, a request vLLM no longer keeps"
            self.kept.remove(req_id)

    def step_finished(self) -> set[str]:
        finished, self.finished = self.finished, set()
        return finished


class Server:
    """A kvbridge server's side of its segments: ReleaseSegment removes the file."""

    def __init__(self):
        self.released: list[str] = []

    def release_segment(self, segment: SharedSegment) -> None:
        self.released.append(segment.name)
        Path(segment.path).unlink(missing_ok=True)

    def close(self) -> None:
        pass


def segment(name: str, kv: torch.Tensor, corrupt: bool = False) -> SharedSegment:
    """A same-host server's segment of kv [L, 2, H, T, D] (a wrong checksum if `corrupt`)."""
    folder = Path(STAGING) / "kvbridge-server"
    folder.mkdir(exist_ok=True)
    path = folder / f"{name}.safetensors"
    size, checksum = shm_layout.write(path, kv)
    return SharedSegment(path=str(path), name=name, size=size, checksum=checksum + ("0" if corrupt else ""),
                         shape=tuple(kv.shape), dtype="bfloat16", ttl_s=30.0)


def released(sched: KVBridgeConnector, server: Server) -> list[str]:
    """The segments released so far (the connector's release thread drained first)."""
    sched._releases._pool.submit(lambda: None).result()
    return server.released


def check_an_abort_under_async_scheduling_keeps_the_segment_until_the_worker_read_it():
    """vLLM 0.32 with async scheduling takes an abort while the step that carries a request's synchronous load is
    queued (`EngineCore.step_with_batch_queue`): the server's segment stays until the worker has read it (vLLM keeps
    the request's blocks until then: request_finished answers True, the workers report the request finished in the
    step after its finish). A request that finished normally and an asynchronous load's aborted request likewise."""
    sched, worker = connector(KVConnectorRole.SCHEDULER, async_scheduling=True), connector(KVConnectorRole.WORKER)
    server, vllm = Server(), Scheduler(sched)
    sched._clients["default"] = server
    layers = {f"model.layers.{i}.self_attn.attn": Layer() for i in range(L)}
    kv = torch.randn(L, 2, H, 64, D, dtype=torch.bfloat16)  # [L, 2, H_kv, T, D]
    for req_id, sync, abort in (("aborted", True, True), ("done", True, False), ("async", False, True)):
        req = loaded_plan(sched, req_id, segment(req_id, kv), sync)
        meta = step_meta(sched)  # step N: the load goes to the workers
        if abort:  # before the worker runs step N
            vllm.finish(req, [1, 2, 3, 4])
            assert released(sched, server) == [], (req_id, server.released)
        output = worker_step(worker, meta, layers)  # step N
        assert not output.invalid_block_ids and not output.failed_recving, (req_id, output)
        vllm.update(output)
        if not abort:
            vllm.finish(req, [1, 2, 3, 4])
        vllm.update(worker_step(worker, step_meta(sched, 0), layers, vllm.step_finished()))  # step N+1
        assert vllm.kept == set() and released(sched, server) == [req_id], (req_id, vllm.kept, server.released)
        server.released.clear()
    assert all(layer.kv_cache[1:3].any() for layer in layers.values())
    sched.shutdown()
    worker.shutdown()


def check_a_failed_load_of_a_finished_request_leaves_the_prefix_cache():
    """A synchronous load's blocks are in vLLM's prefix cache from their allocation, under the request's salt; with
    kv_load_failure_policy "recompute" vLLM evicts none when the load fails, counting on the request to compute them
    again, which an aborted request never does: the connector evicts them and those computed after them. Aborted
    before its load ran, or after vLLM had cut the request's computed tokens at a failure (request_finished then
    gets fewer blocks than the load wrote)."""
    sched, worker = connector(KVConnectorRole.SCHEDULER, async_scheduling=True), connector(KVConnectorRole.WORKER)
    server, vllm = Server(), Scheduler(sched)
    sched._clients["default"] = server
    layers = {f"model.layers.{i}.self_attn.attn": Layer() for i in range(L)}
    kv = torch.randn(L, 2, H, 64, D, dtype=torch.bfloat16)  # [L, 2, H_kv, T, D]
    for req_id, abort_before in (("early", True), ("late", False)):
        req = loaded_plan(sched, req_id, segment(req_id, kv, corrupt=True))
        vllm.cached = {1, 2, 3}  # hashed at allocation: 64 loaded and 36 computed tokens, three full blocks
        meta = step_meta(sched)
        if abort_before:
            vllm.finish(req, [1, 2, 3, 4])
        output = worker_step(worker, meta, layers)
        assert output.invalid_block_ids == {1, 2}
        vllm.update(output)
        if not abort_before:  # vLLM cut its computed tokens at the failed block 1: none left
            vllm.finish(req, [])
        assert vllm.cached == set(), (req_id, vllm.cached)
        vllm.update(worker_step(worker, step_meta(sched, 0), layers, vllm.step_finished()))
        assert vllm.kept == set() and released(sched, server) == [req_id], (req_id, vllm.kept, server.released)
        server.released.clear()
    sched.shutdown()
    worker.shutdown()


def check_an_empty_step_under_async_scheduling_waits_only_when_nothing_runs():
    """A step that schedules nothing while a lookup runs waits for it (kvbridge_idle_wait_ms). With async scheduling
    the scheduler schedules step N+1 while step N runs: an empty N+1 must not wait (N's output would wait with it);
    an empty step after an empty one may. Without async scheduling every empty step may."""
    calls, wait = [], concurrent.futures.wait

    def recorded(fs, timeout=None, return_when=concurrent.futures.ALL_COMPLETED):
        calls.append(timeout)
        return wait(fs, 0, return_when)

    concurrent.futures.wait = recorded
    try:
        for async_scheduling, want in ((True, [None, 0.05]), (False, [0.05, 0.05])):
            sched = connector(KVConnectorRole.SCHEDULER, async_scheduling=async_scheduling, idle_wait_ms=50)
            sched._lookups["pending"] = Future()  # a lookup still running
            got = []
            for tokens in (64, 0, 0):
                calls.clear()
                step_meta(sched, tokens)
                got.append(calls[0] if calls else None)
            assert got[1:] == want, (async_scheduling, got)
            del sched._lookups["pending"]
            sched.shutdown()
    finally:
        concurrent.futures.wait = wait


def check_a_save_answer_says_queued_and_the_workers_count_uploads():
    """A save's upload ends after its request's answer: the answer keeps saved_tokens (handed to the upload) and
    says "save_state": "queued" ("incomplete" for a request that ended first); the workers count stored and failed
    uploads in vLLM's KV connector stats."""
    sched = connector(KVConnectorRole.SCHEDULER)
    for req_id, scheduled in (("whole", 64), ("ended", 0)):
        req = request(req_id, {"kvbridge": {"save": {}}}, prompt_len=64)
        assert answer(sched, req) == (0, False)
        sched.build_connector_meta(SimpleNamespace(
            scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=0, block_ids=([1, 2],))],
            num_scheduled_tokens={req_id: scheduled}, total_num_scheduled_tokens=scheduled,
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                  num_computed_tokens=[])))
        got = finished(sched, req)
        assert (got["saved_tokens"], got["save_state"]) == ((64, "queued") if scheduled else (0, "incomplete")), got
    sched.shutdown()

    class Uploads:
        def __init__(self, fail: bool):
            self.fail = fail

        def put_kv(self, kv, token_ids, model, config_hash):
            if self.fail:
                raise RuntimeError("the server refused it")
            return SimpleNamespace(key="k" * 64)

        def close(self):
            pass

    worker = connector(KVConnectorRole.WORKER)
    worker._saver._models["default"] = ("source", "hash")
    cache = torch.zeros(8, H, BLOCK, 2 * D, dtype=torch.bfloat16)  # [blocks, H_kv, block_size, 2 D]
    for fail, want in ((False, {"saves_stored": 1, "saved_tokens_stored": 64, "saves_failed": 0}),
                       (True, {"saves_stored": 0, "saved_tokens_stored": 0, "saves_failed": 1})):
        worker._saver._clients["default"] = Uploads(fail)
        chunk = SaveChunk("s", "default", [1, 2], 0, 64, 64, list(range(64)))
        for index in range(L):
            worker._saver.save_layer(index, L, SimpleNamespace(isa="vec"), cache, [chunk])
        worker._saver.step_done([chunk])
        worker._saver._uploads.submit(lambda: None).result()  # the upload thread drained
        stats = worker.get_kv_connector_stats()
        assert stats is not None and stats.reduce() == want, (fail, stats)
        assert worker.get_kv_connector_stats() is None  # counted once
        logged = KVBridgeConnector.build_kv_connector_stats(stats.data)  # what vLLM's stat logger rebuilds
        assert logged.aggregate(KVBridgeConnector.build_kv_connector_stats(stats.data)).reduce() == {
            name: 2 * count for name, count in want.items()}
    worker.shutdown()


def check_tensor_parallelism_is_refused_at_construction():
    """No role splits KV heads over workers: tensor_parallel_size 2 stops the connector's construction (the engine's
    start) with a ValueError naming it, not each request with a warning."""
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        try:
            made = connector(role, tensor_parallel_size=2)
        except ValueError as exc:
            assert "tensor_parallel_size is 2" in str(exc), exc
        else:
            made.shutdown()
            raise AssertionError(f"{role}: a connector with tensor_parallel_size 2 was made")


if __name__ == "__main__":
    results = {}
    for name, check in [(n, f) for n, f in globals().items() if n.startswith("check_")]:
        try:
            check()
            results[name.removeprefix("check_")] = "ok"
        except Exception:  # noqa: BLE001 - reported per check
            results[name.removeprefix("check_")] = traceback.format_exc()
    shutil.rmtree(STAGING, ignore_errors=True)
    print(json.dumps(results))
