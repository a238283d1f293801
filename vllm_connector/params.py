"""What the connector is told: its configuration (once per engine) and each request's kvbridge context (the
request convention), and the rule that turns a projected cache into a count of matched prompt tokens.

No vLLM import here: the engine's side of the connector is `kvbridge.vllm.connector`.

The request convention. A request whose prompt begins with a context kvbridge holds says so in its sampling
parameters:

    SamplingParams(..., extra_args={"kv_transfer_params": {"kvbridge": {"key": ENTRY_KEY, "adapter": "name@1"}}})

with exactly one of `key` (an entry the server holds: `KVBridgeClient.ingest(...).entries[0].key`) and `text` (the
server ingests the text when it has no entry for it), and optionally `adapter` (default: the server's default for
the target), `server` (a name from the engine's `servers`; default "default") and `recompute_tokens` (leave at least
this many of the context's last tokens to vLLM's own prefill). The prompt holds the text anywhere: the connector
sends the prompt's token ids with its fetch, and the server serves the target's own KV of the tokens before the text
(a chat template, a system prompt, an instruction; computed exactly), then the projected text at its positions in
the prompt (`server/prompt_place.py`); a prompt that begins with the stored cache's ids (the target's start token,
then the text's tokens) gets the cache as stored, and a text prompt without the start token gets the text from
position 0. vLLM loads the longest common prefix of the prompt and the served ids, rounded down to whole vLLM
blocks, never the prompt's last token (vLLM needs one token to compute logits from), and prefills the rest itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbridge.server.channel import parse_target, resolve_transport

PARAMS_KEY = "kvbridge"  # the key under kv_transfer_params


@dataclass(frozen=True)
class ServerRef:
    """One kvbridge service as the engine calls it: one `kvbridge serve`, or replicas behind one name.

    address: "host:port" of one server; replicas as "ip:port,ip:port,..." (or a JSON list of them), balanced by
    gRPC over the ones whose health check says SERVING, a call retried on another when its replica dies; or
    "dns:///name:port", every address the name resolves to a replica. Replicas must share a tier (`--redis-url`, or
    the cluster tier): an entry ingested through one is NOT_FOUND on a replica that does not share it. Same-host
    fetches (shared memory) go to one replica the client picks, so the segment's release reaches it; a DNS name
    gives no addresses to pick from, and streams."""

    address: str | tuple[str, ...]  # as above; a list from the config is kept as a tuple
    token: str = ""  # bearer token ("" for a server without a token file); replicas share their token file
    # "auto": through the server's shared memory when every address is a loopback one (the worker reads the server's
    # segment), else streamed; "stream" or "shared_memory" to choose
    transport: str = "auto"

    def __post_init__(self):
        if self.transport not in ("auto", "stream", "shared_memory"):
            raise ValueError(f"a kvbridge server's transport must be auto, stream or shared_memory, got "
                             f"{self.transport!r}")
        if isinstance(self.address, (list, tuple)):
            object.__setattr__(self, "address", tuple(self.address))
        elif not isinstance(self.address, str):
            raise ValueError(f"a kvbridge server address must be text or a list of addresses, got {self.address!r}")
        try:
            resolve_transport(self.transport, parse_target(self.address))
        except ValueError as exc:
            raise ValueError(f"kvbridge server address {self.address!r}: {exc}") from None


@dataclass(frozen=True)
class ConnectorConfig:
    """The connector's part of `kv_transfer_config["kv_connector_extra_config"]`, read once per engine."""

    servers: dict[str, ServerRef]  # by the name requests use ("default" when they name none)
    target_model: str = ""  # the target's model name on the server ("": the server's only/first target)
    timeout_s: float = 10.0  # one fetch (on a fetch thread: the scheduler never waits for it)
    retries: int = 1  # UNAVAILABLE retries: a server that is down costs about timeout-free backoff, not minutes
    recompute_tokens: int = 0  # default for requests that give none (the last token is always left to vLLM)
    staging_dir: str = "/dev/shm"  # the engine's private folder for fetched KV goes here (handoff; same host)
    mode: str = ""  # the server's correction for requests that name none ("": the server's own default)
    fetch_threads: int = 4  # lookups (fetch, match, stage) running at once, off the scheduler's thread
    # A step that schedules nothing while lookups run waits this long for one to end (or less: it returns as soon
    # as one does). vLLM otherwise steps an empty batch about every millisecond, which keeps a CPU worker busy and
    # takes a same-host kvbridge server's cores from its projection; the cost: a request arriving at an engine that
    # has nothing else to do starts up to this much later. 0: no wait.
    idle_wait_ms: float = 10.0

    def __post_init__(self):
        if not self.servers:
            raise ValueError("the kvbridge connector needs at least one server (kvbridge_servers or kvbridge_address)")
        if self.timeout_s <= 0:
            raise ValueError(f"kvbridge_timeout_s must be > 0, got {self.timeout_s}")
        if not 0 <= self.idle_wait_ms <= 1000:
            raise ValueError(f"kvbridge_idle_wait_ms must be within [0, 1000], got {self.idle_wait_ms}")
        if self.fetch_threads < 1:
            raise ValueError(f"kvbridge_fetch_threads must be >= 1, got {self.fetch_threads}")
        if self.retries < 0 or self.recompute_tokens < 0:
            raise ValueError("kvbridge_retries and kvbridge_recompute_tokens must be >= 0")
        if self.mode:
            _check_mode(self.mode, "kvbridge_mode")

    def open_client(self, name: str):
        """A KVBridgeClient for the server this engine calls `name` (its address, token and transport; the engine's
        timeout and retries); ValueError naming the engine's servers when there is none of that name."""
        from kvbridge.server.client import KVBridgeClient

        if name not in self.servers:
            raise ValueError(f"no kvbridge server named {name!r} in this engine's kvbridge_servers "
                             f"({sorted(self.servers)})")
        ref = self.servers[name]
        return KVBridgeClient(ref.address, token=ref.token or None, timeout_s=self.timeout_s, retries=self.retries,
                              max_message_mb=64, transport=ref.transport)

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        """From the extra config's `kvbridge_*` fields:
        kvbridge_address + kvbridge_token (or kvbridge_token_file) + kvbridge_transport: the "default" server;
        kvbridge_servers: {name: {"address": ..., "token": ..., "transport": ...}} for more (or instead);
        an address is "host:port", or replicas behind one name: "ip:port,ip:port", a list, or "dns:///name:port"
        (ServerRef);
        kvbridge_target_model, kvbridge_timeout_s, kvbridge_retries, kvbridge_recompute_tokens,
        kvbridge_staging_dir, kvbridge_mode (the correction asked of the server: replace, recompute:R, blend:R),
        kvbridge_fetch_threads, kvbridge_idle_wait_ms."""
        servers = {name: ServerRef(s["address"], s.get("token", ""), s.get("transport", "auto")) for name, s in
                   (extra.get("kvbridge_servers") or {}).items()}
        if extra.get("kvbridge_address"):
            token = extra.get("kvbridge_token", "")
            if extra.get("kvbridge_token_file"):
                token = Path(extra["kvbridge_token_file"]).read_text().strip()
            servers["default"] = ServerRef(extra["kvbridge_address"], token, extra.get("kvbridge_transport", "auto"))
        return cls(servers=servers, target_model=extra.get("kvbridge_target_model", ""),
                   timeout_s=float(extra.get("kvbridge_timeout_s", cls.timeout_s)),
                   retries=int(extra.get("kvbridge_retries", cls.retries)),
                   recompute_tokens=int(extra.get("kvbridge_recompute_tokens", cls.recompute_tokens)),
                   staging_dir=extra.get("kvbridge_staging_dir", cls.staging_dir),
                   mode=extra.get("kvbridge_mode", cls.mode),
                   fetch_threads=int(extra.get("kvbridge_fetch_threads", cls.fetch_threads)),
                   idle_wait_ms=float(extra.get("kvbridge_idle_wait_ms", cls.idle_wait_ms)))


