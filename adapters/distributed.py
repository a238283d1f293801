"""`train-adapter` under torchrun: the process group and the few collectives the chain and fuser trainers need.

    torchrun --standalone --nproc-per-node 2 -m kvbridge.adapters.cli --trainer chain --corpus FILE... --work W

Every rank runs the same command over the same window list; the work folder is shared (one node, or a filesystem
every node sees). What is split and what is combined:

  teacher cache   of the windows not cached yet, rank r teacher-forwards windows[r::world] into the folder and lists
                  them in an index part; rank 0 merges the parts into index.json (`build_teacher_cache`).
  closed form     each rank sums the statistics (XᵀX, XᵀY, Σy² in float64, the token count) of its share of the
                  windows; an all-reduce makes them the sums over all windows, and every rank solves the same
                  system (`reduce_stats`, called by `residual.accumulate`).
  SGD stages      each step's global batch (the windows one process would draw) is split by rank; a rank's loss is
                  scaled by its share of the batch and the gradients are summed (`reduce_gradients`): the global
                  batch's gradient, so the same step as one process takes. The maps are checked equal on every rank
                  at the start and the end of a stage (`check_same`).
  dev recovery    rank 0 scores and sends its record row to the others (`from_main`).
  files           rank 0 writes checkpoints, records, the adapter and the printed log; every rank reads a checkpoint.

Collectives go over gloo for CPU tensors and NCCL for CUDA ones ("cpu:gloo,cuda:nccl" when the ranks run on GPUs).
Outside a process group (no torchrun) every function here is the identity or does nothing: world size 1.
Invariant: inside a group, the functions that call these (`accumulate`, `trainer.train`, `build_teacher_cache`) are
collective — every rank calls them in the same order with the same arguments.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from kvbridge.adapters.teacher import TeacherCache, TeacherConfig, Window
from kvbridge.transfer.devices import resolve_device
from kvbridge.transfer.models import LoadedModel

_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class Launch:
    """Where torchrun put this process (its RANK, WORLD_SIZE and LOCAL_RANK environment variables)."""

    rank: int  # among all processes
    world_size: int
    local_rank: int  # among the processes of this node: which of its GPUs

    @classmethod
    def from_env(cls, env: dict | None = None) -> Launch | None:
        """The launch of this process, or None when no launcher set RANK / WORLD_SIZE."""
        env = os.environ if env is None else env
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return None
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            local = int(env.get("LOCAL_RANK", rank))
        except (KeyError, ValueError):
            raise ValueError("a distributed launch needs integer RANK and WORLD_SIZE (and LOCAL_RANK) in the "
                             f"environment, got RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}"
                             ) from None
        if not 0 <= rank < world:
            raise ValueError(f"RANK must be in [0, WORLD_SIZE), got RANK={rank} WORLD_SIZE={world}")
        return cls(rank, world, local)

    def device(self, device: str) -> str:
        """This rank's device: "auto" or "cuda" (no index) -> cuda:LOCAL_RANK; anything else as given."""
        dev = resolve_device(device)
        if dev.type != "cuda" or dev.index is not None:
            return str(dev)
        count = torch.cuda.device_count()
        if self.local_rank >= count:
            raise ValueError(f"rank {self.rank} is process {self.local_rank} of its node, which has {count} GPU(s): "
                             f"start at most {count} per node (--nproc-per-node) or name one GPU (--device cuda:0)")
        return f"cuda:{self.local_rank}"


def backend(device: str) -> str:
    """gloo for ranks on CPUs; on GPUs NCCL for CUDA tensors and gloo for the CPU ones (statistics, maps on CPU)."""
    return "cpu:gloo,cuda:nccl" if torch.device(device).type == "cuda" else "gloo"


@contextmanager
def process_group(launch: Launch | None, device: str) -> Iterator[None]:
    """The default process group for the block when launched by torchrun (nothing otherwise): on leaving the block
    normally the ranks meet at a barrier; normally or by an exception, the group is destroyed."""
    if launch is None:
        yield
        return
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend(device), rank=launch.rank, world_size=launch.world_size)
    try:
        yield
        barrier()
    finally:
        dist.destroy_process_group()


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0 (or no process group): the process that writes files and prints."""
    return rank() == 0


def shard(items: list) -> list:
    """This rank's strided share items[rank::world] (all of them at world size 1)."""
    return items if world_size() == 1 else items[rank()::world_size()]


