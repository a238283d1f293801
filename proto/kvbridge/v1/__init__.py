"""Generated from kvbridge.proto: do not edit the *_pb2* files, run `python -m kvbridge.proto.generate`."""
