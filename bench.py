"""ps_bench entry point: ``python bench.py --help``."""

import sys

from ps_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
