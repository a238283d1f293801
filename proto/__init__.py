"""The kvbridge.v1 wire protocol: `kvbridge/v1/kvbridge.proto` and its generated stubs (regenerate with
`python -m kvbridge.proto.generate`; a test fails when the committed stubs and the .proto disagree).

`from kvbridge.proto import pb2, pb2_grpc` gives the messages and the service stubs (imported on first use, so
the generator runs even when the stubs are missing)."""

import importlib

_STUBS = {"pb2": "kvbridge.proto.kvbridge.v1.kvbridge_pb2", "pb2_grpc": "kvbridge.proto.kvbridge.v1.kvbridge_pb2_grpc"}


def __getattr__(name: str):
    if name in _STUBS:
        return importlib.import_module(_STUBS[name])
    raise AttributeError(f"module 'kvbridge.proto' has no attribute {name!r}")
