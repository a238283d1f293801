"""kvbridge.server: the `kvbridge` command and both ends of the wire (gRPC servicer, auth, config, client)."""
