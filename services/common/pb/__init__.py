"""Generated gRPC/protobuf stubs. Do not edit: run `make proto`."""
