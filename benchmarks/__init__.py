"""trainscout's benchmarks: one entry point per question, `python -m benchmarks QUESTION [MODE]` (see README.md)."""
