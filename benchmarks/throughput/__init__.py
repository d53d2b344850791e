"""Throughput: how many bytes a second the fingerprint covers (`python -m benchmarks throughput MODE`)."""
