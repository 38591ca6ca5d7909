"""ps_bench entry point: ``python bench.py --help``."""

import sys
import time

launched_at = time.time()  # "ready after N s" counts from here, imports included

from ps_bench.runtime import preload  # noqa: E402  (no torch: it starts the ranks' interpreter first)

if __name__ == "__main__":
    if preload.starts_ranks(sys.argv[1:]):
        # it imports torch (and what the named model needs) while this process does too
        preload.start(debug="--debug" in sys.argv, models=preload.named_models(sys.argv[1:]))
    from ps_bench.cli import finish, main

    finish(main(launched_at=launched_at))
