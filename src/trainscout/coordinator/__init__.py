"""The coordinator: one per job; keeps the job model, runs detectors, emits findings to sinks."""
