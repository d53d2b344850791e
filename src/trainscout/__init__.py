"""trainscout: names the rank, GPU or host that broke a distributed PyTorch job, while it runs."""

__version__ = "0.1.0"
