"""The entry registry: what the store holds, as metadata only (no KV tensors, no locking: the store's lock covers it).

An entry is a stored KVSegment's page table (one block hash per block) plus its tenant namespace, kind, TTL and pin,
and what the caller knows about it: the text its tokens were made from, and — for a derived entry such as a
projection — the key of the entry it was derived from. Three indexes are kept with the entries:
- `users[h]`: the keys of the entries whose page tables hold block hash h (a block no entry uses is dropped);
- `derived[k]`: the keys of the entries derived from entry k (a delete of k removes them too);
- the expiry heap of (expires_at, key); items made stale by a refresh or a removal are skipped when popped.
Invariants (`check`): `users` and `derived` are exactly what the entries' page tables and links say.
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import json
from dataclasses import dataclass, field

import torch
from kvbridge.transfer.errors import NotFound
from kvbridge.transfer.spec import ModelIdentity
from kvbridge.transfer.store.block_pool import PoolLayout
from kvbridge.transfer.store.kv_blocks import BlockHash, Namespace

KINDS = ("prefix", "segment")
_SERIALS = itertools.count(1)  # Entry.serial: one per Entry object made in this process
# the running call (server/undo.py's journal; None outside one): an entry a put creates is that call's until another
# call reads it (Entry.owner), and only then may the call's failure remove it again (PagedStore.delete's if_owner)
CALL: contextvars.ContextVar[object | None] = contextvars.ContextVar("kvbridge_store_call", default=None)


@dataclass(slots=True)
class Entry:
    key: str  # content key (hex)
    namespace: Namespace  # tenant, model, dtype, adapter
    kind: str  # "prefix" | "segment"
    layout: PoolLayout
    model: ModelIdentity
    token_ids: torch.Tensor  # [T] int64, CPU
    positions: torch.Tensor  # [T] int64, CPU
    rotated: bool
    hashes: list[BlockHash]  # page table: one hash per block, the tail block last
    expires_at: float | None
    pinned: bool
    last_access: float
    text: str | None = None  # the text the tokens were made from, when the caller gave it
    source_key: str | None = None  # a derived entry (a projection): the entry it was made from
    annotations: dict = field(default_factory=dict)  # small JSON-able facts the caller keeps with it
    generation: int = 0  # 0 when stored; +1 on every later put or refresh of it (someone else stored it too)
    serial: int = field(default_factory=lambda: next(_SERIALS))  # this object's, never another's: its KV's identity
    # entries shared through Redis: the ids of its records Redis may hold that this replica must not adopt back once
    # the entry expires here (stale_records): the record adopted (if it carries a deadline) or last written here, and
    # those queued since; a write that fails drops its id (Redis holds the one before), one that succeeds the older
    record_ids: list[str] = field(default_factory=list)
    # the tag of its record as Redis held it when last written or read here: a replica that finds the entry's blocks
    # gone from Redis deletes that very record only (redis_records.delete_record_if); None: none known
    record_tag: bytes | None = None
    # when this replica last queued its record (the store's clock; None: never, e.g. an entry adopted from Redis)
    published_at: float | None = None
    # the call that created it while no other call has read it (CALL): a failed call's undo removes only its own
    owner: object | None = None

    def seen(self) -> Entry:
        """Read by the running call: another call's read makes it no call's own (returns self)."""
        if self.owner is not None and self.owner is not CALL.get():
            self.owner = None
        return self


@dataclass(frozen=True, slots=True)
class EntryInfo:
    key: str
    kind: str
    num_tokens: int
    num_blocks: int
    new_blocks: int  # blocks written by this put (the rest were shared or already there)
    pinned: bool
    expires_at: float | None
    tier: str  # where its blocks are: "device", "cpu", "redis" or "mixed"
    model: str = ""  # ModelIdentity.key of the KV
    adapter: str = ""  # the namespace's adapter field ("" for source KV)
    source_key: str | None = None  # the entry this one was derived from
    text: str | None = None  # the text it was made from, when known
    annotations: dict = field(default_factory=dict)
    generation: int = 0  # 0: this put created it; more: stored (or refreshed) again since
    serial: int = 0  # the entry's serial: while it is the same, so is its KV (a new entry of the key gets another)


class EntryRegistry:
    def __init__(self):
        self.entries: dict[str, Entry] = {}
        self.users: dict[BlockHash, set[str]] = {}  # block hash -> keys of the entries using it
        self.derived: dict[str, set[str]] = {}  # source key -> keys of the entries derived from it
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, key); stale items skipped
        self.per_tenant: dict[str, int] = {}  # tenant -> entries it holds

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: str) -> Entry | None:
        entry = self.entries.get(key)
        return entry.seen() if entry is not None else None

    def for_tenant(self, key: str, tenant: str) -> Entry:
        """The tenant's entry of this key; NotFound when there is none (or it is another tenant's)."""
        entry = self.entries.get(key) if isinstance(key, str) else None
        if entry is None or entry.namespace.tenant != tenant:
            raise NotFound(f"no entry {key[:80]!r}" if isinstance(key, str) else "no entry: the key is not a string")
        return entry.seen()

    def keys(self, tenant: str) -> list[str]:
        return [k for k, e in self.entries.items() if e.namespace.tenant == tenant]

    def derived_from(self, key: str, tenant: str) -> list[Entry]:
        """The tenant's entries derived from entry `key` (which may be gone by now: links outlive their source
        until the derived entries go)."""
        keys = sorted(self.derived.get(key, ()))
        return [self.entries[k].seen() for k in keys if self.entries[k].namespace.tenant == tenant]

    def claim(self, key: str, hashes: list[BlockHash]) -> None:
        """Mark the blocks as used by `key` before they are written (so evictions meanwhile cannot drop them)."""
        for h in hashes:
            self.users.setdefault(h, set()).add(key)

    def release(self, key: str, hashes: list[BlockHash]) -> list[BlockHash]:
        """Undo `claim`; returns the hashes no entry uses any more (the caller drops their blocks)."""
        orphans = []
        for h in hashes:
            users = self.users.get(h)
            if users is None:
                continue
            users.discard(key)
            if not users:
                del self.users[h]
                orphans.append(h)
        return orphans

    def add(self, entry: Entry) -> None:
        """Register an entry whose hashes were claimed."""
        self.entries[entry.key] = entry
        tenant = entry.namespace.tenant
        self.per_tenant[tenant] = self.per_tenant.get(tenant, 0) + 1
        if entry.source_key is not None:
            self.derived.setdefault(entry.source_key, set()).add(entry.key)
        self.schedule(entry)

    def schedule(self, entry: Entry) -> None:
        """(Re)start the entry's TTL at its expires_at (None: no expiry)."""
        if entry.expires_at is not None:
            heapq.heappush(self._expiry, (entry.expires_at, entry.key))

    def discard(self, entry: Entry) -> list[BlockHash]:
        """Forget an entry; returns the block hashes no other entry uses."""
        if self.entries.pop(entry.key, None) is not None:
            tenant = entry.namespace.tenant
            self.per_tenant[tenant] -= 1
            if not self.per_tenant[tenant]:
                del self.per_tenant[tenant]
        if entry.source_key is not None:
            siblings = self.derived.get(entry.source_key)
            if siblings is not None:
                siblings.discard(entry.key)
                if not siblings:
                    del self.derived[entry.source_key]
        return self.release(entry.key, entry.hashes)

    def due(self, now: float) -> list[Entry]:
        """Entries whose TTL ran out by `now` (popped from the heap; the caller removes them)."""
        out: dict[str, Entry] = {}
        while self._expiry and self._expiry[0][0] <= now:
            _, key = heapq.heappop(self._expiry)
            entry = self.entries.get(key)
            if entry is not None and entry.expires_at is not None and entry.expires_at <= now:
                out[key] = entry
        return list(out.values())

    def check(self) -> list[str]:
        problems = []
        users: dict[BlockHash, set[str]] = {}
        derived: dict[str, set[str]] = {}
        for entry in self.entries.values():
            for h in entry.hashes:
                users.setdefault(h, set()).add(entry.key)
            if entry.source_key is not None:
                derived.setdefault(entry.source_key, set()).add(entry.key)
        if users != self.users:
            problems.append("the hash -> entries index disagrees with the entries' page tables")
        if derived != self.derived:
            problems.append("the derived-entries index disagrees with the entries' source links")
        per_tenant: dict[str, int] = {}
        for entry in self.entries.values():
            per_tenant[entry.namespace.tenant] = per_tenant.get(entry.namespace.tenant, 0) + 1
        if per_tenant != self.per_tenant:
            problems.append("the per-tenant entry counts disagree with the entries")

        return problems


