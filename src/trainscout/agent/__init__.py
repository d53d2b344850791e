"""The node agent: one process per node, out-of-band, reads every local rank's channel and reports."""
