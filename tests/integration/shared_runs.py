"""The quick run that the family, engine and floors tests share through ``bench_runs``.

DummyModelSmall on 2 trainers, no servers, 2 timed rounds of 32 iterations. The runs the floors
test holds to their floors (``FLOORED``) carry ``--limits`` whichever test asks for them first:
the floors test reads the very runs the others check for what they train and send, and adds no
run of its own.
"""

from __future__ import annotations

from tests.contract import check_contract

QUICK = ("--nserver", "0", "--rounds", "2")
MODEL_BYTES = 800 * 4  # DummyModelSmall: 800 float32 parameters
# Options more than one of those tests runs with, spelled once so that their runs are one
DILOCO = ("--hook-option", "period=4", "--hook-option", "outer_lr=0.7", "--hook-option", "outer_momentum=0.9")
PER_HOST = ("--ntrainer", "4", "--per-host", "2")  # two hosts of two trainers
# (hook, options) held to the floor of its own collectives
FLOORED = [("fsdp", ("--verify",)), ("zero1", ("--verify",)), ("local_sgd", ("--hook-option", "period=4")),
           ("diloco", DILOCO), ("hierarchical", (*PER_HOST, "--verify")), ("hsdp", PER_HOST),
           ("deepspeed_zero2", ("--verify",)), ("torchft_diloco", DILOCO), ("sparse_ps", ("--nserver", "1"))]


def quick_args(hook: str, *options: str) -> tuple[str, ...]:
    """``--hook HOOK`` QUICK OPTIONS, with ``--limits`` where ``FLOORED`` holds them."""
    limits = ("--limits",) if (hook, tuple(options)) in FLOORED else ()
    return ("--hook", hook, *QUICK, *limits, *options)


def quick_run(bench_runs, hook: str, *options: str, timeout_s: float = 300) -> dict:
    """The results of ``quick_args`` (one run per distinct command line), which must have
    succeeded and kept the results-file contract."""
    results = bench_runs.ok(*quick_args(hook, *options), timeout_s=timeout_s)
    check_contract(results)
    return results
