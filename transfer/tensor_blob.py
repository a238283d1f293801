"""One tensor in the safetensors layout, written and read without safetensors' own copies: `header` gives the
bytes that go before the tensor's data (the data follows as is, e.g. a view of a tensor sent or joined after it),
`parse` checks a received blob's header against its length and says where the data is, so it can be copied once,
straight to where it belongs. Any safetensors reader reads these blobs; nothing is ever unpickled.

Layout: 8-byte little-endian header length, the JSON header (padded with spaces so the data is 8-byte aligned, as
safetensors pads it), then the data.
"""

from __future__ import annotations

import json
import math

import torch

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPES = {name: dtype for dtype, name in ST_DTYPES.items()}


def header(name: str, dtype: torch.dtype, shape: tuple[int, ...], metadata: dict[str, str] | None = None) -> bytes:
    """The bytes before the data of a blob holding one tensor `name` of this dtype and shape."""
    if dtype not in ST_DTYPES:
        raise ValueError(f"a blob holds a tensor in {sorted(map(str, ST_DTYPES))}, got {dtype}")
    nbytes = math.prod(shape) * dtype.itemsize
    meta = {"__metadata__": metadata} if metadata else {}
    meta[name] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [0, nbytes]}
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def parse(blob, name: str) -> tuple[torch.dtype, tuple[int, ...], int, dict]:
    """(dtype, shape, offset of the data, metadata) of a blob (bytes-like) that holds exactly one tensor `name` and
    nothing after it. ValueError, with what is wrong, for anything else."""
    view = memoryview(blob).cast("B")
    try:
        header_len = int.from_bytes(view[:8], "little")
        if not 2 <= header_len <= len(view) - 8:
            raise ValueError(f"a {header_len}-byte header in a {len(view)}-byte blob")
        meta = json.loads(bytes(view[8:8 + header_len]))
        if not isinstance(meta, dict):
            raise ValueError("the header is not a JSON object")
        metadata = meta.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise ValueError("__metadata__ is not an object of strings")  # safetensors' own rule
        if set(meta) != {name}:
            raise ValueError(f"the blob must hold exactly one tensor {name!r}, got {sorted(meta)}")
        tensor = meta[name]
        if tensor.get("dtype") not in _DTYPES:
            raise ValueError(f"dtype {tensor.get('dtype')!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[tensor["dtype"]]
        shape = tuple(tensor["shape"])
        if not all(type(n) is int and n >= 0 for n in shape):
            raise ValueError(f"shape {list(shape)} is not a list of sizes")
        nbytes = math.prod(shape) * dtype.itemsize
        if list(tensor["data_offsets"]) != [0, nbytes] or 8 + header_len + nbytes != len(view):
            raise ValueError(f"data_offsets {tensor['data_offsets']} for {nbytes} bytes of {list(shape)} "
                             f"{tensor['dtype']}, {len(view) - 8 - header_len} bytes after the header")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        raise ValueError(f"not a one-tensor safetensors blob: {exc}") from None
    return dtype, shape, 8 + header_len, metadata
