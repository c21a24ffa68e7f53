"""tierrun: a launcher for distributed PyTorch training with a tiered, coalescing store."""

__version__ = "0.1.0"
