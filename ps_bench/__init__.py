"""ps_bench: a benchmark suite for gradient synchronisation in data-parallel PyTorch training."""

__version__ = "0.1.0"
