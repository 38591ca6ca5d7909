"""``python -m ps_bench`` (and ``torchrun -m ps_bench``) run ``bench.py``'s command line."""

from ps_bench.cli import entry_point

if __name__ == "__main__":
    entry_point()
