"""Per-rank shared-memory channel: the probe writes, the node agent reads (see layout.py)."""
