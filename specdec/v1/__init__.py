"""Generated gRPC stubs of the specdec.v1 protocol (run `make proto` to regenerate)."""
