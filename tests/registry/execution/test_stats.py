"""Per runner-version statistics (Triton's statistics extension)."""

from plugserve.registry.execution.stats import RunnerStats


def test_batch_stats_keep_a_bounded_number_of_sizes() -> None:
    """Attack round after issue 12: every distinct row count a client sent (a request over
    max_batch_size runs alone, at its own size) added a batch_stats entry for good: 3,000
    requests of 1..3,000 rows made 3,000 entries (443 KB of /v2/models/{route}/stats)."""
    stats = RunnerStats()
    for rows in range(1, 5001):
        stats.record_execution(rows, 0.001)
    stats.record_execution(1, 0.001)
    sizes = [entry["batch_size"] for entry in stats.as_triton("r", "1.0.0")["batch_stats"]]
    assert sizes == list(range(1, 1025))  # the first 1024 sizes seen
    assert stats.batches[1].count == 2
    assert stats.execution_count == 5001  # every execution counts in the totals
