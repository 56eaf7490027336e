"""Generated gRPC stubs for services/proto/engine.proto (see `make proto`)."""
