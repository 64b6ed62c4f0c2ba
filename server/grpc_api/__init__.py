"""The KServe v2 gRPC service (Triton's ``inference.GRPCInferenceService``)."""
