"""Pure detectors: job observations in, findings out. No torch, no I/O (see DESIGN.md)."""
