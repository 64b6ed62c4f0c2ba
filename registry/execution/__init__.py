"""Running requests: a loaded instance and how it is called (``components``), the chain of
stages, dynamic batching and priorities, streaming and continuous batching, the circuit
breaker, statistics, tracing, and isolated runners in processes of their own."""
