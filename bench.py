"""ps_bench entry point: ``python bench.py --help``."""

import sys
import time

launched_at = time.time()  # "ready after N s" counts from here, imports included

from ps_bench.runtime import preload  # noqa: E402  (no torch: it starts the ranks' interpreter first)

if __name__ == "__main__":
    if preload.starts_ranks(sys.argv[1:]):
        preload.start(debug="--debug" in sys.argv)  # it imports torch while this process does too
    from ps_bench.cli import main

    sys.exit(main(launched_at=launched_at))
