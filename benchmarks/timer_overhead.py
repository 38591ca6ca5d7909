"""What ps_bench's own timing costs: a ``noop`` trainer round with and without instrumentation.

One process, a one-rank gloo group, the default model and data (or ``--model``/``--data``).
"timed" is ``DdpTrainer.run_round`` exactly as a run uses it (clock readings, the hook wrapper
that times each bucket, byte-counter readings, the samples worked out after the round, peak
memory); "untimed" is the same loop with only the timing taken out (see ``untimed_round``) and
the bare noop hook. The two alternate, PAIRS times each, on two sets of models (each side has
one built early and one built late); each pair gives the relative difference of two rounds run
back to back, and the median of those is the overhead (a shared machine moves both rounds of a
pair alike). Prints it in percent with its 95 % confidence interval (from the order statistics
of the pairs, no assumption about their distribution), the quartiles, and the per-iteration
medians. Rounds of a few dozen sub-millisecond iterations differ by several percent from one to
the next on a small VM, so a figure of 1-2 % needs about a thousand pairs to be told apart
from zero.

    python benchmarks/timer_overhead.py [--pairs N] [--epochs N] [--model NAME [--data NAME]]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from ps_bench.config import RunConfig  # noqa: E402
from ps_bench.runtime.faults import Fault, maybe_inject  # noqa: E402
from ps_bench.job import validate  # noqa: E402
from ps_bench.models import build_data, build_model  # noqa: E402
from ps_bench.strategies.base import HookContext  # noqa: E402
from ps_bench.trainers.trainer import DdpTrainer  # noqa: E402


def untimed_round(model: nn.Module, optimizer: torch.optim.Optimizer, ctx: HookContext, fault: Fault | None,
                  inputs: tuple[torch.Tensor, ...], targets: torch.Tensor, batch_size: int,
                  iterations: int) -> list[float]:
    """``DdpTrainer.run_round``'s loop with its timers taken out. Kept, since a run needs them
    without any timing: the batches, the training step, the loss record, the iteration count
    the hooks read, the fault check and the flags of the round's special iterations (here only
    the last, which notes the bucket sizes). Gone: the clock readings, the hook wrapper that
    times each bucket, the byte-counter readings, and turning them into samples after the round."""
    loss_fn = nn.CrossEntropyLoss()
    per_epoch = len(targets) // batch_size
    losses = []
    last = iterations - 1
    special = {last}
    iteration = ctx.iteration
    for step in range(iterations):
        first = (step % per_epoch) * batch_size
        x, y = [t[first:first + batch_size] for t in inputs], targets[first:first + batch_size]
        iteration += 1
        ctx.iteration = iteration
        marked = step in special
        if marked:
            ctx.capturing, ctx.noting = False, step == last
        if fault is not None:
            maybe_inject(fault, "trainer", 0, iteration)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(*x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
        if marked:
            ctx.capturing = ctx.noting = False
    return torch.stack(losses).float().cpu().tolist()


def median_interval(ordered: list[float], z: float = 1.96) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of sorted samples: the order
    statistics ``n/2 -+ z*sqrt(n)/2`` (the binomial count of samples below the median)."""
    n = len(ordered)
    half_width = z * math.sqrt(n) / 2
    return ordered[max(0, math.floor(n / 2 - half_width))], ordered[min(n - 1, math.ceil(n / 2 + half_width))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=1000, help="timed/untimed pairs (default 1000)")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the shard per round (default 1)")
    parser.add_argument("--model", default=RunConfig.model,
                        help=f"model entry or zoo model (default {RunConfig.model}, the default run's)")
    parser.add_argument("--data", default=None, help="data entry (default: the model's own, as bench.py chooses)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = RunConfig(hook="noop", nserver=0, ntrainer=1, epochs=args.epochs, model=args.model, data=args.data)
    job = validate(cfg, gpus=0)
    model_entry, data_entry = job.model, job.data
    dataset = build_data(data_entry.class_name, data_entry.kwargs, cfg.torch_seed)
    store = Path(tempfile.mkdtemp()) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)

    def timed_trainer() -> DdpTrainer:
        return DdpTrainer(0, cfg, job.strategy, model_entry, dataset.inputs, dataset.targets, servers=[], group_server=None,
                          cuda_rpc=False, device="cpu")

    def untimed_model() -> tuple[nn.Module, torch.optim.Optimizer]:
        bare = DistributedDataParallel(build_model(model_entry.class_name, model_entry.kwargs, cfg.torch_seed),
                                       bucket_cap_mb=cfg.bucket_cap_mb)  # the trainer's buckets
        bare.register_comm_hook(None, debugging_hooks.noop_hook)
        return bare, torch.optim.SGD(bare.parameters(), lr=cfg.lr)

    # Built in the order timed, untimed, untimed, timed, and used in turn: on a small VM a model
    # built later ran a few us per iteration faster (where its memory landed), so each side gets
    # one model built early and one built late.
    early_timed, early_untimed = timed_trainer(), untimed_model()
    late_untimed, late_timed = untimed_model(), timed_trainer()
    sides = [(early_timed, early_untimed), (late_timed, late_untimed)]
    bare_context = HookContext(dist.group.WORLD, [], cfg.mapping, None, False, cfg.rpc_timeout)  # the hook ignores it
    iterations = early_timed.ready()
    durations: dict[str, list[float]] = {"timed": [], "untimed": []}
    for pair in range(args.pairs + 2):  # the first pair of each set warms it up and is dropped
        timed, (bare, optimizer) = sides[pair % 2]
        for kind in ("untimed", "timed") if (pair // 2) % 2 else ("timed", "untimed"):
            start = time.perf_counter()
            if kind == "timed":
                timed.run_round()
            else:
                untimed_round(bare, optimizer, bare_context, None, dataset.inputs, dataset.targets, cfg.batch_size,
                              iterations)
            if pair > 1:
                durations[kind].append((time.perf_counter() - start) * 1000 / iterations)
    dist.destroy_process_group()
    untimed, timed_ms = durations["untimed"], durations["timed"]
    overheads = sorted(100 * (t - u) / u for t, u in zip(timed_ms, untimed))
    q1, median, q3 = statistics.quantiles(overheads, n=4)
    low, high = median_interval(overheads)
    print(f"noop, model {cfg.model}, {iterations} iterations per round, {args.pairs} pairs")
    print(f"per iteration (medians): untimed {statistics.median(untimed):.4f} ms, "
          f"timed {statistics.median(timed_ms):.4f} ms")
    extra_us = statistics.median(1000 * (t - u) for t, u in zip(timed_ms, untimed))
    print(f"instrumentation overhead, median of the pairs: {median:+.2f} % (95 % CI {low:+.2f} % to {high:+.2f} %; "
          f"quartiles {q1:+.2f} % to {q3:+.2f} %), {extra_us:+.1f} us per iteration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
