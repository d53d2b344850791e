"""Overhead: what attaching trainscout costs a healthy job (`python -m benchmarks overhead MODE`)."""
