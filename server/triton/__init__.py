"""Triton's extensions, protocol-neutral: what the HTTP handlers and the gRPC service both call."""