def cache_dtype_refusal(cache_dtype: str, model_dtype: str) -> str:
    """Why the connector can neither load into nor save from an engine whose KV cache is stored as `cache_dtype`
    (vLLM's --kv-cache-dtype) for a model computing in `model_dtype` ("" when it can): the KV crosses the wire in the
    model's dtype and the workers write and read it as it is, so a quantized cache (fp8: bytes with scales) would get
    bf16 values truncated to bytes and hand out bytes for values."""
    if cache_dtype in ("auto", model_dtype):
        return ""
    return (f"the engine's KV cache dtype is {cache_dtype!r} (--kv-cache-dtype) and its model computes in "
            f"{model_dtype}: the connector loads and saves KV in the model's dtype only (leave --kv-cache-dtype auto)")


@dataclass(frozen=True)
class RequestContext:
    """One request's kvbridge context, from kv_transfer_params["kvbridge"]."""

    key: str | None
    text: str | None
    adapter: str = ""
    server: str = "default"
    recompute_tokens: int | None = None  # None: the engine's default
    mode: str | None = None  # the server's correction (replace, recompute:R, blend:R); None: the engine's default

    @classmethod
    def from_params(cls, kv_transfer_params: dict[str, Any] | None) -> RequestContext | None:
        """None when the request has no kvbridge context; ValueError (a sentence naming the field) when it has a
        malformed one. Every field's type is checked: the context is hashed on vLLM's scheduler thread
        (`plans.Covered`), where a list kept in it would raise."""
        if not _has_kvbridge(kv_transfer_params):
            return None
        p = kv_transfer_params[PARAMS_KEY]
        if not isinstance(p, dict):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] must be a dict, got {type(p).__name__}")
        unknown = set(p) - {"key", "text", "adapter", "server", "recompute_tokens", "mode", "save"}
        if unknown:
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] has unknown fields {sorted(unknown, key=repr)}")
        if "save" in p:  # a request of the save side (SaveRequest), not a load
            if set(p) != {"save"}:
                raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}]['save'] goes alone (a request saves its KV "
                                 f"or loads a context, not both); got also {sorted(set(p) - {'save'}, key=repr)}")
            return None
        key, text = p.get("key"), p.get("text")
        if (key is None) == (text is None):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}] needs exactly one of 'key' and 'text'")
        for name in ("key", "text", "adapter", "server"):  # None: not given
            if p.get(name) is not None:
                _check_text(p[name], name, empty=name == "adapter")
        adapter = "" if p.get("adapter") is None else p["adapter"]
        server = "default" if p.get("server") is None else p["server"]
        recompute = p.get("recompute_tokens")
        if recompute is not None and (not isinstance(recompute, int) or isinstance(recompute, bool) or recompute < 0):
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}]['recompute_tokens'] must be an int >= 0, got "
                             f"{recompute!r:.80}")
        mode = p.get("mode")
        if mode is not None:
            _check_mode(mode, "mode")
        return cls(key=key, text=text, adapter=adapter, server=server, recompute_tokens=recompute, mode=mode)


