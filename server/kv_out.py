"""Where a fetch may write its KV straight away (server/projecting.py, server/prompt_place.py): the KVOut protocol a
same-host segment (shm_segments.PendingSegment) and a streamed fetch's buffers implement, and OnceOut, which offers it
to one store read of a fetch at most."""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["KVOut", "OnceOut", "fresh"]


class KVOut(Protocol):
    """Where a fetch may write its KV straight away (a same-host shared-memory segment) instead of a new tensor."""

    def reuse(self, tag: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The KV named by tag (the store entry and its serial) when the destination holds it already from an earlier
        fetch (in the fetch's dtype; `dtype` is the KV's own): nothing to read from the store; None: fill tensor()."""

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """A CPU buffer of that shape ([L, 2, H, T, D]) and dtype to fill, contiguous or the first T slots of each
        row of a larger one; None: make a tensor as usual."""

    def written(self, start: int, end: int) -> None:
        """Layers [start, end) of the buffer are final (they are written in order)."""


class OnceOut:
    """A fetch's KVOut as its store reads see it: once one read has used it (reuse or tensor, then lost its entry:
    evicted or deleted before its gather), the fetch's later reads get none (`fresh`): a same-host segment is given
    its buffer once, and the fetch's KV is copied in when it is published."""

    def __init__(self, out: KVOut):
        self.out, self.used = out, False

    def reuse(self, tag: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        self.used = True
        return self.out.reuse(tag, shape, dtype)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        self.used = True
        return self.out.tensor(shape, dtype)

    def written(self, start: int, end: int) -> None:
        self.out.written(start, end)


def fresh(out: OnceOut | None) -> OnceOut | None:
    """The fetch's KVOut while no store read has used it; None after."""
    return None if out is None or out.used else out
