"""Malformed kvbridge.v1 requests for the fuzz tests: hypothesis strategies for every field (texts, token ids,
dtypes, TTLs, names, keys, credentials, safetensors blobs written by hand), and the harness that sends one request
to a server over a real channel and checks what every answer must satisfy (`Fuzz.case`). tests/test_fuzz.py
drives the RPCs with them, tests/test_fuzz_direct.py the chunk decoder and the alignment.
"""

from __future__ import annotations

import json
import math
import re
import string
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.chunks import iter_chunks
from kvbridge.transfer.store import NotFound
from safetensors.torch import save as st_save

ALICE = "alice-token-0123456789abcdef"
BOB = "bob-token-0123456789abcdef01"
TOKENS = {ALICE: "alice", BOB: "bob"}
TOKEN_OF = {tenant: token for token, tenant in TOKENS.items()}
TENANTS = ("alice", "bob")
TEXT = ("The module provides a way to read and write data in a portable format. Each record holds a name, "
        "a value and an optional comment, and readers skip what they do not understand.")
MAX_MESSAGE_MB = 2
CALL_TIMEOUT_S = 30  # a call that takes longer is a hang: DEADLINE_EXCEEDED is not an allowed outcome

Code = grpc.StatusCode
ALLOWED = {Code.OK, Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.FAILED_PRECONDITION, Code.RESOURCE_EXHAUSTED}
RPCS = ("Ingest", "PutSourceKV", "Lookup", "GetProjectedCache", "GetSourceCache", "ListModels", "ListAdapters",
        "LoadAdapter", "Delete", "Stats")
CASES: Counter[str] = Counter()  # examples actually sent, per RPC (and per direct fuzz target, test_fuzz_direct.py)
OUTCOMES: Counter[tuple[str, str]] = Counter()  # (RPC, status code name): how deep the requests went

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# ------------------------------------------------------------------------------------------------ strategies


def mostly(valid, invalid, odds: int = 7):
    """valid in odds of odds + 1 draws, else invalid: the deep paths need most fields of a request right at once."""
    return st.integers(0, odds).flatmap(lambda i: valid if i else invalid)


# Spacing, control characters, byte-order marks, bidi overrides, ZWJ sequences, flags, private use and literal
# special-token text, mixed in more often than st.text() alone would find them.
FRAGMENTS = [" ", "  ", "\n", "\t", "\r\n", "\x00", "\x07", "\x1b[31m", "\x7f", "\u0085", "\u200b", "\u200d",
             "\ufeff", "\u202e", "\u3000", "a", "The", " value", "é", "e\u0301", "日本語", "한국어", "😀",
             "👩\u200d💻", "🏳️\u200d🌈", "\U0001f1fa\U0001f1f8", "\U000e0041", "\ue000", "\U0010fffd", "▁", "ﬁ",
             "<s>", "</s>", "<|endoftext|>", "<|im_start|>", "\\", '"', "%s", "{}"]  # fmt: skip
short_texts = st.one_of(
    st.text(st.characters(codec="utf-8"), max_size=120),  # what protobuf can carry: no lone surrogates
    st.lists(st.sampled_from(FRAGMENTS), max_size=24).map("".join),
    st.sampled_from(["", " ", " \n\t ", "\x00", TEXT]),
)


