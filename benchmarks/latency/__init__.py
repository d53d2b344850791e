"""Latency: how fast an injected fault is named, and on which rank (`python -m benchmarks latency MODE`)."""
