"""A CacheChunk's wire bytes, written and read with the KV data copied once: the server joins the chunk's fields
and its safetensors blob into the message bytes itself (`chunk_message`), the client reads the fields and takes
the blob as a view of the received bytes (`read_chunk_message`). Serialising a KVChunk message would copy the
data in and out again on each side. Protobuf reads concatenated fields as one message, so the bytes are a valid
CacheChunk for any reader."""

from __future__ import annotations

from dataclasses import dataclass

from kvbridge.proto import pb2
from kvbridge.server.chunks import ChunkRange

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
            header = pb2.CacheHeader.FromString(bytes(value)) if header is None else _twice("header")
        elif number == _CHUNK and wire == _LEN:
            chunk = _read_chunk(value) if chunk is None else _twice("chunk")
    return header, chunk


def _twice(name: str):
    raise WireError(f"the message holds its {name} field twice")


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
