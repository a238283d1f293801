"""A failed call leaves the store as it was: the entries a call created, removed again when it fails.

A request may store several entries before one of its steps is refused: a corrected fetch by text stores the source
entry, its projection and then the correction (whose put may exceed the tenant's quota); a fetch with a prompt stores
the prompt's head and the placed cache; an Ingest with DETECT_SEGMENTS the prefix entry, then its segments; and the
servicer refuses a reply whose header does not fit the client's message limit after the fetch stored what it made.
Each `KVBridgeService` method, and the servicer around a fetch and its reply's checks, runs inside `undone_on_failure`;
every entry a put creates inside it (generation 0) is noted, and when the outermost block raises they are deleted, the
last first, each only while it is at the generation this call stored and no other call has read it
(`PagedStore.delete(if_generation=..., if_owner=...)`, `registry.CALL`: an entry another request stored too,
refreshed, derived something from, found or was served meanwhile is theirs as much, and stays; so does another
entry of the same key, made after this call's went).

A put that only refreshes an entry that was there (generation > 0) is not undone: the entry was the store's before.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
from dataclasses import dataclass, field

from kvbridge.transfer.store.registry import CALL

log = logging.getLogger("kvbridge.server.service")

__all__ = ["created", "undoable", "undone_on_failure"]


@dataclass
class _Journal:
    entries: list[tuple[str, str, int]] = field(default_factory=list)  # (key, tenant, generation), in order stored


_current: contextvars.ContextVar[_Journal | None] = contextvars.ContextVar("kvbridge_undo", default=None)


@contextlib.contextmanager
def undone_on_failure(store):
    """Run a call so that the entries it creates in `store` are deleted again when it raises (nested blocks share
    the outermost one's journal: only that one undoes)."""
    if _current.get() is not None:
        yield
        return
    journal = _Journal()
    token, owning = _current.set(journal), CALL.set(journal)
    try:
        yield
    except BaseException:
        for key, tenant, generation in reversed(journal.entries):
            try:
                store.delete(key, tenant, if_generation=generation, if_owner=journal)
            except Exception:  # the failure the caller sees is the call's own, not this clean-up's
                log.exception("could not undo entry %s of a failed call", key[:16])
        raise
    finally:
        CALL.reset(owning)
        _current.reset(token)


def created(info, tenant: str):
    """Note `info` (what store.put returned) as created by the running call when the put made it (generation 0);
    returns info."""
    journal = _current.get()
    if journal is not None and info.generation == 0:
        journal.entries.append((info.key, tenant, info.generation))
    return info


def undoable(method):
    """A KVBridgeService method run in `undone_on_failure(self.store)`."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with undone_on_failure(self.store):
            return method(self, *args, **kwargs)
    return run
