"""Errors of the server layer that more than one of its modules raises or maps to a status code. The foundation's
(`NotFound`, `CapacityError`) are in `kvbridge.transfer.errors`; bad input everywhere is a ValueError."""

from __future__ import annotations

__all__ = ["FailedPrecondition"]


class FailedPrecondition(RuntimeError):
    """The request is well formed but the server is not in a state to answer it (no adapter for a pair, ...)."""