def _stretch(text: str, chars: int) -> str:
    base = text or "ab "
    return (base * (chars // len(base) + 1))[:chars]


# 3000 characters: long but mostly within the tiny models' 4096 positions; 12000: too many tokens; 1.5M: more
# characters than the server takes; 2.5M: a message over max_message_mb
texts = mostly(short_texts, st.builds(_stretch, short_texts, st.sampled_from([3_000, 12_000, 1_500_000, 2_500_000])))

INT32_EDGES = [0, 1, -1, 2, 7, 16, 2**15, 2**31 - 1, -(2**31)]
INT64_EDGES = INT32_EDGES + [2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, -(2**63)]
int32s = st.one_of(st.sampled_from(INT32_EDGES), st.integers(-(2**31), 2**31 - 1))
int64s = st.one_of(st.sampled_from(INT64_EDGES), st.integers(-(2**63), 2**63 - 1))
dtypes = mostly(st.sampled_from(["", "float32", "bfloat16", "float16"]),
                st.one_of(st.sampled_from(["float64", "int8", "bool", "FLOAT32", "float32 ", "torch.float32",
                                           "float8_e4m3fn", "half", "complex64"]), st.text(max_size=12)))  # fmt: skip
ttls = mostly(st.sampled_from([0.0, 600.0]), st.one_of(
    st.sampled_from([-1.0, -0.0, 5e-324, 1e308, math.nan, math.inf, -math.inf]), st.floats()))


def model_names(*valid: str):
    wrong = st.sampled_from(["TINY-QWEN2", "tiny-qwen2 ", "tiny-phi3", "tiny-qwen2", "gpt-9", "..", "\x00"])
    return mostly(st.sampled_from(valid), st.one_of(wrong, st.text(max_size=20)))


kinds = mostly(st.sampled_from(["", "prefix", "segment"]),
               st.one_of(st.sampled_from(["PREFIX", "projected", "prefix\x00"]), st.text(max_size=12)))
offsets = mostly(st.integers(0, 64), st.one_of(st.sampled_from([4000, 4095, 4096, -1]), int64s))
chunk_sizes = mostly(st.sampled_from([0, 4096, 65536, 1 << 20]),
                     st.one_of(st.sampled_from([1, 4095, 2**62, -1, -(2**63), 2**63 - 1]), int64s))
hexes = st.text("0123456789abcdef", max_size=80)
raw_keys = st.one_of(hexes, st.text(max_size=40), st.sampled_from(["", "0" * 32, "f" * 64, "../" * 10, "\x00" * 8]))
FOLDER_NAMES = ["tiny-pair", "tiny-copy", "junk", "bare", "listy", "partial", "notes"]  # files in adapters_dir
ADAPTER_NAMES = ["", "tiny-pair.safetensors", "notes.txt",
                 "../tiny-pair", "/etc/passwd", "..", ".", "a/../tiny-pair", "tiny-pair/", "TINY-PAIR", "tiny-pair\n",
                 "tiny-pair\x00", "ünïcode", "tiny pair", "-x", ".hidden", "tiny-pair.", "a" * 128, "a" * 129,
                 "a" * 300, "..\\tiny-pair", "C:\\adapters\\tiny-pair",
                 "tiny-pair.safetensors.safetensors"]  # fmt: skip
adapter_names = st.one_of(st.sampled_from(FOLDER_NAMES), st.sampled_from(ADAPTER_NAMES), st.text(max_size=40),
                          st.text(string.ascii_letters + string.digits + "._-/\\", min_size=1, max_size=40))
TOKEN_CHARS = string.ascii_letters + string.digits + "-._~+/="
bad_metadata = st.one_of(
    st.just(()),
    st.text(TOKEN_CHARS, min_size=1, max_size=40).map(lambda t: (("authorization", f"Bearer {t}"),)),
    st.text(TOKEN_CHARS, min_size=1, max_size=40).map(lambda t: (("authorization", t),)),
    st.sampled_from([f"bearer {ALICE}", f"Bearer {ALICE}x", f"Bearer {ALICE[:-1]}", f"Basic {ALICE}", ALICE,
                     f"Bearer{ALICE}", "Bearer", f"Bearer {ALICE}{BOB}"]).map(lambda v: (("authorization", v),)),
    st.just((("x-authorization", f"Bearer {ALICE}"),)),
)


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: the server must refuse these credentials
    metadata: tuple[tuple[str, str], ...]


def _caller(who: str):
    if who == "stranger":
        return bad_metadata.map(lambda md: Caller(None, md))
    return st.just(Caller(who, (("authorization", f"Bearer {TOKEN_OF[who]}"),)))


callers = st.sampled_from(["alice"] * 8 + ["bob", "stranger"]).flatmap(_caller)


def token_id_lists(vocab: int):
    return mostly(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40), st.one_of(
        st.lists(int64s, max_size=20),
        st.tuples(st.lists(st.integers(0, vocab - 1), max_size=10), st.sampled_from([-1, vocab, 2**31, -(2**63)]))
        .map(lambda t: [*t[0], t[1]]),  # fmt: skip
        # 4097: over max_positions; 300k: a big list within the message limit; 1.1M ids of 2 bytes: over it
        st.builds(lambda n, v: [v] * n, st.sampled_from([4097, 300_000, 1_100_000]), st.integers(128, vocab - 1)),
    ))


def unknown_fields():
    """Well-formed protobuf bytes of fields no kvbridge message declares (receivers skip them)."""
    field = st.tuples(st.integers(20, 2**29 - 1), st.sampled_from([0, 1, 2, 5]), st.integers(0, 2**64 - 1),
                      st.binary(max_size=40))
    return st.lists(field, max_size=4).map(lambda fields: b"".join(_field(*f) for f in fields))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, value: int, payload: bytes) -> bytes:
    tag = _varint(number << 3 | wire)
    if wire == 0:
        return tag + _varint(value)
    if wire == 1:
        return tag + struct.pack("<Q", value)
    if wire == 5:
        return tag + struct.pack("<I", value & 0xFFFFFFFF)
    return tag + _varint(len(payload)) + payload