def _has_kvbridge(kv_transfer_params: Any) -> bool:
    """Whether a request's kv_transfer_params hold a kvbridge field; ValueError when they are no dict."""
    if kv_transfer_params is None:
        return False
    if not isinstance(kv_transfer_params, dict):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(kv_transfer_params).__name__}")
    return PARAMS_KEY in kv_transfer_params


def _check_text(value: Any, name: str, empty: bool = False) -> None:
    """ValueError naming the field unless `value` is a string (and not "" unless `empty`)."""
    if not isinstance(value, str) or not (value or empty):
        raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}][{name!r}] must be a {'' if empty else 'non-empty '}"
                         f"string, got {value!r:.80}")


@dataclass(frozen=True)
class SaveRequest:
    """A request of the save side (an engine with kv_role kv_producer or kv_both): store the KV vLLM computes for
    its prompt's first `tokens` tokens (None: all of them) in the kvbridge server `server`, as a source entry:
    kv_transfer_params={"kvbridge": {"save": {"server": "default", "tokens": N}}} (both optional)."""

    server: str = "default"
    tokens: int | None = None

    @classmethod
    def from_params(cls, kv_transfer_params: dict[str, Any] | None) -> SaveRequest | None:
        """None when the request asks for no save; ValueError (a sentence) when it asks with a malformed one."""
        p = kv_transfer_params[PARAMS_KEY] if _has_kvbridge(kv_transfer_params) else None
        if not isinstance(p, dict) or "save" not in p:
            return None
        save = p["save"]
        if not isinstance(save, dict) or set(save) - {"server", "tokens"}:
            raise ValueError(f"kv_transfer_params[{PARAMS_KEY!r}]['save'] must be a dict with optional 'server' and "
                             f"'tokens', got {save!r:.200}")
        tokens = save.get("tokens")
        if tokens is not None and (not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1):
            raise ValueError(f"save tokens must be an int >= 1, got {tokens!r}")
        server = save.get("server", "default")
        if not isinstance(server, str) or not server:
            raise ValueError(f"save server must be a server name, got {server!r}")
        return cls(server=server, tokens=tokens)


