"""Generated protobuf/gRPC stubs of the v1 wire contract."""
