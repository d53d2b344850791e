"""False positives: healthy runs must stay free of findings (`python -m benchmarks false-positives MODE`)."""
