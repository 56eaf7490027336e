"""Generated gRPC stubs for shared/proto/engine.proto (see `make proto`)."""