# safetensors dtype codes and their bits: the torch ones, ones torch lacks (F8_E8M0, F4, F6_*), and an unknown one
ST_DTYPE_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "I8": 8, "U8": 8,
                 "U16": 16, "U32": 32, "U64": 64, "BOOL": 8, "C64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8,
                 "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "XX": 32}  # fmt: skip


def crafted_blob(data, shape: tuple[int, ...]) -> bytes:
    """A safetensors blob written by hand: any dtype code, shape, name and data length; mostly self-consistent
    (so that it gets past the parser), sometimes not."""
    dtype = data.draw(st.sampled_from(sorted(ST_DTYPE_BITS)))
    shape = data.draw(mostly(st.just([*shape[:-1], shape[-1] * 8]),  # whole bytes for F4 and F6
                             st.lists(st.sampled_from([0, 1, 2, 3, 2**20, 2**40, 2**63]), max_size=5)))
    exact = math.prod(shape) * ST_DTYPE_BITS[dtype] // 8
    length = data.draw(mostly(st.just(exact), st.sampled_from([exact - 1, exact + 1, 0, 8]))) if exact < 1 << 16 else 8
    length = max(length, 0)
    offsets = data.draw(mostly(st.just([0, length]), st.sampled_from([[length, 0], [0, length + 8], [1, length]])))
    header = {data.draw(mostly(st.just("kv"), st.sampled_from(["KV", "", "kv\x00"]))): {
        "dtype": dtype, "shape": shape, "data_offsets": offsets}}
    if data.draw(st.booleans()):
        header["__metadata__"] = data.draw(st.sampled_from([{"format": "pt"}, {"a": 1}, [], "x"]))
    text = json.dumps(header).encode()
    if data.draw(st.integers(0, 9)) == 0:
        text = text[: data.draw(st.integers(0, len(text)))]  # broken JSON
    size = data.draw(mostly(st.just(len(text)), st.sampled_from([len(text) + 1, 0, 2**63, 2**64 - 1])))
    return struct.pack("<Q", size) + text + bytes(length)


def bad_blob(data, good: bytes, part: torch.Tensor) -> bytes:
    """A chunk blob gone wrong in one way; part: the [l, 2, H, t, D] tensor good holds."""
    ways = ["truncate", "random", "empty", "flip", "name", "extra", "dtype", "shape", "nonfinite", "scalar",
            "crafted", "crafted", "crafted"]
    if part.numel() == 0:  # a 0-token part has no element to make non-finite
        ways.remove("nonfinite")
    how = data.draw(st.sampled_from(ways))
    if how == "truncate":
        return good[: data.draw(st.integers(0, len(good) - 1))]
    if how == "random":
        return data.draw(st.binary(max_size=300))
    if how == "empty":
        return b""
    if how == "flip":
        i = data.draw(st.integers(0, len(good) - 1))
        return good[:i] + bytes([good[i] ^ data.draw(st.integers(1, 255))]) + good[i + 1:]
    if how == "name":
        return st_save({data.draw(st.sampled_from(["KV", "kv ", "k", "x"])): part})
    if how == "extra":
        return st_save({"kv": part, "kv2": torch.zeros(1)})
    if how == "dtype":
        other = data.draw(st.sampled_from([torch.float64, torch.float16, torch.bfloat16, torch.float32, torch.int8,
                                           torch.uint8, torch.bool, torch.int64, torch.float8_e4m3fn]))  # fmt: skip
        return st_save({"kv": part.to(other)})
    if how == "shape":
        # flatten, not reshape(-1, ...): that fails on a part of 0 tokens (0 elements)
        shapes = [part.flatten(), part.transpose(0, 3).contiguous(), part[..., :0].contiguous(), part[None],
                  torch.cat((part, part), 3), part.flatten(0, 1)]
        return st_save({"kv": data.draw(st.sampled_from(shapes))})
    if how == "nonfinite":
        broken = part.clone()
        broken.view(-1)[data.draw(st.integers(0, broken.numel() - 1))] = data.draw(
            st.sampled_from([math.nan, math.inf, -math.inf]))
        return st_save({"kv": broken})
    if how == "scalar":
        return st_save({"kv": torch.tensor(1.0, dtype=part.dtype)})
    return crafted_blob(data, tuple(part.shape))


@dataclass
class Reply:
    code: grpc.StatusCode
    details: str
    messages: list  # the response message (unary) or the messages streamed before the status


