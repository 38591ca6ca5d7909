"""What ps_bench's harness costs: each strategy's run against the plain torch loop a user would
write instead, on the same model, data, batch and optimizer, alternating, with the ratio of
their batch times and its confidence interval.

The plain loops import nothing of ps_bench but the model and its data (``ps_bench.models``), and
run as a user runs them: ``torch.multiprocessing.spawn`` over gloo on loopback, each trainer its
shard of the seeded data, ``CrossEntropyLoss``, SGD at ps_bench's defaults (lr 0.01), timing
each iteration with ``time.perf_counter`` after a warmup:

- allreduce: ``DistributedDataParallel``;
- fsdp: FSDP2, ``fully_shard`` on every module that holds parameters of its own, then the root;
- zero1: DDP with ``ZeroRedundancyOptimizer`` over SGD;
- local_sgd: DDP with torch's ``post_localSGD_hook`` (no gradient all-reduce) and its
  ``PeriodicModelAverager`` every 4 iterations (ps_bench's default), as torch documents them;
- local_sgd_no_ddp: the same averager on the bare model, no DDP (ps_bench's ``local_sgd`` is
  the other side): what DDP's buckets cost a loop that all-reduces no gradient;
- ps: upstream's parameter server, a DDP communication hook sending each bucket with
  ``rpc_async`` to one server that averages the trainers' buckets and answers them.

ps_bench runs the same strategy (``bench.py --hook H``, one server for ps) with the same
rounds. A pair is one run of each, in turns; the ratio is of the runs' batch p50s (ps_bench's
over the plain loop's: above 1, the harness is slower), its interval Welch's on the runs'
logarithms (``ps_bench.compare.intervals.runs_interval``, the statistics of ``bench.py
compare``). A second table does the same for the optimizer step within the iteration (ps_bench's
``optimizer`` phase: the step and what a strategy does after it, local SGD's averaging; the loop
times the same span), to say whether a difference lies there or in forward and backward.

    python benchmarks/plain_loops.py [--pairs N] [--strategies allreduce,ps,...] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.multiprocessing as mp
from torch import nn
from torch.futures import Future

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ps_bench.compare.intervals import runs_interval  # noqa: E402
from ps_bench.models import default_data, model_entry  # noqa: E402
from ps_bench.models.base import build_data, build_model  # noqa: E402
from ps_bench.models.entries import load_entry  # noqa: E402
from ps_bench.models import DATA, DATA_PRESETS  # noqa: E402

STRATEGIES = ("allreduce", "fsdp", "zero1", "local_sgd", "local_sgd_no_ddp", "ps")
HOOK = {"local_sgd_no_ddp": "local_sgd"}  # a plain loop's strategy as ps_bench names it
TRAINERS, BATCH, LR, SEED = 2, 16, 0.01, 0
WARMUP_ROUNDS, ROUNDS = 1, 2  # ps_bench's --warmup-rounds and --rounds, for both sides


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def workload(model_name: str) -> tuple:
    model = model_entry(model_name, {}, str(ROOT / "configs" / "model_configurations.json"))
    data = load_entry(str(ROOT / "configs" / "data_configurations.json"), default_data(model),
                      "data_class", DATA, "data", DATA_PRESETS)
    return model, data


class Server:
    """Upstream's parameter server: a bucket's contributions summed, averaged once every
    trainer's is in, and each trainer answered."""

    def __init__(self, trainers: int) -> None:
        self.trainers, self.waiting, self.sums = trainers, {}, {}
        self.lock = threading.Lock()

    def add(self, index: int, bucket: torch.Tensor) -> Future:
        future = Future()
        with self.lock:
            self.sums[index] = bucket.clone() if index not in self.sums else self.sums[index] + bucket
            self.waiting.setdefault(index, []).append(future)
            done = len(self.waiting[index]) == self.trainers
            if done:
                average, waiting = self.sums.pop(index) / self.trainers, self.waiting.pop(index)
        if done:
            for each in waiting:
                each.set_result(average)
        return future


SERVER: list[Server] = []  # the server process's own


@rpc.functions.async_execution
def average(index: int, bucket: torch.Tensor) -> Future:
    return SERVER[0].add(index, bucket)


