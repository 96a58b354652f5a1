"""Generated gRPC/protobuf code for rlgate.v1 (make proto). Never edit by hand."""
