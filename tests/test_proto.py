"""The committed stubs are what grpcio-tools makes of the committed .proto (one policy: committed, checked)."""

from __future__ import annotations


def test_committed_stubs_match_the_proto(capsys):
    from kvbridge.proto.generate import main

    assert main(["--check"]) == 0, capsys.readouterr().err


def test_stubs_are_importable_and_describe_the_service():
    from kvbridge.proto import pb2, pb2_grpc

    service = pb2.DESCRIPTOR.services_by_name["KVBridge"]
    assert service.full_name == "kvbridge.v1.KVBridge"
    methods = {m.name for m in service.methods}
    assert {"Ingest", "PutSourceKV", "Lookup", "GetProjectedCache", "GetSourceCache", "ListAdapters", "LoadAdapter",
            "Delete", "Stats"} <= methods
    assert service.methods_by_name["PutSourceKV"].client_streaming
    assert service.methods_by_name["GetProjectedCache"].server_streaming
    assert hasattr(pb2_grpc, "KVBridgeStub") and hasattr(pb2_grpc, "add_KVBridgeServicer_to_server")
