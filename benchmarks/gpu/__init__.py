"""GPU: cost, fingerprint speed and the hpZ race on CUDA machines (`python -m benchmarks gpu MODE`)."""
