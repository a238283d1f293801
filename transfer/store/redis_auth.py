"""What the Redis tier writes is signed, and what it reads is verified, with a secret the replicas share.

Anyone who can write to the Redis instance could otherwise plant KV or entry records for any tenant: block hashes and
entry keys are computable from public inputs, and a checksum is not a MAC. Every value is tagged with keyed BLAKE3
(a MAC: the key derived from the secret by BLAKE3's key derivation) over the value and the Redis key it is stored
under, so a value is served only where a holder of the secret put it: a forged value, one copied to another key
(another block, entry or tenant), or one written under another secret fails its tag and is never served. BLAKE3
rather than HMAC-SHA256 for speed: every block is tagged on its way in and checked on its way out (here, a 295 kB
block: 8 GB/s against 2 GB/s on an AVX-512 Xeon).

Formats (tags are 64 lowercase hex digits, 256 bits):
- a block blob (block_blob.encode_block, safetensors) carries its tag in its metadata, `"mac":"<tag>"`; the tag
  covers the Redis key, the whole header with those 64 digits read as zeros, and the data;
- an entry record is stored as `<tag> <record JSON>`;
- a member of a derived set is `<derived entry key>.<tag>`, the tag over the set's Redis key and the member's key.

The secret comes from a file (`read_secret_file`), never from a command line. Without a secret (an operator's
explicit opt-out, StoreConfig.redis_insecure) the tags are taken under a public key: they still catch corruption and
values moved to another key, not forgeries.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

import blake3
from kvbridge.transfer.private_file import read_private_file

MIN_SECRET_BYTES = 32  # 256 bits: `openssl rand -hex 32` writes 64 characters
TAG_CHARS = 64  # hex digits of a tag (32 bytes of keyed BLAKE3)
_KEY_CONTEXT = "kvbridge redis tier 2026-12-04 value tags"  # BLAKE3 key derivation: the tag key is the secret's
_PUBLIC_KEY = b"kvbridge redis tier: no secret"  # redis_insecure: tags anyone can compute
_ZERO_TAG = b"0" * TAG_CHARS
_TAG_FIELD = b'"mac":"'
_KINDS = {"block": b"blk", "record": b"rec", "derived": b"drv"}


class ForgedValue(ValueError):
    """A value read from Redis that fails authentication: forged, copied from another key, or written under another
    secret (or none)."""


def read_secret_file(path: str | os.PathLike) -> bytes:
    """The secret in a file: its bytes, leading and trailing whitespace removed. ValueError, naming the file, when it
    does not exist, is not a regular file, can be read or written by users other than its owner and group (mode
    bits for others set: `chmod 600` or `chmod 640`), or holds fewer than MIN_SECRET_BYTES bytes."""
    file = Path(path).expanduser()
    secret = read_private_file(file, "redis secret file").strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"redis secret file {file} holds {len(secret)} bytes (whitespace trimmed); a secret needs at "
                         f"least {MIN_SECRET_BYTES}, e.g. `openssl rand -hex 32 > {file}`")
    return secret


class RedisAuth:
    """Tags and checks the Redis tier's values under one secret (None: a public key, see the module docstring)."""

    def __init__(self, secret: bytes | None):
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a redis secret needs at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self.keyed = secret is not None
        self._key = blake3.blake3(secret if secret is not None else _PUBLIC_KEY,
                                  derive_key_context=_KEY_CONTEXT).digest()

    def __repr__(self) -> str:  # never the secret
        return f"RedisAuth(keyed={self.keyed})"

    def _tag(self, kind: str, redis_key: bytes, *parts) -> bytes:
        mac = blake3.blake3(_KINDS[kind] + len(redis_key).to_bytes(8, "little") + redis_key, key=self._key)
        for part in parts:
            mac.update(part)
        return mac.hexdigest().encode()

    # -------------------------------------------------------------------------------------------------- blocks

    def seal_block(self, redis_key: bytes, head: bytes, data) -> bytes:
        """The block blob's header (block_blob.block_parts: with `"mac":"000..."`) with the tag of head + data filled
        in."""
        at = head.index(_TAG_FIELD) + len(_TAG_FIELD)
        assert head[at:at + TAG_CHARS] == _ZERO_TAG, "the header's tag is filled in once"
        return head[:at] + self._tag("block", redis_key, head, data) + head[at + TAG_CHARS:]

    def open_block(self, redis_key: bytes, blob: bytes) -> None:
        """ForgedValue unless blob is a block blob tagged for redis_key under this secret. Nothing in it is parsed
        before that, but the header's length."""
        view = memoryview(blob)
        end = 8 + int.from_bytes(view[:8], "little") if len(view) >= 8 else 0
        if not 8 < end <= len(view):
            raise ForgedValue(f"not a block blob ({len(view)} bytes)")
        head = bytes(view[:end])
        at = head.find(_TAG_FIELD) + len(_TAG_FIELD)
        if at < len(_TAG_FIELD) or end < at + TAG_CHARS:
            raise ForgedValue("a block blob without a tag")
        expected = self._tag("block", redis_key, head[:at], _ZERO_TAG, head[at + TAG_CHARS:], view[end:])
        if not hmac.compare_digest(expected, head[at:at + TAG_CHARS]):
            raise ForgedValue("its tag does not match (forged, moved from another key, or written under another "
                              "secret)")

    # ------------------------------------------------------------------------------------------------- records

    def record_tag(self, redis_key: bytes, record: bytes) -> bytes:
        return self._tag("record", redis_key, record)

    def seal_record(self, redis_key: bytes, record: bytes) -> bytes:
        return self.record_tag(redis_key, record) + b" " + record

    def open_record(self, redis_key: bytes, value: bytes) -> bytes:
        """The record in a value seal_record made for redis_key under this secret; ForgedValue for anything else."""
        tag, record = value[:TAG_CHARS], value[TAG_CHARS + 1:]
        if len(value) <= TAG_CHARS or value[TAG_CHARS:TAG_CHARS + 1] != b" ":
            raise ForgedValue("a record without a tag")
        if not hmac.compare_digest(self._tag("record", redis_key, record), tag):
            raise ForgedValue("its tag does not match (forged, moved from another key, or written under another "
                              "secret)")
        return record

    # -------------------------------------------------------------------------------------------- derived sets

    def seal_member(self, set_key: bytes, member: str) -> bytes:
        return member.encode() + b"." + self._tag("derived", set_key, member.encode())

    def open_member(self, set_key: bytes, value: bytes) -> str:
        """The entry key in a member seal_member made for set_key under this secret; ForgedValue for anything else."""
        member, _, tag = value.rpartition(b".")
        if not member or not hmac.compare_digest(self._tag("derived", set_key, member), tag):
            raise ForgedValue("a derived-set member whose tag does not match")
        return member.decode()