def barrier() -> None:
    """Every rank waits for the others (a CPU all-reduce, so it goes over gloo wherever the ranks compute)."""
    if world_size() > 1:
        dist.all_reduce(torch.zeros(1, device=_CPU))


def sum_tensors(tensors: Iterable[torch.Tensor]) -> None:
    """Replace every tensor by its sum over the ranks, in place."""
    if world_size() > 1:
        for t in tensors:
            dist.all_reduce(t)


def summed(value: torch.Tensor) -> float:
    """A scalar tensor summed over the ranks, as a float."""
    if world_size() == 1:
        return value.item()
    t = value.detach().to(_CPU, torch.float64).reshape(1)
    dist.all_reduce(t)
    return t.item()


def from_main(obj):
    """Rank 0's `obj` on every rank (picklable; what the others pass is ignored)."""
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, device=_CPU)
    return box[0]


def reduce_stats(stats):
    """`fit.RidgeStats` or `fit.JointStats` holding this rank's windows -> the sums over every rank's windows (in
    place; returned)."""
    if world_size() > 1:
        sum_tensors(stats.sums())
        count = torch.tensor([stats.count], dtype=torch.int64)
        dist.all_reduce(count)
        stats.count = int(count)
    return stats


def reduce_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Sum the gradients over the ranks, in one flat all-reduce per device. Every rank's loss is its share of the
    global batch's mean, so the sum is the global batch's gradient. Parameters without a gradient (unused by the
    objective, on every rank alike) keep none."""
    if world_size() == 1:
        return
    by_device: dict[torch.device, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            by_device.setdefault(p.grad.device, []).append(p)
    for group in by_device.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        dist.all_reduce(flat)
        offset = 0
        for p in group:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()


def check_same(tensors: dict[str, torch.Tensor | None], what: str) -> None:
    """Raise RuntimeError when the ranks hold different `tensors` (compared by a float64 checksum of each)."""
    if world_size() == 1:
        return
    names = [n for n, t in tensors.items() if t is not None]
    sums = torch.stack([torch.stack((tensors[n].double().sum(), tensors[n].double().abs().sum())).cpu()
                        for n in names])  # [n, 2]
    low, high = sums.clone(), sums.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = [n for n, lo, hi in zip(names, low, high) if not torch.equal(lo, hi)]
    if differ:
        raise RuntimeError(f"the {world_size()} ranks hold different {what}: {differ[:5]} (each rank must read the "
                           "same checkpoint and apply the same summed gradients)")


def build_teacher_cache(root: str | Path, source: LoadedModel, target: LoadedModel, windows: list[Window],
                        config: TeacherConfig, start_token: int, progress: bool = True,
                        cache_class: type[TeacherCache] = TeacherCache, kv_ids: set[str] | None = None,
                        corpus: dict | None = None) -> tuple[TeacherCache, list[int]]:
    """`TeacherCache.build` split over the ranks: each computes its strided share of the missing windows into the
    shared folder, then rank 0 merges the index parts (the windows listed in `windows` order, as one process lists
    them). Returns the cache, every window listed, on every rank, and the windows each rank computed. cache_class:
    the kind of windows (answer_windows.AnswerCache: its config is an AnswerConfig); kv_ids: the windows that keep the
    target's own KV, corpus: what the windows were cut from (TeacherCache.build)."""
    if world_size() == 1:
        cache = cache_class(root)
        return cache, [cache.build(source, target, windows, config, start_token, progress, kv_ids=kv_ids,
                                   corpus=corpus)["windows"]]
    if is_main():
        cache_class(root).merge_parts()  # the parts an interrupted sharded build left
    barrier()
    made = cache_class(root).build(source, target, windows, config, start_token, progress,
                                    part=(rank(), world_size()), kv_ids=kv_ids, corpus=corpus)["windows"]
    counts = torch.zeros(world_size(), dtype=torch.int64)
    counts[rank()] = made
    dist.all_reduce(counts)
    if is_main():
        cache_class(root).merge_parts([w.id for w in windows])
    barrier()
    return cache_class(root), counts.tolist()
