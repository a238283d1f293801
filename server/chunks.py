"""KV on the wire: a [L, 2, H, T, D] tensor cut into bounded chunks (layer range x token range), each a safetensors
blob holding one tensor "kv" (written and read by kvbridge.transfer.tensor_blob: a chunk's bytes are copied once on
each side), and put back together with every range checked. Nothing is ever unpickled.

Chunk plan: when whole layers fit in `chunk_bytes`, a chunk is as many whole layers as fit (all tokens);
otherwise it is one layer and as many tokens as fit. Chunks go layer-major, tokens within a layer in order.

Message limits: a fetch's messages fit the smaller of the server's limit and the one its client declares in the
metadata MAX_MESSAGE_METADATA (the Python client sends its max_message_mb); a client that declares none is taken to
receive gRPC's default, GRPC_DEFAULT_MESSAGE. The first message also carries the header (every token id, the text),
so its chunk may be cut smaller (`cut_first`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvbridge.transfer import tensor_blob

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CHUNK_BYTES = 1 << 20  # 1 MiB: well under gRPC's 4 MiB default message limit, large enough to stream fast
MIN_CHUNK_BYTES = 4096
CHUNK_FRAMING = 512  # bytes a chunk's message holds besides its KV at most: safetensors header, ranges, field tags
GRPC_DEFAULT_MESSAGE = 4 << 20  # what a gRPC client receives unless set otherwise: a client that declares nothing
MAX_MESSAGE_METADATA = "kvbridge-max-message-bytes"  # metadata: the largest message the client receives (bytes)


class ChunkError(ValueError):
    """A chunk that does not fit its header or the chunks before it (the message names which and why)."""


class MessageTooLarge(ValueError):
    """A reply that cannot be cut into messages the server may send and the client receives (the message names the
    sizes and both limits)."""


@dataclass(frozen=True, slots=True)
class MessageLimit:
    """The largest message of one fetch's reply: the smaller of what the server sends and what its client receives."""

    server: int  # the server's limit (--max-message-mb)
    client: int | None  # what the client declared (its max_message_mb); None: declared nothing

    @property
    def bytes(self) -> int:
        return min(self.server, GRPC_DEFAULT_MESSAGE if self.client is None else self.client)

    def __str__(self) -> str:
        client = (f"the client receives at most {self.client}: its max_message_mb" if self.client is not None else
                  f"the client declared no limit (metadata {MAX_MESSAGE_METADATA}), so gRPC's default of "
                  f"{GRPC_DEFAULT_MESSAGE} is assumed")
        return f"{self.bytes} bytes (the server sends at most {self.server}: its --max-message-mb; {client})"


def declared_limit(metadata) -> int | None:
    """The largest message a call's client says it receives (MAX_MESSAGE_METADATA), None when it says nothing;
    ValueError naming the metadata for a value that is not a positive integer."""
    value = next((v for k, v in metadata or () if k == MAX_MESSAGE_METADATA), None)
    if value is None:
        return None
    if not (isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 19 and int(value) > 0):
        raise ValueError(f"metadata {MAX_MESSAGE_METADATA} must be a positive number of bytes, got {value!r}")
    return int(value)


def int64_tensor(values) -> torch.Tensor:
    """[N] int64 of a protobuf repeated integer field (token ids, positions). numpy reads the container in one call
    (7 us for 2k ids); torch.tensor(list(...)) boxes every element (0.4 ms)."""
    return torch.from_numpy(np.array(values, dtype=np.int64))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_dtype(name: str, field: str = "dtype") -> torch.dtype:
    if name not in WIRE_DTYPES:
        raise ValueError(f"{field} must be one of {sorted(WIRE_DTYPES)}, got {name!r}")
    return WIRE_DTYPES[name]


@dataclass(frozen=True, slots=True)
class ChunkRange:
    layer_start: int
    layer_end: int  # exclusive
    token_start: int
    token_end: int  # exclusive


