"""Bearer tokens to tenants: a token file, and a gRPC interceptor that refuses calls without a valid token.

Token file: one `tenant token` pair per line; blank lines and lines starting with # are ignored; a file other users
may read is refused (mode 600, or 640). Tenants are names (letters, digits, . _ -); tokens are at least 16
characters. Without a token file every caller is the one tenant OPEN_TENANT (the server then listens on loopback
only). Health and reflection stay open: probes and grpcurl-style tools need them, and they reveal no cache.
"""

from __future__ import annotations

import hmac
import re
from pathlib import Path

import grpc
from kvbridge.transfer.private_file import read_private_file

OPEN_TENANT = "default"
TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MIN_TOKEN_CHARS = 16
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def read_token_file(path: str | Path) -> dict[str, str]:
    """token -> tenant. Raises ValueError naming the file when it does not exist, is not a regular file or can be
    read or written by users other than its owner and group (mode bits for others set: `chmod 600`, or 640 for a
    group of its own; the same rule as the Redis secret file's), and naming the line that is wrong."""
    path = Path(path).expanduser()
    data = read_private_file(path, "token file")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise ValueError(f"token file {path} is not UTF-8 text") from None
    tokens: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{number}: expected 'tenant token', got {len(parts)} fields")
        tenant, token = parts
        if not TENANT.fullmatch(tenant):
            raise ValueError(f"{path}:{number}: tenant {tenant!r} must be letters, digits, '.', '_' or '-'")
        if len(token) < MIN_TOKEN_CHARS:
            raise ValueError(f"{path}:{number}: the token of {tenant!r} is shorter than {MIN_TOKEN_CHARS} characters")
        if token in tokens:
            raise ValueError(f"{path}:{number}: the same token is given twice")
        tokens[token] = tenant
    if not tokens:
        raise ValueError(f"{path}: no tokens (a token file with none would lock everyone out)")
    return tokens


class Authenticator:
    def __init__(self, tokens: dict[str, str] | None):
        self.tokens = tokens  # None: open server

    @property
    def open(self) -> bool:
        return self.tokens is None

    def tenant(self, metadata) -> str | None:
        """The tenant of a call's metadata, or None when its token is missing or wrong."""
        if self.tokens is None:
            return OPEN_TENANT
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if not isinstance(value, str) or not value.startswith("Bearer "):
            return None
        given = value[len("Bearer "):].strip().encode()
        found = None
        for token, tenant in self.tokens.items():  # compare with every token in constant time
            if hmac.compare_digest(given, token.encode()):
                found = tenant
        return found


def _abort_handler(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    def abort(request_or_iterator, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses every kvbridge call whose bearer token is missing or wrong with UNAUTHENTICATED."""

    def __init__(self, auth: Authenticator, metrics=None):
        self.auth = auth
        self.metrics = metrics  # server.metrics.Metrics: refusals counted by method, as the servicer counts calls

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self.auth.open or handler_call_details.method.startswith(OPEN_PREFIXES):
            return handler
        if self.auth.tenant(handler_call_details.invocation_metadata) is None:
            has = any(k == "authorization" for k, _ in handler_call_details.invocation_metadata or ())
            why = "the bearer token is not valid" if has else "missing 'authorization: Bearer <token>' metadata"
            if self.metrics is not None:
                self.metrics.requests.labels(handler_call_details.method.rpartition("/")[2], "UNAUTHENTICATED").inc()
            return _abort_handler(handler, why)
        return handler
