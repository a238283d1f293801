"""Errors the foundation raises that the layers above catch by type (the server maps them to status codes)."""

from __future__ import annotations

__all__ = ["NotFound", "CapacityError"]


class NotFound(KeyError):
    """No such entry for this tenant (also when it exists for another tenant: the two are indistinguishable)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class CapacityError(RuntimeError):
    """Not enough evictable blocks for a request (everything else is pinned or in use)."""
