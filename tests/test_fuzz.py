"""Fuzzing: hypothesis writes malformed requests for every kvbridge.v1 RPC and sends them over a real gRPC channel to
one server (the tiny pair, a fitted adapter, a token file, 2 MB messages). Every call must end within its deadline
with a code a client can act on (never INTERNAL or UNKNOWN) and a sentence when it fails; the server stays up, the
store stays consistent, and a failed call (or a read) stores nothing. The chunk decoder and the alignment the server
relies on are fuzzed directly as well.

(One file of ~800 lines: the strategies, the one shared server and the per-RPC properties belong together.)
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import string
import struct
from collections import Counter
from dataclasses import dataclass

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvbridge.proto import pb2, pb2_grpc
from kvbridge.server.adapter_registry import check_name
from kvbridge.server.chunks import WIRE_DTYPES, ChunkAssembler, ChunkError, iter_chunks, wire_dtype
from kvbridge.transfer.store import NotFound
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from test_align import check_alignment  # the invariants of one alignment, token by token

pytestmark = pytest.mark.integration

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
CASES: Counter[str] = Counter()  # examples actually sent, per RPC (and per direct fuzz target)
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


# ------------------------------------------------------------------------------------------------ server


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, tiny_adapter_file):
    """The fitted tiny-pair adapter, a copy of it, and files that are not adapters."""

    folder = tmp_path_factory.mktemp("adapters")
    shutil.copy(tiny_adapter_file, folder / "tiny-pair.safetensors")
    shutil.copy(folder / "tiny-pair.safetensors", folder / "tiny-copy.safetensors")
    (folder / "junk.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    (folder / "bare.safetensors").write_bytes(st_save({"w": torch.zeros(2)}))
    for name, meta in (("listy", "[]"), ("partial", '{"format_version": 1}')):  # metadata of the wrong shape
        blob = st_save({"w": torch.zeros(2)}, metadata={"kvbridge_adapter": meta})
        (folder / f"{name}.safetensors").write_bytes(blob)
    (folder / "notes.txt").write_text("not an adapter")
    return folder


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
        self.peak_rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the process's peak at the start

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


def _upload(lm, ids: list[int], kv: torch.Tensor, kind: str = "prefix", positions=(), chunk_bytes: int = 4096
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


def _random_kv(lm, num_tokens: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    spec = lm.spec
    shape = (spec.num_layers, 2, spec.num_kv_heads, num_tokens, spec.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.fixture(scope="module")
def fuzz(tiny_source, tiny_target, adapters_dir):
    from kvbridge.server.app import build_service, start_server, store_config
    from kvbridge.server.config import ServeConfig
    from kvbridge.transfer.store import PagedStore

    config = ServeConfig(preset="tiny", listen="127.0.0.1:0", adapters=str(adapters_dir), store_capacity_mb=64,
                         max_message_mb=MAX_MESSAGE_MB, chunk_kb=64, selfcheck=False)
    store = PagedStore(store_config(config), clock=lambda: 1000.0)  # frozen: a TTL expires only if too small to add
    service = build_service(config, source=tiny_source, targets=[tiny_target], store=store)
    running = start_server(service, config, tokens=TOKENS)
    f = Fuzz(running, tiny_source, tiny_target)
    stub = f.stub
    f.keys.append(stub.Ingest(pb2.IngestRequest(text=TEXT), metadata=md(ALICE), timeout=60).entries[0].key)
    first = next(stub.GetProjectedCache(pb2.GetProjectedCacheRequest(text=TEXT), metadata=md(ALICE), timeout=60))
    f.keys.append(first.header.entry_key)  # a projected entry: not a source entry
    for kind, positions in (("prefix", ()), ("segment", range(5, 13))):
        messages = _upload(tiny_source, list(range(40, 48)), _random_kv(tiny_source, 8, seed=len(f.keys)), kind,
                           positions)  # fmt: skip
        f.keys.append(stub.PutSourceKV(iter(messages), metadata=md(ALICE), timeout=60).entry.key)
    f.keys.append(stub.Ingest(pb2.IngestRequest(text=TEXT[:80]), metadata=md(BOB), timeout=60).entries[0].key)
    try:
        yield f
    finally:
        f.channel.close()
        running.stop(1)


def key_fields(f: Fuzz):
    """Key fields: entries that exist (of either tenant), near misses of them, and anything else."""
    known = st.sampled_from(f.keys)
    near = st.tuples(known, st.sampled_from(["upper", "short", "long", "space"])).map(
        lambda t: {"upper": t[0].upper(), "short": t[0][:-1], "long": t[0] + "0", "space": f" {t[0]}"}[t[1]])
    return mostly(known, st.one_of(near, raw_keys), odds=2)


# ------------------------------------------------------------------------------------------------ unary RPCs


@settings(FUZZ, max_examples=300)
@given(data=st.data(), caller=callers)
def test_ingest(fuzz, data, caller):
    vocab = fuzz.source.spec.vocab_size
    request = pb2.IngestRequest(model=data.draw(model_names("", "tiny-qwen2")),
                                session_id=data.draw(st.text(max_size=20)),
                                mode=data.draw(mostly(st.sampled_from([0, 0, 1]), st.sampled_from([2, -1, 2**31 - 1]))),
                                options=pb2.StoreOptions(ttl_s=data.draw(ttls), pin=data.draw(mostly(
                                    st.just(False), st.just(True)))))
    which = data.draw(st.sampled_from(["text", "text", "token_ids", "none"]))
    if which == "text":
        request.text = data.draw(texts)
    elif which == "token_ids":
        request.token_ids.ids.extend(data.draw(token_id_lists(vocab)))
    reply = fuzz.case("Ingest", caller, lambda m: fuzz.unary("Ingest", request, m), writes=True)
    if reply.code == Code.OK:
        (response,) = reply.messages
        prefix = response.entries[0]
        assert prefix.kind == "prefix" and prefix.num_tokens == len(response.source_token_ids) > 0
        if which == "token_ids":
            assert list(response.source_token_ids) == list(request.token_ids.ids)
        for entry in response.entries:
            fuzz.expiry_is_a_time(entry.key, caller.tenant)


@settings(FUZZ, max_examples=250)
@given(data=st.data(), caller=callers)
def test_lookup(fuzz, data, caller):
    request = pb2.LookupRequest(model=data.draw(model_names("", "tiny-qwen2")), kind=data.draw(kinds))
    which = data.draw(st.sampled_from(["text", "token_ids", "none"]))
    if which == "text":
        request.text = data.draw(texts)
    elif which == "token_ids":
        request.token_ids.ids.extend(data.draw(token_id_lists(fuzz.source.spec.vocab_size)))
    reply = fuzz.case("Lookup", caller, lambda m: fuzz.unary("Lookup", request, m))
    if reply.code == Code.OK:
        (found,) = reply.messages
        assert 0 <= found.num_tokens <= found.query_tokens and bool(found.tier) == (found.num_tokens > 0)
        if found.key:
            assert found.key in fuzz.store.keys(caller.tenant)


@settings(FUZZ, max_examples=100)
@given(caller=callers, extra=unknown_fields())
def test_list_models(fuzz, caller, extra):
    reply = fuzz.case("ListModels", caller, lambda m: fuzz.raw("ListModels", extra, pb2.ListModelsResponse, m))
    if reply.code == Code.OK:
        assert {m.name: m.role for m in reply.messages[0].models} == {"tiny-qwen2": "source", "tiny-phi3": "target"}


@settings(FUZZ, max_examples=100)
@given(caller=callers, extra=unknown_fields())
def test_list_adapters(fuzz, caller, extra):
    reply = fuzz.case("ListAdapters", caller, lambda m: fuzz.raw("ListAdapters", extra, pb2.ListAdaptersResponse, m))
    if reply.code == Code.OK:
        names = {a.name for a in reply.messages[0].adapters}
        assert {"tiny-pair", "tiny-copy"} <= names <= {"tiny-pair", "tiny-copy", "partial"}  # no unreadable file


@settings(FUZZ, max_examples=100)
@given(caller=callers, extra=unknown_fields())
def test_stats(fuzz, caller, extra):
    reply = fuzz.case("Stats", caller, lambda m: fuzz.raw("Stats", extra, pb2.StatsResponse, m))
    if reply.code == Code.OK:
        stats = reply.messages[0]
        assert stats.tenant_entries == len(fuzz.store.keys(caller.tenant))
        assert {t.tier for t in stats.tiers} == {"device", "cpu"}


@settings(FUZZ, max_examples=200)
@given(caller=callers, name=adapter_names, make_default=st.booleans())
def test_load_adapter(fuzz, caller, name, make_default):
    request = pb2.LoadAdapterRequest(name=name, make_default=make_default)
    reply = fuzz.case("LoadAdapter", caller, lambda m: fuzz.unary("LoadAdapter", request, m))
    if reply.code == Code.OK:
        info = reply.messages[0]
        assert info.name == check_name(name) in ("tiny-pair", "tiny-copy") and info.loaded
        assert info.is_default or not make_default


# ------------------------------------------------------------------------------------------------ streams


def _check_stream(messages: list) -> None:
    """An OK stream: the header first, then chunks that cover the KV it describes exactly once."""
    h = messages[0].header
    assert messages[0].HasField("header") and not any(m.HasField("header") for m in messages[1:])
    assert h.num_chunks == len(messages) and len(h.positions) == len(h.token_ids) > 0
    assembler = ChunkAssembler(h.num_layers, h.num_kv_heads, len(h.token_ids), h.head_dim, wire_dtype(h.dtype))
    for m in messages:
        c = m.chunk
        assembler.add(c.layer_start, c.layer_end, c.token_start, c.token_end, c.data)
    assert assembler.complete and h.total_bytes == assembler.nbytes


@settings(FUZZ, max_examples=250)
@given(data=st.data(), caller=callers)
def test_get_projected_cache(fuzz, data, caller):
    request = pb2.GetProjectedCacheRequest(
        target_model=data.draw(model_names("", "tiny-phi3")),
        adapter=data.draw(mostly(st.sampled_from(["", "tiny-pair", "tiny-copy"]), adapter_names)),
        offset=data.draw(offsets), dtype=data.draw(dtypes), require_cached=data.draw(st.booleans()),
        chunk_bytes=data.draw(chunk_sizes))
    which = data.draw(st.sampled_from(["key", "key", "text", "text", "text", "none"]))
    if which == "key":
        request.key = data.draw(key_fields(fuzz))
    elif which == "text":
        request.text = data.draw(texts)
    reply = fuzz.case("GetProjectedCache", caller, lambda m: fuzz.streamed("GetProjectedCache", request, m),
                      writes=True)
    if reply.code == Code.OK:
        _check_stream(reply.messages)
        h = reply.messages[0].header
        assert h.model.name == "tiny-phi3" and h.positions[0] == request.offset and h.adapter.startswith("tiny-")
        assert h.dtype == (request.dtype or "float32")


@settings(FUZZ, max_examples=200)
@given(data=st.data(), caller=callers)
def test_get_source_cache(fuzz, data, caller):
    request = pb2.GetSourceCacheRequest(dtype=data.draw(dtypes), require_cached=data.draw(st.booleans()),
                                        chunk_bytes=data.draw(chunk_sizes))
    which = data.draw(st.sampled_from(["key", "key", "text", "text", "none"]))
    if which == "key":
        request.key = data.draw(key_fields(fuzz))
    elif which == "text":
        request.text = data.draw(texts)
    reply = fuzz.case("GetSourceCache", caller, lambda m: fuzz.streamed("GetSourceCache", request, m),
                      writes=which == "text" and not request.require_cached)
    if reply.code == Code.OK:
        _check_stream(reply.messages)
        h = reply.messages[0].header
        assert h.entry_key in fuzz.store.keys(caller.tenant) and h.dtype == (request.dtype or "float32")


# ------------------------------------------------------------------------------------------------ uploads

HEADER_MUTATIONS = ["dims", "dtype", "model", "config_hash", "no_model", "ids", "positions", "unrotated", "kind",
                    "ttl", "pin"]  # fmt: skip
CHUNK_MUTATIONS = ["range", "blob", "oversized"]
STREAM_MUTATIONS = ["drop", "duplicate", "shuffle", "chunk_first", "header_twice", "no_header", "empty_message",
                    "empty_stream"]  # fmt: skip


def _mutate_header(data, h: pb2.KVHeader, how: str, vocab: int) -> None:
    if how == "dims":
        setattr(h, data.draw(st.sampled_from(["num_layers", "num_kv_heads", "head_dim"])), data.draw(int32s))
    elif how == "dtype":
        h.dtype = data.draw(dtypes)
    elif how == "model":
        h.model.name = data.draw(model_names("tiny-qwen2", "tiny-phi3"))
    elif how == "config_hash":
        h.model.config_hash = data.draw(st.one_of(hexes, st.text(max_size=70)))
    elif how == "no_model":
        h.ClearField("model")
    elif how == "ids":
        ids = data.draw(token_id_lists(vocab))
        h.ClearField("token_ids")
        h.token_ids.extend(ids)
    elif how == "positions":
        n = len(h.token_ids)
        positions = data.draw(st.one_of(st.lists(int64s, max_size=30),
                                        st.integers(-100, 5000).map(lambda s: list(range(s, s + n)))))
        h.ClearField("positions")
        h.positions.extend(positions)
    elif how == "unrotated":
        h.rotated = False
    elif how == "kind":
        h.kind = data.draw(kinds)
    elif how == "ttl":
        h.options.ttl_s = data.draw(ttls)
    else:
        h.options.pin = True


def _mutate_chunks(data, chunks: list, how: str, kv: torch.Tensor) -> None:
    c = chunks[data.draw(st.integers(0, len(chunks) - 1))].chunk
    if how == "range":
        name = data.draw(st.sampled_from(["layer_start", "layer_end", "token_start", "token_end"]))
        setattr(c, name, data.draw(int32s if name.startswith("layer") else int64s))
    elif how == "blob":
        part = kv[c.layer_start:c.layer_end, :, :, c.token_start:c.token_end].contiguous()
        c.data = bad_blob(data, c.data, part)
    else:
        c.data = bytes(MAX_MESSAGE_MB * (1 << 20) + 1)


def _mutate_stream(data, messages: list, how: str) -> list:
    if len(messages) < 2:  # emptied by the mutation before
        return messages
    header, chunks = messages[0], messages[1:]
    if how == "drop":
        return [header, *data.draw(st.permutations(chunks))[1:]]
    if how == "duplicate":
        return [*messages, data.draw(st.sampled_from(chunks))]
    if how == "shuffle":
        return [header, *data.draw(st.permutations(chunks))]
    if how == "chunk_first":
        return [chunks[0], header, *chunks[1:]]
    if how == "header_twice":
        return [header, *chunks[:1], header, *chunks[1:]]
    if how == "no_header":
        return chunks
    if how == "empty_message":
        at = data.draw(st.integers(0, len(messages)))
        return [*messages[:at], pb2.PutSourceKVRequest(), *messages[at:]]
    return []


@settings(FUZZ, max_examples=400)
@given(data=st.data(), caller=callers)
def test_put_source_kv(fuzz, data, caller):
    lm = data.draw(st.sampled_from([fuzz.source, fuzz.source, fuzz.target]))  # either served model takes uploads
    num_tokens = data.draw(st.integers(1, 24))
    ids = data.draw(st.lists(st.integers(0, lm.spec.vocab_size - 1), min_size=num_tokens, max_size=num_tokens))
    kind = data.draw(st.sampled_from(["prefix", "", "segment"]))
    start = data.draw(st.integers(0, 64)) if kind == "segment" else 0
    positions = range(start, start + num_tokens) if kind == "segment" or data.draw(st.booleans()) else ()
    kv = _random_kv(lm, num_tokens, data.draw(st.integers(0, 2**16)), WIRE_DTYPES[data.draw(st.sampled_from(
        sorted(WIRE_DTYPES)))])  # fmt: skip
    messages = _upload(lm, ids, kv, kind, positions, chunk_bytes=data.draw(st.sampled_from([4096, 8192, 1 << 20])))
    count = data.draw(st.sampled_from([0, 1, 1, 1, 2, 3]))  # one mutation at a time, mostly: it meets its check
    mutations = data.draw(st.lists(st.sampled_from(HEADER_MUTATIONS + CHUNK_MUTATIONS + STREAM_MUTATIONS),
                                   unique=True, min_size=count, max_size=count))  # fmt: skip
    for how in mutations:
        if how in HEADER_MUTATIONS:
            _mutate_header(data, messages[0].header, how, lm.spec.vocab_size)
        elif how in CHUNK_MUTATIONS:
            _mutate_chunks(data, messages[1:], how, kv)
    for how in mutations:
        if how in STREAM_MUTATIONS:
            messages = _mutate_stream(data, messages, how)
    reply = fuzz.case("PutSourceKV", caller, lambda m: fuzz.unary("PutSourceKV", iter(messages), m), writes=True)
    if caller.tenant and set(mutations) <= {"shuffle", "pin"}:
        assert reply.code == Code.OK, reply.details  # a well-formed upload, chunks in any order
    if reply.code == Code.OK:
        entry = reply.messages[0].entry
        assert entry.num_tokens == num_tokens and entry.model == lm.name
        fuzz.expiry_is_a_time(entry.key, caller.tenant)
        info = fuzz.store.info(entry.key, caller.tenant) if entry.key in fuzz.store.keys(caller.tenant) else None
        if info is not None and entry.new_blocks == info.num_blocks and not (
                {"blob", "range"} & set(mutations)):  # every block written by this upload: the KV is what was sent
            stored = fuzz.store.get(entry.key, caller.tenant)
            assert torch.equal(stored.kv, kv.to(stored.dtype))


def test_a_header_describing_huge_kv_is_refused_before_allocating(fuzz):
    """Dimensions of 2**31 - 1: refused from the header alone, fast, with no memory to speak of."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    spec = fuzz.source.spec
    huge = [("num_layers", 2**31 - 1), ("num_kv_heads", 2**31 - 1), ("head_dim", 2**31 - 1)]
    for name, value in huge:
        header = pb2.KVHeader(model=pb2.ModelRef(name=spec.name), dtype="float32", num_layers=spec.num_layers,
                              num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, token_ids=[1] * 4096,
                              rotated=True)
        setattr(header, name, value)
        reply = fuzz.case("PutSourceKV", Caller("alice", md(ALICE)),
                          lambda m, h=header: fuzz.unary("PutSourceKV", iter([pb2.PutSourceKVRequest(header=h)]), m))
        assert reply.code == Code.INVALID_ARGUMENT and "does not match" in reply.details
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB


