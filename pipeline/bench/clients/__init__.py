"""What the load generator talks to: the in-process engine and a Triton endpoint (gRPC or HTTP SSE)."""
