"""Where allreduce's gap to its floor goes, outside ps_bench: two gloo processes on this machine,
the 9.45 MB model of ``strategy_floors.py`` (one DDP bucket), no DDP, no hook, no RPC.

Per repetition, each process times one all-reduce of the model's gradients (one flat float32
tensor) in three settings:

- ``floor``: after a barrier (what ``--limits`` measures);
- ``after backward``: right after its own forward and backward (what DDP's single bucket meets:
  each process starts when its backward ends, and waits for the other's);
- ``after backward and a barrier``: the same backward, then a barrier, then the all-reduce (the
  skew between the two backwards taken out; what is left is the all-reduce itself, after the
  backward's use of caches and cores).

Prints the p50 of each and the backward's own p50, with the spread between the two processes'
backward ends. ``python benchmarks/allreduce_gap.py [--repeat 200]``; about 30 s on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ps_bench.models.base import build_model  # noqa: E402

MODEL = ("DummyModel", {"num_embeddings": 1024, "embedding_dim": 512, "dense_input_size": 512,
                        "dense_output_size": 512, "dense_layers_count": 7})
BATCH = 32
SAMPLE_LENGTH = 1024


def ms() -> float:
    return time.perf_counter() * 1000.0


def worker(rank: int, port: int, repeat: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = build_model(MODEL[0], MODEL[1], 0)
    inputs = torch.randint(0, MODEL[1]["num_embeddings"], (BATCH, SAMPLE_LENGTH))  # DummyData's bags
    targets = torch.randint(0, MODEL[1]["dense_output_size"], (BATCH,))
    flat = torch.ones(sum(p.numel() for p in model.parameters()))
    loss_fn = torch.nn.CrossEntropyLoss()
    samples = {"floor": [], "after backward": [], "after backward and a barrier": [], "backward": [], "ended": []}

    def backward() -> None:
        model.zero_grad(set_to_none=True)
        loss_fn(model(inputs), targets).backward()

    for index in range(repeat + 5):
        dist.barrier()
        start = ms()
        dist.all_reduce(flat)
        floor = ms() - start
        dist.barrier()
        start = ms()
        backward()
        ended = ms()
        dist.all_reduce(flat)
        after = ms() - ended
        dist.barrier()
        backward()
        dist.barrier()
        start2 = ms()
        dist.all_reduce(flat)
        settled = ms() - start2
        if index >= 5:
            samples["floor"].append(floor)
            samples["after backward"].append(after)
            samples["after backward and a barrier"].append(settled)
            samples["backward"].append(ended - start)
            samples["ended"].append(ended)  # CLOCK_MONOTONIC: one clock for both processes
    out[rank] = samples
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200, help="timed repetitions (default 200)")
    args = parser.parse_args()
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(port, args.repeat, out), nprocs=2)
        results = dict(out)
    mb = sum(p.numel() for p in build_model(MODEL[0], MODEL[1], 0).parameters()) * 4 / 1e6
    print(f"gloo all-reduce of {mb:.2f} MB between 2 processes, {args.repeat} repetitions, p50 ms per process:")
    for key in ("floor", "after backward", "after backward and a barrier", "backward"):
        print(f"  {key:30} " + "  ".join(f"{statistics.median(results[r][key]):8.3f}" for r in (0, 1)))
    skew = [abs(a - b) for a, b in zip(results[0]["ended"], results[1]["ended"])]
    print(f"  {'backward ends apart (p50)':30} {statistics.median(skew):8.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