RECORD_VERSION = 1


def entry_record(entry: Entry, record_id: str) -> bytes:
    """What other replicas need to serve an entry whose blocks they read from Redis: its namespace, kind, layout,
    tokens, positions and text, its source link, this record's id (one per record written), and whether it expires
    (then the record's TTL in Redis is the entry's: replicas that adopt it expire it then). Pins stay local. JSON."""
    positions = entry.positions
    t = entry.token_ids.numel()
    return json.dumps({
        "v": RECORD_VERSION, "id": record_id, "expires": entry.expires_at is not None,
        "key": entry.key, "tenant": entry.namespace.tenant, "model_name": entry.model.name,
        "config_hash": entry.model.config_hash, "dtype": entry.namespace.dtype, "adapter": entry.namespace.adapter,
        "kind": entry.kind, "num_layers": entry.layout.num_layers, "num_kv_heads": entry.layout.num_kv_heads,
        "head_dim": entry.layout.head_dim, "block_size": entry.layout.block_size,
        "token_ids": entry.token_ids.tolist(),
        "positions": None if torch.equal(positions, torch.arange(t)) else positions.tolist(),
        "rotated": entry.rotated, "text": entry.text, "source_key": entry.source_key,
        "annotations": entry.annotations}, separators=(",", ":")).encode()


def parse_record(blob: bytes) -> dict:
    """The fields of an entry record; ValueError when it is not one this version wrote."""
    try:
        record = json.loads(blob)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(record, dict) or record.get("v") != RECORD_VERSION:
        raise ValueError("not a version-1 entry record")
    return record


def info_of(entry: Entry, new_blocks: int, tier: str) -> EntryInfo:
    return EntryInfo(key=entry.key, kind=entry.kind, num_tokens=entry.token_ids.numel(),
                     num_blocks=len(entry.hashes), new_blocks=new_blocks, pinned=entry.pinned,
                     expires_at=entry.expires_at, tier=tier, model=entry.model.key,
                     adapter=entry.namespace.adapter, source_key=entry.source_key, text=entry.text,
                     annotations=dict(entry.annotations), generation=entry.generation,
                     serial=entry.serial)