def test_undecodable_request_bytes_are_invalid_argument(fuzz):
    reply = fuzz.raw("Ingest", b"\x0a\x02\xc3\x28", pb2.IngestResponse, md(ALICE))  # text: invalid UTF-8
    assert reply.code == Code.INVALID_ARGUMENT, reply.code


def test_requests_the_fuzzing_found_mishandled(fuzz):
    """Pinned: each of these once ended INTERNAL, stored an entry expiring at NaN, or stored on failure."""
    spec = fuzz.source.spec
    f4 = json.dumps({"kv": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()  # a dtype torch lacks
    f4_upload = [pb2.PutSourceKVRequest(header=pb2.KVHeader(
        model=pb2.ModelRef(name=spec.name), dtype="float32", num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, token_ids=[1, 2], rotated=True)), pb2.PutSourceKVRequest(chunk=pb2.KVChunk(
            layer_start=0, layer_end=1, token_start=0, token_end=2, data=struct.pack("<Q", len(f4)) + f4 + b"\0"))]
    cases = [
        ("Ingest", pb2.IngestRequest(text="a text with a NaN TTL", options=pb2.StoreOptions(ttl_s=math.nan))),
        ("Ingest", pb2.IngestRequest(text="a text kept forever", options=pb2.StoreOptions(ttl_s=math.inf))),
        ("LoadAdapter", pb2.LoadAdapterRequest(name="listy")),  # kvbridge_adapter metadata "[]"
        ("LoadAdapter", pb2.LoadAdapterRequest(name="partial")),  # a JSON object without the adapter's fields
        ("GetProjectedCache", pb2.GetProjectedCacheRequest(text=TEXT, adapter="tiny-pair.safetensors.safetensors")),
        ("GetProjectedCache", pb2.GetProjectedCacheRequest(text="a text only this test sends", offset=4090)),
        ("PutSourceKV", iter(f4_upload)),
    ]
    for rpc, request in cases:
        send = fuzz.streamed if rpc == "GetProjectedCache" else fuzz.unary
        reply = fuzz.case(rpc, Caller("alice", md(ALICE)), lambda m, r=rpc, q=request, f=send: f(r, q, m))
        assert reply.code == Code.INVALID_ARGUMENT, (rpc, reply.code, reply.details)


# ------------------------------------------------------------------------------------------------ deletes
# last of the RPCs: the entries made at the start stay for the others to name


@settings(FUZZ, max_examples=200)
@given(data=st.data(), caller=callers)
def test_delete(fuzz, data, caller):
    fresh = data.draw(st.booleans())
    if fresh and caller.tenant:  # an entry made for this case, so that deletes also succeed
        ids = data.draw(st.lists(st.integers(0, fuzz.source.spec.vocab_size - 1), min_size=1, max_size=20))
        key = fuzz.server.service.ingest(caller.tenant, token_ids=ids).entries[0][0].key
        key = data.draw(st.sampled_from([key, key, key.upper(), key[:-1], f"{key}\x00"]))
    else:
        key = data.draw(key_fields(fuzz))
    # a key the tenant holds, or one whose entry is gone but whose projections are not (Delete removes those)
    owned = (key in fuzz.store.keys(caller.tenant) or bool(fuzz.store.derived(key, caller.tenant))
             if caller.tenant else False)
    reply = fuzz.case("Delete", caller, lambda m: fuzz.unary("Delete", pb2.DeleteRequest(key=key), m))
    if caller.tenant:
        assert (reply.code == Code.OK) == owned, (reply.code, reply.details)
    if reply.code == Code.OK:
        assert reply.messages[0].deleted >= 1 and key not in fuzz.store.keys(caller.tenant)


# ------------------------------------------------------------------------------------------------ direct: chunks


@settings(FUZZ, max_examples=300)
@given(data=st.data(), layers=st.integers(1, 3), heads=st.integers(1, 2), tokens=st.integers(1, 6),
       dim=st.integers(1, 4), dtype=st.sampled_from(sorted(WIRE_DTYPES)))
def test_the_chunk_decoder_raises_only_chunk_errors_and_changes_nothing_on_one(data, layers, heads, tokens, dim,
                                                                               dtype):
    dtype = WIRE_DTYPES[dtype]
    kv = torch.randn(layers, 2, heads, tokens, dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    assembler = ChunkAssembler(layers, heads, tokens, dim, dtype)
    for _ in range(data.draw(st.integers(1, 6))):
        CASES["ChunkAssembler.add"] += 1
        l0, l1 = sorted(data.draw(st.lists(st.integers(0, layers), min_size=2, max_size=2)))
        t0, t1 = sorted(data.draw(st.lists(st.integers(0, tokens), min_size=2, max_size=2)))
        part = kv[l0:l1, :, :, t0:t1].contiguous()
        blob = st_save({"kv": part})
        if data.draw(st.booleans()):
            blob = bad_blob(data, blob, part) if part.numel() else data.draw(st.binary(max_size=200))
        if data.draw(st.integers(0, 3)) == 0:
            l0, l1, t0, t1 = data.draw(st.tuples(int32s, int32s, int64s, int64s))
        cells, missing = assembler.kv.clone(), assembler.missing()
        try:
            assembler.add(l0, l1, t0, t1, blob)
        except ChunkError as exc:
            assert str(exc)
            assert torch.equal(assembler.kv.view(-1).view(torch.uint8), cells.view(-1).view(torch.uint8))
            assert assembler.missing() == missing
        else:
            assert torch.equal(assembler.kv[l0:l1, :, :, t0:t1], st_load(blob)["kv"])
            assert assembler.missing() != missing
    if assembler.complete:
        assert bool(assembler.kv.isfinite().all())


@settings(FUZZ, max_examples=200)
@given(dims=st.tuples(int64s, int64s, int64s, int64s), dtype=st.sampled_from(sorted(WIRE_DTYPES)))
def test_chunk_headers_are_refused_before_allocating(dims, dtype):
    CASES["ChunkAssembler()"] += 1
    limit = 1 << 20
    try:
        assembler = ChunkAssembler(*dims, WIRE_DTYPES[dtype], max_bytes=limit)
    except ChunkError as exc:
        assert str(exc)
    else:
        assert all(d > 0 for d in dims) and assembler.kv.numel() * assembler.kv.element_size() <= limit


# ------------------------------------------------------------------------------------------------ direct: alignment
# tests/test_align.py checks align_text with specials on both sides; the server pairs a text with the source's
# specials and the target's text tokens behind its start token (pair_text), and tokenizes pieces without specials.

control_heavy = st.one_of(
    st.text(st.characters(categories=["Cc", "Cf", "Co", "Cn", "So", "Sk", "Mn", "Zs", "Zl", "Zp"]), max_size=60),
    st.lists(st.sampled_from(FRAGMENTS), max_size=40).map("".join),
    st.text(max_size=300),
)


@settings(FUZZ, max_examples=150)
@given(text=control_heavy)
def test_pair_text_alignment_on_arbitrary_text(tiny_source, tiny_target, text):
    from kvbridge.adapters.pairs import pair_text, start_token_id
    from kvbridge.transfer.align import AlignKind, align_text, tokenize

    CASES["align"] += 1
    for source_tokenizer, target_tokenizer in [(tiny_source.tokenizer, tiny_target.tokenizer),
                                               (tiny_target.tokenizer, tiny_source.tokenizer)]:  # fmt: skip
        source, target, alignment = align_text(text, source_tokenizer, target_tokenizer, add_special_tokens=False)
        check_alignment(text, source, target, alignment)
        if not text.strip():
            continue
        paired = pair_text(text, source_tokenizer, target_tokenizer)
        a = paired.alignment
        assert a.num_target_tokens == paired.target_ids.numel() == paired.target_offsets.shape[0]
        assert a.num_source_tokens == paired.source_ids.numel()
        assert int(paired.target_ids[0]) == start_token_id(target_tokenizer) and int(a.kind[0]) == AlignKind.UNMAPPED
        index, kind = a.source_index.tolist(), a.kind.tolist()
        source = tokenize(source_tokenizer, text)
        for i in range(1, a.num_target_tokens):
            j = index[i]
            assert -1 <= j < a.num_source_tokens and (j == -1) == (kind[i] == AlignKind.UNMAPPED)
            start, end = paired.target_offsets[i].tolist()
            if kind[i] == AlignKind.EXACT:  # the source token really covers the target token's last character
                assert end > start and not source.special[j]
                assert int(source.offsets[j, 0]) <= end - 1 < int(source.offsets[j, 1])
            elif kind[i] == AlignKind.FALLBACK and not source.special[j]:
                assert int(source.offsets[j, 1]) <= max(end - 1, start)  # no look-ahead


# ------------------------------------------------------------------------------------------------ count


def test_cases_run(fuzz, capsys):
    """Thousands of requests, and the server as it should be after them; the counts go to the terminal."""
    ran = {rpc: CASES[rpc] for rpc in RPCS}
    total = sum(ran.values())
    lines = [f"{name:>20}: {n}  " + " ".join(f"{code}={count}" for (r, code), count in sorted(OUTCOMES.items())
                                             if r == name) for name, n in sorted(CASES.items())]
    lines += [f"{'gRPC total':>20}: {total}", f"{'all':>20}: {sum(CASES.values())}"]
    with capsys.disabled():
        print("\nfuzz cases\n" + "\n".join(lines))
    if min(ran.values()) == 0:
        pytest.skip("not every RPC was fuzzed in this run (-k?): nothing to total")
    assert total >= 2000
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - fuzz.peak_rss_kb) / 1024
    assert grown_mb < 1024, f"the server process grew by {grown_mb:.0f} MB while fuzzed"
    assert fuzz.store.check() == []
