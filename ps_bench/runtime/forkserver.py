"""Imported first, and only, by the forkserver ranks are forked from
(``ps_bench.runtime.preload.PRELOAD``): it ties that process's life to its launcher's.

The forkserver ends when the launcher stops it (``ps_bench.runtime.preload.stop``), and, with this,
when the launcher dies however it dies (the kernel's parent-death signal), even while it is still
importing torch: nothing of a launcher killed by SIGKILL is left running. The ranks it forks do not
inherit the signal (it does not survive a fork); each sets its own. Nothing else imports this module
(``tests/unit/test_imports.py``).
"""

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1
# set by ps_bench.runtime.preload.start before the forkserver starts
LAUNCHER_PID = "PS_BENCH_LAUNCHER_PID"

try:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
except (OSError, AttributeError):
    # not Linux: it still ends once the launcher and its ranks are gone
    pass
# the launcher died before the prctl above
if os.environ.get(LAUNCHER_PID) not in (None, str(os.getppid())):
    os._exit(0)