def plan_chunks(num_layers: int, num_tokens: int, bytes_per_layer_token: int, chunk_bytes: int) -> list[ChunkRange]:
    """Ranges covering [0, L) x [0, T) exactly once, each at most chunk_bytes of tensor data."""
    if chunk_bytes < MIN_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be >= {MIN_CHUNK_BYTES}, got {chunk_bytes}")
    if bytes_per_layer_token > chunk_bytes:
        raise ValueError(f"one token of one layer takes {bytes_per_layer_token} bytes, more than chunk_bytes "
                         f"{chunk_bytes}")
    layer_bytes = bytes_per_layer_token * num_tokens
    if layer_bytes <= chunk_bytes:  # whole layers, as many as fit, spread evenly
        per = _even(num_layers, max(1, chunk_bytes // max(layer_bytes, 1)))
        return [ChunkRange(l0, min(l0 + per, num_layers), 0, num_tokens) for l0 in range(0, num_layers, per)]
    per = _even(num_tokens, chunk_bytes // bytes_per_layer_token)  # one layer, tokens spread evenly
    return [ChunkRange(layer, layer + 1, t0, min(t0 + per, num_tokens))
            for layer in range(num_layers) for t0 in range(0, num_tokens, per)]


def cut_first(r: ChunkRange, bytes_per_layer_token: int, budget: int) -> list[ChunkRange]:
    """Range r (a plan's, so whole layers of all tokens, or one layer) as ranges covering it exactly once, the first
    of at most `budget` bytes of tensor data (the chunk that rides with the header), the others no larger than r;
    at most three."""
    if budget < bytes_per_layer_token:
        raise ValueError(f"a budget of {budget} bytes holds no token of one layer ({bytes_per_layer_token} bytes)")
    layers, tokens = r.layer_end - r.layer_start, r.token_end - r.token_start
    per_layer = bytes_per_layer_token * tokens
    if layers * per_layer <= budget:
        return [r]
    if budget >= per_layer:  # whole layers
        cut = r.layer_start + budget // per_layer
        return [ChunkRange(r.layer_start, cut, r.token_start, r.token_end),
                ChunkRange(cut, r.layer_end, r.token_start, r.token_end)]
    # the first layer's first tokens, its other tokens, the layers after it
    cut = r.token_start + budget // bytes_per_layer_token
    first = r.layer_start + 1
    return [ChunkRange(r.layer_start, first, r.token_start, cut), ChunkRange(r.layer_start, first, cut, r.token_end),
            *([ChunkRange(first, r.layer_end, r.token_start, r.token_end)] if layers > 1 else [])]


def _even(total: int, most: int) -> int:
    """The piece size that cuts total into as few pieces of at most `most` as possible, all nearly equal."""
    pieces = -(-total // most)
    return -(-total // pieces)


def encode(kv: torch.Tensor, r: ChunkRange) -> bytes:
    """kv: [L, 2, H, T, D] -> the safetensors blob of kv[layers, :, :, tokens]."""
    return b"".join(encode_parts(kv, r))


def encode_parts(kv: torch.Tensor, r: ChunkRange) -> tuple[bytes, memoryview]:
    """encode's blob in two parts: (its header, a view of the range's bytes). A range of whole layers is a view of
    kv itself (no copy); a token range within a layer is copied out first."""
    part = kv[r.layer_start:r.layer_end, :, :, r.token_start:r.token_end].cpu().contiguous()
    return tensor_blob.header("kv", part.dtype, tuple(part.shape)), memoryview(part.view(torch.uint8).numpy()).cast("B")


def iter_chunks(kv: torch.Tensor, chunk_bytes: int):
    """Yield (range, blob) for a [L, 2, H, T, D] tensor."""
    n_layers, _, h, t, d = kv.shape
    for r in plan_chunks(n_layers, t, 2 * h * d * kv.element_size(), chunk_bytes):
        yield r, encode(kv, r)


class ChunkAssembler:
    """Receives chunks into one preallocated [L, 2, H, T, D] tensor; every (layer, token) must arrive exactly once.
    With headroom, `kv` is the first T slots of each row of `room` [L, 2, H, T + headroom, D] (a client's cache
    writes its next tokens after them in place).

    Bad chunks raise ChunkError and leave what was received so far unchanged.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype,
                 max_bytes: int | None = None, check_finite: bool = True, headroom: int = 0):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("num_tokens", num_tokens),
                            ("head_dim", head_dim)):
            if value <= 0:
                raise ChunkError(f"header {name} must be > 0, got {value}")
        total = num_layers * 2 * num_kv_heads * num_tokens * head_dim * torch.empty(0, dtype=dtype).element_size()
        if max_bytes is not None and total > max_bytes:
            raise ChunkError(f"header describes {total} bytes of KV ({num_layers} layers x {num_tokens} tokens x "
                             f"{num_kv_heads} heads x {head_dim}), more than the {max_bytes} allowed")
        self.shape = (num_layers, 2, num_kv_heads, num_tokens, head_dim)
        self.dtype = dtype
        self.room = torch.empty((num_layers, 2, num_kv_heads, num_tokens + headroom, head_dim), dtype=dtype)
        self.kv = self.room[:, :, :, :num_tokens]
        self._seen = torch.zeros(num_layers, num_tokens, dtype=torch.bool)  # [L, T] cells received
        self.nbytes = total
        self.check_finite = check_finite  # NaN/inf check (the server checks uploads; clients trust their server)

    def add(self, layer_start: int, layer_end: int, token_start: int, token_end: int, data: bytes) -> None:
        n_layers, _, h, t, d = self.shape
        where = f"chunk layers [{layer_start}, {layer_end}) tokens [{token_start}, {token_end})"
        if not (0 <= layer_start < layer_end <= n_layers):
            raise ChunkError(f"{where}: layer range outside [0, {n_layers})")
        if not (0 <= token_start < token_end <= t):
            raise ChunkError(f"{where}: token range outside [0, {t})")
        try:
            dtype, shape, offset, _ = tensor_blob.parse(data, "kv")
        except ValueError as exc:
            raise ChunkError(f"{where}: data is not a valid safetensors blob of exactly one tensor named 'kv' "
                             f"({exc})") from None
        expect = (layer_end - layer_start, 2, h, token_end - token_start, d)
        if shape != expect:
            raise ChunkError(f"{where}: tensor 'kv' has shape {shape}, expected {expect}")
        if dtype != self.dtype:
            raise ChunkError(f"{where}: tensor 'kv' is {dtype_name(dtype)}, the header says "
                             f"{dtype_name(self.dtype)}")
        cells = self._seen[layer_start:layer_end, token_start:token_end]
        if bool(cells.any()):
            raise ChunkError(f"{where}: overlaps a chunk received before")
        into = self.kv[layer_start:layer_end, :, :, token_start:token_end].view(torch.uint8).numpy()
        part = np.frombuffer(data, dtype=np.uint8, count=into.size, offset=offset).reshape(into.shape)
        if self.check_finite:  # checked in a copy first: a refused chunk writes nothing
            part = part.copy()
            if not bool(torch.isfinite(torch.from_numpy(part).view(dtype)).all()):
                raise ChunkError(f"{where}: tensor 'kv' holds NaN or infinite values")
        np.copyto(into, part)  # [l, 2, H, t, D * element size], strided: the one copy without the check
        cells.fill_(True)

    @property
    def complete(self) -> bool:
        return bool(self._seen.all())

    def missing(self) -> str:
        """A sentence on what has not arrived ('' when complete)."""
        if self.complete:
            return ""
        layers = (~self._seen).any(dim=1).nonzero()[:, 0].tolist()
        return f"{int((~self._seen).sum())} (layer, token) cells missing, in layers {layers[:8]}" + (
            "..." if len(layers) > 8 else "")
