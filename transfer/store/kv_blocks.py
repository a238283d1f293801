"""Block hashing and the LRU free queue of the paged KV store.

A block holds `block_size` consecutive tokens of one entry. Its hash chains to its parent's:
`H(parent, block token ids, namespace)`, with blake2b (stable across processes and replicas, unlike `hash()`).
The namespace holds everything that makes two caches of the same tokens differ: tenant, model identity, dtype,
kind (source/projected) and, for projected KV, the adapter id and version. So equal hashes mean equal KV, and a
tenant can never produce (or probe for) another tenant's hashes.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import NewType

import torch

BlockHash = NewType("BlockHash", bytes)  # 16-byte blake2b digest
DIGEST_SIZE = 16


@dataclass(frozen=True, slots=True)
class Namespace:
    """Whose KV, of which model, in which form. Part of every block hash and entry key."""

    tenant: str  # the authenticated tenant; never empty
    model: str  # ModelIdentity.key of the model whose KV space this is
    dtype: str  # e.g. "bfloat16"
    adapter: str = ""  # "" for source KV; "name@version" for projected KV

    def __post_init__(self):
        for name in ("tenant", "model", "dtype"):
            if not getattr(self, name):
                raise ValueError(f"Namespace.{name} must be non-empty")

    def digest(self) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvbridge-ns")
        for part in (self.tenant, self.model, self.dtype, self.adapter):
            data = part.encode()
            h.update(struct.pack("<I", len(data)))
            h.update(data)
        return h.digest()


def _tokens_bytes(tokens: torch.Tensor) -> bytes:
    # tokens: [n] int64 on the CPU
    return tokens.to(torch.int64).contiguous().numpy().tobytes()


def _block_digest(parent: bytes, namespace_digest: bytes, token_bytes: bytes) -> BlockHash:
    # blake2b(namespace ‖ token count ‖ parent ‖ tokens), 16 bytes. No blake2b `person`: it doubles the cost,
    # and the namespace digest already separates the domain.
    h = hashlib.blake2b(namespace_digest + struct.pack("<I", len(token_bytes) // 8), digest_size=DIGEST_SIZE)
    h.update(parent)
    h.update(token_bytes)
    return BlockHash(h.digest())


def hash_block(parent: bytes, tokens: torch.Tensor, namespace_digest: bytes) -> BlockHash:
    """H(parent, block token ids, namespace). tokens: [n] with 1 <= n <= block_size."""
    return _block_digest(parent, namespace_digest, _tokens_bytes(tokens))


def chain_root(namespace_digest: bytes, kind: str, salt: bytes = b"") -> bytes:
    """The parent of a chain's first block: prefix chains share one root per namespace; a segment chain's root is
    its own entry key, so segments (whose KV depends on context the store never saw) share no blocks."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvbridge-root")
    h.update(namespace_digest)
    h.update(kind.encode())
    h.update(salt)
    return h.digest()


def hash_chain(tokens: torch.Tensor, block_size: int, root: bytes, namespace_digest: bytes,
               full_only: bool = False) -> list[BlockHash]:
    """Hashes of consecutive blocks of `tokens` ([T]); the partial tail block is included unless full_only.

    Equal to chaining hash_block over the blocks; the token bytes are made once (this is the lookup hot path).
    """
    data = _tokens_bytes(tokens)
    step = block_size * 8
    end = (tokens.numel() // block_size) * step if full_only else len(data)
    hashes: list[BlockHash] = []
    parent = root
    # The per-block hot loop: every full block starts from the same hashed prefix (namespace ‖ block_size), so
    # copy that state instead of building a hasher (keyword parsing) and a concatenated buffer each time.
    full_prefix = hashlib.blake2b(namespace_digest + struct.pack("<I", block_size), digest_size=DIGEST_SIZE)
    copy, append = full_prefix.copy, hashes.append
    full_end = min(end, (len(data) // step) * step)
    for start in range(0, full_end, step):
        h = copy()
        h.update(parent)
        h.update(data[start:start + step])
        parent = h.digest()  # a BlockHash (NewType is for the type checker only; calling it costs here)
        append(parent)
    if full_end < end:  # the partial tail block
        append(_block_digest(parent, namespace_digest, data[full_end:end]))
    return hashes


def content_key(namespace_digest: bytes, kind: str, tokens: torch.Tensor) -> str:
    """The key of an entry: its namespace, kind and all its tokens. Hex, safe in names and on the wire."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"kvbridge-entry")
    h.update(namespace_digest)
    h.update(kind.encode())
    h.update(_tokens_bytes(tokens))
    return h.hexdigest()


@dataclass(slots=True)
class Block:
    """Metadata of one block of a pool; the KV itself sits in the pool's tensor at row `block_id`."""

    block_id: int  # row in the pool tensor
    ref_cnt: int = 0  # pinned entries + in-flight reads using this block; > 0 means never evicted
    block_hash: BlockHash | None = None  # set while the block holds cached KV (found by lookups)
    stamp: int = 0  # when it last became free or was touched (one process-wide count): LRU order across pools
    prev_free: "Block | None" = None  # intrusive links of the free queue (None when not queued)
    next_free: "Block | None" = None


class FreeBlockQueue:
    """Doubly linked list of blocks with ref_cnt == 0, least recently used first. O(1) append, pop, remove.

    Blocks never used or whose KV was dropped go to the front (taken first); cached blocks released by a reader
    go to the back. Releasing an entry's blocks tail-first makes its chain's tail the first to be evicted.
    """

    def __init__(self, blocks: list[Block]):
        self._head = Block(-1)  # sentinels
        self._tail = Block(-2)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def _insert_after(self, anchor: Block, block: Block) -> None:
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} is already queued"
        nxt = anchor.next_free
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self.num_free += 1

    def append(self, block: Block) -> None:
        """Most recently used end (evicted last)."""
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: Block) -> None:
        """Least recently used end (taken next)."""
        self._insert_after(self._head, block)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def replace(self, old: Block, new: Block) -> None:
        """Put `new` (not queued) where `old` is, and take `old` out: a block moved to another row keeps its place."""
        prev = old.prev_free
        self.remove(old)
        self._insert_after(prev, new)

    def first(self) -> Block:
        """The least recently used block; the tail sentinel (block_id -2, no hash, nothing after) when empty."""
        return self._head.next_free

    def popleft(self) -> Block:
        if self.num_free == 0:
            raise IndexError("no free blocks")
        block = self._head.next_free
        self.remove(block)
        return block

    def contains(self, block: Block) -> bool:
        return block.prev_free is not None

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_free