class Fuzz:
    """One server, one channel, and the per-case property check."""

    def __init__(self, server, source, target):
        self.server = server
        self.store = server.service.store
        self.source, self.target = source, target
        self.channel = grpc.insecure_channel(server.address)
        self.stub = pb2_grpc.KVBridgeStub(self.channel)
        self.keys: list[str] = []  # entries made at the start (of both tenants), for key fields to name
        self.rss_start_kb = rss_kb()  # the process (the server's too) before the fuzzing

    def unary(self, method: str, request, metadata) -> Reply:
        try:
            return Reply(Code.OK, "", [getattr(self.stub, method)(request, metadata=metadata, timeout=CALL_TIMEOUT_S)])
        except grpc.RpcError as exc:
            return Reply(exc.code(), exc.details() or "", [])

    def streamed(self, method: str, request, metadata) -> Reply:
        messages = []
        try:
            for message in getattr(self.stub, method)(request, metadata=metadata, timeout=CALL_TIMEOUT_S):
                messages.append(message)
        except grpc.RpcError as exc:
            return Reply(exc.code(), exc.details() or "", messages)
        return Reply(Code.OK, "", messages)

    def raw(self, method: str, payload: bytes, response_type, metadata) -> Reply:
        call = self.channel.unary_unary(f"/kvbridge.v1.KVBridge/{method}",
                                        response_deserializer=response_type.FromString)
        try:
            return Reply(Code.OK, "", [call(payload, metadata=metadata, timeout=CALL_TIMEOUT_S)])
        except grpc.RpcError as exc:
            return Reply(exc.code(), exc.details() or "", [])

    def case(self, rpc: str, caller: Caller, send, writes: bool = False) -> Reply:
        """Send one request and check what every request must satisfy; writes: an OK answer may store entries."""
        before = {t: set(self.store.keys(t)) for t in TENANTS}
        reply = send(caller.metadata)
        CASES[rpc] += 1
        OUTCOMES[rpc, reply.code.name] += 1
        expected = ALLOWED if caller.tenant else {Code.UNAUTHENTICATED, Code.RESOURCE_EXHAUSTED}  # size: checked first
        assert reply.code in expected, f"{rpc} -> {reply.code.name}: {reply.details}"
        if reply.code != Code.OK:
            assert reply.details.strip(), f"{rpc} -> {reply.code.name} without a sentence"
        if reply.code != Code.OK or not writes:
            for t in TENANTS:
                added = set(self.store.keys(t)) - before[t]
                assert not added, f"{rpc} -> {reply.code.name} stored {len(added)} entries of {t}: {reply.details}"
        assert self.store.check() == []
        alive = self.stub.ListModels(pb2.ListModelsRequest(), metadata=md(ALICE), timeout=10)
        assert len(alive.models) == 2
        return reply

    def expiry_is_a_time(self, key: str, tenant: str) -> None:
        """A stored entry expires at a finite time or never (a NaN would stall every expiry after it)."""
        try:
            info = self.store.info(key, tenant)
        except NotFound:  # a tiny TTL: gone already
            return
        assert info.expires_at is None or math.isfinite(info.expires_at), info


def md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def upload_messages(lm, ids: list[int], kv: torch.Tensor, kind: str = "prefix", positions=(), chunk_bytes: int = 4096
            ) -> list[pb2.PutSourceKVRequest]:
    """The messages of a valid upload of kv: [L, 2, H, T, D] in its own dtype."""
    spec = lm.spec
    header = pb2.KVHeader(model=pb2.ModelRef(name=spec.name, config_hash=spec.identity.config_hash),
                          dtype=str(kv.dtype).removeprefix("torch."), num_layers=spec.num_layers,
                          num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, token_ids=ids,
                          positions=list(positions), rotated=True, kind=kind)
    chunks = [pb2.PutSourceKVRequest(chunk=pb2.KVChunk(layer_start=r.layer_start, layer_end=r.layer_end,
                                                       token_start=r.token_start, token_end=r.token_end, data=blob))
              for r, blob in iter_chunks(kv, chunk_bytes)]
    return [pb2.PutSourceKVRequest(header=header), *chunks]


def random_kv(lm, num_tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    spec = lm.spec
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)



def key_fields(f: Fuzz):
    """Key fields: entries that exist (of either tenant), near misses of them, and anything else."""
    known = st.sampled_from(f.keys)
    near = st.tuples(known, st.sampled_from(["upper", "short", "long", "space"])).map(
        lambda t: {"upper": t[0].upper(), "short": t[0][:-1], "long": t[0] + "0", "space": f" {t[0]}"}[t[1]])
    return mostly(known, st.one_of(near, raw_keys), odds=2)


# ------------------------------------------------------------------------------------------------ memory


def rss_kb(field: str = "VmRSS") -> int:
    """This process's resident memory now (VmRSS) or at its peak since the last reset_peak_rss (VmHWM), in KiB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1))


def reset_peak_rss() -> bool:
    """Start the kernel's peak-RSS mark (VmHWM, and ru_maxrss with it) over from the current RSS (Linux >= 4.0:
    `echo 5 > /proc/self/clear_refs`); False where that is refused. Without it a peak measured after the process
    once grew larger tells nothing."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True
