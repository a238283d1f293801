"""kvbridge.proto: the wire protocol (`kvbridge/v1/kvbridge.proto`) and its generated Python stubs."""
