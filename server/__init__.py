"""kvbridge.server: both ends of the wire — the service as a library, the gRPC servicer, auth, config, metrics,
`kvbridge serve` — and the client (KVBridgeClient, ProjectedContext)."""

from kvbridge.transfer.exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "kvbridge.server.service": ["KVBridgeService", "ServiceLimits"],
    "kvbridge.server.config": ["ServeConfig"],
    "kvbridge.server.app": ["build_service", "start_server", "serve"],
    "kvbridge.server.client": ["KVBridgeClient", "KVBridgeError"],
    "kvbridge.server.projected_context": ["ProjectedContext"],
    "kvbridge.server.errors": ["FailedPrecondition"],
})
