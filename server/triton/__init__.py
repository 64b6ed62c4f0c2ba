"""Triton's extensions of the v2 protocol, protocol-neutral: HTTP and gRPC both call them."""
