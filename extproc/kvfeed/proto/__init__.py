"""Generated gRPC/protobuf code of proto/feedback.proto; regenerate with scripts/gen_proto.sh."""