def _check_mode(mode: Any, field_name: str) -> None:
    """A correction name as the server takes it ('replace', 'recompute:R', 'blend:R'); ValueError otherwise."""
    kind, sep, value = mode.partition(":") if isinstance(mode, str) else ("", "", "")
    try:
        ok = (kind == "replace" and not sep) or (kind in ("recompute", "blend") and 0 < float(value) <= 1)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{field_name} must be 'replace', 'recompute:R' or 'blend:R' with R in (0, 1], got {mode!r}")


def request_params(key: str | None = None, text: str | None = None, adapter: str = "", server: str = "default",
                   recompute_tokens: int | None = None, mode: str | None = None) -> dict[str, Any]:
    """SamplingParams extra_args that ask the connector for a context: {"kv_transfer_params": {"kvbridge": ...}}."""
    p: dict[str, Any] = {"key": key} if key is not None else {"text": text}
    if adapter:
        p["adapter"] = adapter
    if server != "default":
        p["server"] = server
    if recompute_tokens is not None:
        p["recompute_tokens"] = recompute_tokens
    if mode is not None:
        p["mode"] = mode
    RequestContext.from_params({PARAMS_KEY: p})  # the same checks the connector makes
    return {"kv_transfer_params": {PARAMS_KEY: p}}


@dataclass(frozen=True)
class Match:
    """How much of a prompt a projected cache covers."""

    common: int  # tokens the prompt and the projected cache's ids share from the start
    loadable: int  # the tokens vLLM will load: whole blocks, below the prompt's last token, past recompute_tokens
    reason: str = ""  # why loadable is 0 when it is ("" otherwise)
    extra: dict = field(default_factory=dict)


def match_prompt(prompt_ids: list[int], cache_ids: list[int], block_size: int, recompute_tokens: int = 0) -> Match:
    """The longest block-aligned prefix of `prompt_ids` that `cache_ids` (the projected cache's target tokens) covers,
    leaving the prompt's last token and at least `recompute_tokens` of the covered context to vLLM."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    common = 0
    for a, b in zip(prompt_ids, cache_ids):
        if a != b:
            break
        common += 1
    usable = min(common - recompute_tokens, len(prompt_ids) - 1)
    loadable = max(0, usable) // block_size * block_size
    if loadable:
        return Match(common, loadable)
    if common < len(cache_ids) and common < len(prompt_ids):
        reason = (f"the prompt shares only its first {common} tokens with the projected cache, less than a block of "
                  f"{block_size}")
    else:
        reason = (f"the {common} shared tokens (less {recompute_tokens} to recompute and the prompt's last token) "
                  f"fill no whole block of {block_size}")
    return Match(common, 0, reason)
