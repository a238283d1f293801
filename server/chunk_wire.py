"""A CacheChunk's wire bytes, written and read with the KV data copied once: the server joins the chunk's fields
and its safetensors blob into the message bytes itself (`chunk_message`), the client reads the fields and takes
the blob as a view of the received bytes (`read_chunk_message`). Serialising a KVChunk message would copy the
data in and out again on each side. Protobuf reads concatenated fields as one message, so the bytes are a valid
CacheChunk for any reader.

The first message carries the header too (`first_messages`): when header and chunk together exceed the fetch's
message limit, that chunk is cut (`chunks.cut_first`) so that its first part rides with the header and the rest
follow; a header that leaves no room for one token of KV goes without its text, else is refused by name."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from google.protobuf.message import DecodeError
from kvbridge.proto import pb2
from kvbridge.server.chunks import (
    CHUNK_FRAMING,
    ChunkRange,
    MessageLimit,
    MessageTooLarge,
    cut_first,
    encode_parts,
)
from kvbridge.transfer import tensor_blob

_LEN, _VARINT, _I64, _I32 = 2, 0, 1, 5  # wire types


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _number(message, name: str) -> int:
    return message.DESCRIPTOR.fields_by_name[name].number


_HEADER, _CHUNK = _number(pb2.CacheChunk, "header"), _number(pb2.CacheChunk, "chunk")
_DATA = _number(pb2.KVChunk, "data")
_RANGE = {_number(pb2.KVChunk, name): name for name in ("layer_start", "layer_end", "token_start", "token_end")}


def chunk_message(r: ChunkRange, head: bytes, data: memoryview, prefix: bytes = b"") -> bytes:
    """The wire bytes of a CacheChunk whose chunk holds range r and the blob head + data: prefix (serialised
    fields before it: the header, in the first message), then the chunk field."""
    ranges = pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end, token_start=r.token_start,
                         token_end=r.token_end).SerializeToString()
    n = len(head) + len(data)
    inner = ranges + _varint(_DATA << 3 | _LEN) + _varint(n)
    return b"".join((prefix, _varint(_CHUNK << 3 | _LEN), _varint(len(inner) + n), inner, head, data))


def fit_header(header: pb2.CacheHeader, limit: MessageLimit, bytes_per_layer_token: int, more_chunks: int = 2
               ) -> None:
    """Make the header leave room, in one message of `limit`, for a chunk of one token of one layer (and for
    num_chunks to grow by more_chunks): without its text when it does not fit with it (the text is optional; a
    client that needs it gives its own); MessageTooLarge naming the sizes when even the token ids do not fit."""
    need = bytes_per_layer_token + CHUNK_FRAMING
    header.num_chunks += more_chunks
    try:
        size = pb2.CacheChunk(header=header).ByteSize()
        if size + need > limit.bytes and header.text:
            header.text = ""
            size = pb2.CacheChunk(header=header).ByteSize()
        if size + need > limit.bytes:
            raise MessageTooLarge(
                f"the reply's header is {size} bytes ({len(header.token_ids)} tokens' ids and positions, without the "
                f"text) and its message needs at least one token of one layer's KV ({need} bytes) more: over the "
                f"message limit of {limit}. Raise the client's max_message_mb (and the server's --max-message-mb), "
                "or fetch a shorter document")
    finally:
        header.num_chunks -= more_chunks


def first_messages(header: pb2.CacheHeader, first: bytes, r: ChunkRange, bytes_per_layer_token: int,
                   limit: MessageLimit) -> list[bytes]:
    """The messages that carry the header (fit_header'ed) and the first chunk (`first`, range r), each within
    `limit`: one when they fit together; else the header with a first part of r, then the rest of r, and the header's
    num_chunks (the plan's count) counts the extra messages."""
    head = pb2.CacheChunk(header=header).SerializeToString()
    if len(head) + len(first) <= limit.bytes:
        return [head + first]
    header.num_chunks += 2  # sized at its largest: cut_first adds two messages at most
    budget = limit.bytes - pb2.CacheChunk(header=header).ByteSize() - CHUNK_FRAMING
    pieces = cut_first(r, bytes_per_layer_token, budget)
    header.num_chunks += len(pieces) - 3
    messages = split_message(first, pieces)
    messages[0] = pb2.CacheChunk(header=header).SerializeToString() + messages[0]
    assert all(len(m) <= limit.bytes for m in messages), (list(map(len, messages)), limit.bytes)
    return messages


def split_message(message: bytes, ranges: list[ChunkRange]) -> list[bytes]:
    """A chunk's message (chunk_message's bytes) as the messages of `ranges`, which cover its range: the KV is read
    from the message itself (a kept fetch's message holds the only copy the server has at hand)."""
    _, c = read_chunk_message(message)
    dtype, shape, offset, _ = tensor_blob.parse(c.data, "kv")
    nbytes = math.prod(shape) * dtype.itemsize
    part = torch.frombuffer(bytearray(c.data[offset:offset + nbytes]), dtype=torch.uint8).view(dtype).reshape(shape)
    out = []
    for r in ranges:  # [l, 2, H, t, D] of the message: its ranges relative to the message's own
        local = ChunkRange(r.layer_start - c.layer_start, r.layer_end - c.layer_start, r.token_start - c.token_start,
                           r.token_end - c.token_start)
        head, data = encode_parts(part, local)
        out.append(chunk_message(r, head, data))
    return out


@dataclass(frozen=True, slots=True)
class ChunkView:
    layer_start: int = 0
    layer_end: int = 0
    token_start: int = 0
    token_end: int = 0
    data: memoryview = memoryview(b"")  # the safetensors blob, a view of the received message


class WireError(ValueError):
    """Bytes that are not a CacheChunk this client can read."""


def read_chunk_message(raw: bytes) -> tuple[pb2.CacheHeader | None, ChunkView | None]:
    """(header, chunk) of a CacheChunk's wire bytes, each None when absent; the chunk's data is not copied."""
    view = memoryview(raw)
    header, chunk = None, None
    for number, wire, value in _fields(view):
        if number == _HEADER and wire == _LEN:
            header = _read_header(value) if header is None else _twice("header")
        elif number == _CHUNK and wire == _LEN:
            chunk = _read_chunk(value) if chunk is None else _twice("chunk")
    return header, chunk


def _twice(name: str):
    raise WireError(f"the message holds its {name} field twice")


def _read_header(view: memoryview) -> pb2.CacheHeader:
    try:
        return pb2.CacheHeader.FromString(bytes(view))
    except DecodeError as exc:
        raise WireError(f"the header field is not a CacheHeader ({exc})") from None


def _read_chunk(view: memoryview) -> ChunkView:
    fields = {}
    for number, wire, value in _fields(view):
        if number in _RANGE and wire == _VARINT:
            fields[_RANGE[number]] = value - (1 << 64) if value >= 1 << 63 else value  # int32/int64: two's complement
        elif number == _DATA and wire == _LEN:
            fields["data"] = value
    return ChunkView(**fields)


def _fields(view: memoryview):
    """(field number, wire type, value) of each field: an int for varints, a memoryview for length-delimited ones
    (fixed-width ones are skipped)."""
    pos, end = 0, len(view)
    while pos < end:
        key, pos = _read_varint(view, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(view, pos)
        elif wire == _LEN:
            size, pos = _read_varint(view, pos)
            if pos + size > end:
                raise WireError(f"field {number} runs {pos + size - end} bytes past the message's end")
            value, pos = view[pos:pos + size], pos + size
        elif wire in (_I64, _I32):
            pos, value = pos + (8 if wire == _I64 else 4), None
            if pos > end:
                raise WireError(f"field {number} runs past the message's end")
        else:
            raise WireError(f"field {number} has wire type {wire}, which this reader does not take")
        yield number, wire, value


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
    result, shift = 0, 0
    while True:
        if pos >= len(view) or shift > 63:
            raise WireError("a varint runs past the message's end or past 64 bits")
        byte = view[pos]
        result |= (byte & 0x7F) << shift
        pos += 1
        if not byte & 0x80:
            return result, pos
        shift += 7