def train(rank: int, strategy: str, model_name: str, ports: tuple[int, int], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    torch.set_num_threads(1)
    world = TRAINERS + (1 if strategy == "ps" else 0)
    if strategy == "ps":
        options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{ports[1]}")
        if rank == TRAINERS:
            SERVER.append(Server(TRAINERS))
        rpc.init_rpc("server" if rank == TRAINERS else f"trainer{rank}", rank=rank,
                     world_size=world, rpc_backend_options=options)
        if rank == TRAINERS:
            rpc.shutdown()
            return
    dist.init_process_group("gloo", rank=rank, world_size=TRAINERS)
    model_entry_, data_entry = workload(model_name)
    network = build_model(model_entry_.class_name, model_entry_.kwargs, SEED)
    shard = build_data(data_entry.class_name, data_entry.kwargs, SEED).shard(rank, TRAINERS)
    averager = None
    if strategy in ("allreduce", "zero1", "ps", "local_sgd"):
        network = nn.parallel.DistributedDataParallel(network)
    if strategy == "ps":
        network.register_comm_hook(None, lambda state, bucket: rpc.rpc_async(
            "server", average, args=(bucket.index(), bucket.buffer())))
    if strategy == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for module in list(network.modules())[1:]:
            if any(True for _ in module.parameters(recurse=False)):
                fully_shard(module)
        fully_shard(network)
    if strategy == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        optimizer = ZeroRedundancyOptimizer(network.parameters(), optimizer_class=torch.optim.SGD,
                                            lr=LR)
    else:
        optimizer = torch.optim.SGD(network.parameters(), lr=LR)
    if strategy == "local_sgd_no_ddp":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        averager = PeriodicModelAverager(period=4, warmup_steps=0)
    if strategy == "local_sgd":  # as torch's PeriodicModelAverager documents it, from step 0
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState, post_localSGD_hook)
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        # no gradient all-reduce after the warmup: without one, no subgroups (they need CUDA)
        state = PostLocalSGDState(process_group=None, subgroup=None, start_localSGD_iter=0,
                                  post_local_gradient_allreduce=False)
        network.register_comm_hook(state, post_localSGD_hook)
        averager = PeriodicModelAverager(period=4, warmup_steps=0)
    loss_fn = nn.CrossEntropyLoss()
    per_round = len(shard) // BATCH
    times = []
    for round_index in range(WARMUP_ROUNDS + ROUNDS):
        for step in range(per_round):
            x = [t[step * BATCH:(step + 1) * BATCH] for t in shard.inputs]
            y = shard.targets[step * BATCH:(step + 1) * BATCH]
            began = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss_fn(network(*x), y).backward()
            stepping = time.perf_counter()
            optimizer.step()
            if averager is not None:
                averager.average_parameters(network.parameters())
            if round_index >= WARMUP_ROUNDS:  # the iteration, and its optimizer step alone
                ended = time.perf_counter()
                times.append([(ended - began) * 1000.0, (ended - stepping) * 1000.0])
    Path(f"{out}.{rank}").write_text(json.dumps(times))
    dist.destroy_process_group()
    if strategy == "ps":
        rpc.shutdown()


def plain_p50(strategy: str, model_name: str, folder: Path) -> tuple[float, float]:
    """The plain loop's batch p50 and optimizer-step p50 (with local SGD's averaging), ms."""
    out = folder / f"plain-{strategy}"
    world = TRAINERS + (1 if strategy == "ps" else 0)
    for rank in range(TRAINERS):
        Path(f"{out}.{rank}").unlink(missing_ok=True)
    try:
        mp.spawn(train, args=(strategy, model_name, (free_port(), free_port()), str(out)),
                 nprocs=world, join=True)
    except mp.ProcessExitedException as error:  # gloo's teardown aborts now and then
        if not all(Path(f"{out}.{rank}").exists() for rank in range(TRAINERS)):
            raise
        print(f"{strategy}: a rank aborted after its timed iterations ({error}); its times kept",
              file=sys.stderr)
    times = [t for rank in range(TRAINERS) for t in json.loads(Path(f"{out}.{rank}").read_text())]
    return statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)


def bench_p50(strategy: str, model_name: str, folder: Path) -> tuple[float, float]:
    """ps_bench's trainer batch p50 and optimizer p50 (its step, and what a strategy does after
    it: local SGD's averaging), ms."""
    out = folder / f"bench-{strategy}.json"
    out.unlink(missing_ok=True)
    subprocess.run([sys.executable, str(ROOT / "bench.py"), "--hook", HOOK.get(strategy, strategy),
                    "--model", model_name, "--ntrainer", str(TRAINERS), "--nserver",
                    "1" if strategy == "ps" else "0", "--warmup-rounds", str(WARMUP_ROUNDS),
                    "--rounds", str(ROUNDS), "--batch-size", str(BATCH), "--out", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = {row["metric"]: row["p50"] for row in json.loads(out.read_text())["summary"]
               if row["role"] == "trainer"}
    return summary["batch"], summary["optimizer"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=6, help="runs of each side (default 6)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated, of {', '.join(STRATEGIES)} (default: all)")
    parser.add_argument("--model", default="DummyModel",
                        help="the model both sides train (default: DummyModel, 9.4 M parameters)")
    args = parser.parse_args()
    chosen = args.strategies.split(",")
    unknown = [name for name in chosen if name not in STRATEGIES]
    if unknown or args.pairs < 2:
        parser.error(f"unknown strategies {unknown}" if unknown else "--pairs must be 2 or more")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for strategy in chosen:
            plain, ours = [], []
            for pair in range(args.pairs):  # in turns: a machine whose load drifts moves both
                plain.append(plain_p50(strategy, args.model, Path(scratch)))
                ours.append(bench_p50(strategy, args.model, Path(scratch)))
                print(f"{strategy} pair {pair + 1}/{args.pairs}: plain {plain[-1][0]:.2f} ms, "
                      f"ps_bench {ours[-1][0]:.2f} ms", file=sys.stderr, flush=True)
            for part in (0, 1):  # the batch, then the optimizer step within it
                interval = runs_interval([p[part] for p in plain], [o[part] for o in ours])
                rows.append((strategy, part, statistics.median(p[part] for p in plain),
                             statistics.median(o[part] for o in ours), 1.0 + interval.change,
                             1.0 + interval.low, 1.0 + interval.high))
    print(f"model {args.model}, {TRAINERS} trainers, batch {BATCH}, {args.pairs} pairs; "
          f"p50 ms, ps_bench over the plain loop (95 % interval of the ratio of the runs' "
          f"geometric means)")
    for part, what in enumerate(("batch", "optimizer step (and local SGD's averaging)")):
        print(f"\n{what}:\n| strategy | plain p50 ms | ps_bench p50 ms | ratio | 95 % interval |")
        print("|---|---:|---:|---:|---|")
        for strategy, row_part, plain, ours, ratio, low, high in rows:
            if row_part == part:
                print(f"| {strategy} | {plain:.2f} | {ours:.2f} | {ratio:.3f} | {low:.3f} to "
                      f"{high:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
