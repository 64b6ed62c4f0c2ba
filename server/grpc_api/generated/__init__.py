"""protoc's output for Triton's .proto files (server/grpc_api/generate.py); not edited by hand."""
