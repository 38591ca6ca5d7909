"""Where allreduce's gap to its floor goes, outside ps_bench: two gloo processes on this machine,
the 9.45 MB model of ``strategy_floors.py`` (one DDP bucket), no DDP, no hook, no RPC.

Per repetition, each process times one all-reduce of the model's gradients (one flat float32
tensor) in three settings:

- ``floor``: after a barrier (what ``--limits`` measures);
- ``after backward``: right after its own forward and backward (what DDP's single bucket meets:
  each process starts when its backward ends, and waits for the other's);
- ``after backward and a barrier``: the same backward, then a barrier, then the all-reduce (the
  skew between the two backwards taken out; what is left is the all-reduce itself, after the
  backward's use of caches and cores);
- ``DDP's hook``: the same model in DDP with torch's all-reduce hook (what ps_bench's
  ``allreduce`` runs), timed as ps_bench times ``comm``: from the hook's call to its chained
  future's callback; split into the hook's division by the world size and the all-reduce with
  its callback.

With ``--loop`` each process instead trains: forward, backward (DDP, the hook as above) and an
SGD step back to back, 200 timed iterations without a barrier, as ps_bench's trainers do; then
the floor. Its ``comm`` splits as ``--split`` splits a ps_bench run's.

With ``--rpc`` the two processes also join a TensorPipe RPC world with two more idle processes,
as ps_bench's trainers do beside its master and a server: the threads and processes ps_bench
adds, without its trainer loop. Prints the p50 of each and the backward's own p50, with the
spread between the two processes' backward ends.
``python benchmarks/allreduce_gap.py [--repeat 200] [--rpc]``; about 40 s on 2 cores.

``--split RESULTS.json ...`` reads ps_bench runs of 2 trainers instead (``--limits``, one bucket)
and splits each one's ``comm`` p50 per iteration: the later trainer's comm (the all-reduce once
both have handed their bucket over) and the wait of the earlier one for it (the two trainers'
comm apart), against the run's floor.
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
from ps_bench.results.load import load_file  # noqa: E402

MODEL = ("DummyModel", {"num_embeddings": 1024, "embedding_dim": 512, "dense_input_size": 512,
                        "dense_output_size": 512, "dense_layers_count": 7})
BATCH = 32
SAMPLE_LENGTH = 1024


def ms() -> float:
    return time.perf_counter() * 1000.0


def idle(rank: int, rpc_port: int) -> None:
    """A master or a server of ps_bench's world, doing nothing until the trainers are done."""
    from torch.distributed import rpc
    torch.set_num_threads(1)
    rpc.init_rpc(f"idle{rank}", rank=rank, world_size=4, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=120))
    rpc.shutdown()


def worker(rank: int, port: int, repeat: int, out: dict, rpc_port: int | None, loop: bool = False) -> None:
    if rank >= 2:
        return idle(rank, rpc_port)
    torch.set_num_threads(1)
    if rpc_port is not None:
        from torch.distributed import rpc
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=4, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{rpc_port}", rpc_timeout=120))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    model = build_model(MODEL[0], MODEL[1], 0)
    inputs = torch.randint(0, MODEL[1]["num_embeddings"], (BATCH, SAMPLE_LENGTH))  # DummyData's bags
    targets = torch.randint(0, MODEL[1]["dense_output_size"], (BATCH,))
    flat = torch.ones(sum(p.numel() for p in model.parameters()))
    if loop:
        out[rank] = training_loop(model, repeat, flat)
        dist.destroy_process_group()
        if rpc_port is not None:
            rpc.shutdown()
        return
    loss_fn = torch.nn.CrossEntropyLoss()
    samples = {"floor": [], "after backward": [], "after backward and a barrier": [], "DDP's hook": [],
               "  its division": [], "  its all-reduce and callback": [], "backward": [], "ended": []}
    # bucket_cap_mb given, as ps_bench gives it: one bucket (left to DDP, the first would be 1 MB)
    ddp = torch.nn.parallel.DistributedDataParallel(build_model(MODEL[0], MODEL[1], 0), bucket_cap_mb=25)
    marks: list[float] = []

    def hook(state, bucket):  # torch's allreduce_hook, with ps_bench's clock reads around it
        marks.append(ms())
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        marks.append(ms())
        work = dist.all_reduce(tensor, async_op=True)

        def finished(fut):
            marks.append(ms())
            return fut.value()[0]
        return work.get_future().then(finished)

    ddp.register_comm_hook(None, hook)

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
        dist.barrier()
        marks.clear()
        ddp.zero_grad(set_to_none=True)
        loss_fn(ddp(inputs), targets).backward()
        assert len(marks) == 3, "one bucket per iteration"
        if index >= 5:
            samples["DDP's hook"].append(marks[2] - marks[0])
            samples["  its division"].append(marks[1] - marks[0])
            samples["  its all-reduce and callback"].append(marks[2] - marks[1])
            samples["floor"].append(floor)
            samples["after backward"].append(after)
            samples["after backward and a barrier"].append(settled)
            samples["backward"].append(ended - start)
            samples["ended"].append(ended)  # CLOCK_MONOTONIC: one clock for both processes
    out[rank] = samples
    dist.destroy_process_group()
    if rpc_port is not None:
        rpc.shutdown()


def training_loop(model: torch.nn.Module, repeat: int, flat: torch.Tensor) -> dict:
    """``--loop``: DDP's hook timed over back-to-back training iterations, then the floor."""
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=25)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    comm: list[float] = []

    def hook(state, bucket):
        start = ms()
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())

        def finished(fut):
            comm.append(ms() - start)
            return fut.value()[0]
        return dist.all_reduce(tensor, async_op=True).get_future().then(finished)

    ddp.register_comm_hook(None, hook)
    loss_fn = torch.nn.CrossEntropyLoss()
    inputs = torch.randint(0, MODEL[1]["num_embeddings"], (BATCH * 8, SAMPLE_LENGTH))
    targets = torch.randint(0, MODEL[1]["dense_output_size"], (BATCH * 8,))
    for index in range(repeat + 10):
        first = (index % 8) * BATCH
        optimizer.zero_grad(set_to_none=True)
        loss_fn(ddp(inputs[first:first + BATCH]), targets[first:first + BATCH]).backward()
        optimizer.step()
    floor = []
    for _ in range(100):
        dist.barrier()
        start = ms()
        dist.all_reduce(flat)
        floor.append(ms() - start)
    assert len(comm) == repeat + 10, "one bucket per iteration"
    return {"comm": comm[10:], "floor": floor}


def loop_split(results: dict) -> None:
    comm = [results[0]["comm"], results[1]["comm"]]
    floor = statistics.median(results[0]["floor"] + results[1]["floor"])
    cost = statistics.median(comm[0] + comm[1])
    later = statistics.median(min(pair) for pair in zip(*comm))
    wait = statistics.median(abs(a - b) for a, b in zip(*comm))
    print(f"DDP in a training loop of {len(comm[0])} iterations, p50 ms: floor {floor:.2f}, comm {cost:.2f} "
          f"(efficiency {floor / cost:.3f}), the later process's comm {later:.2f} (floor / that {floor / later:.3f}), "
          f"the earlier's wait {wait:.2f}")


def split(paths: list[str]) -> None:
    """Each run's efficiency, its floor, and its comm split into the later trainer's all-reduce and
    the earlier one's wait (comm intervals end together: an all-reduce ends for both at once)."""
    rows = []
    for path in paths:
        results = load_file(path)
        comm = [sample["metrics"]["comm"] for sample in results["samples"] if sample["role"] == "trainer"]
        if len(comm) != 2:
            sys.exit(f"--split: {path}: needs a run of 2 trainers")
        efficiency = results["efficiency"]
        later = statistics.median(min(pair) for pair in zip(*comm))
        wait = statistics.median(abs(a - b) for a, b in zip(*comm))
        rows.append((Path(path).name, efficiency["value"], efficiency["floor_ms"], efficiency["cost_ms"], later,
                     efficiency["floor_ms"] / later, wait, results["env"]["rpc"]["transport"]))
    print(f"{'run':32} {'efficiency':>10} {'floor ms':>9} {'comm p50':>9} {'later p50':>9} {'floor/later':>11} "
          f"{'wait p50':>9}  rpc")
    for row in rows:
        print(f"{row[0]:32} {row[1]:10.3f} {row[2]:9.2f} {row[3]:9.2f} {row[4]:9.2f} {row[5]:11.3f} {row[6]:9.2f}  "
              f"{row[7]}")
    if len(rows) > 1:
        print(f"{'median':32} {statistics.median(r[1] for r in rows):10.3f} {statistics.median(r[2] for r in rows):9.2f} "
              f"{statistics.median(r[3] for r in rows):9.2f} {statistics.median(r[4] for r in rows):9.2f} "
              f"{statistics.median(r[5] for r in rows):11.3f} {statistics.median(r[6] for r in rows):9.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=200, help="timed repetitions (default 200)")
    parser.add_argument("--rpc", action="store_true", help="join an RPC world of 4 (2 more idle processes), "
                        "as ps_bench's trainers do")
    parser.add_argument("--loop", action="store_true", help="time DDP's hook over a training loop instead")
    parser.add_argument("--split", nargs="+", metavar="RESULTS.json", help="split ps_bench runs' comm instead")
    args = parser.parse_args()
    if args.split:
        split(args.split)
        return 0
    import socket
    ports = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            ports.append(probe.getsockname()[1])
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(ports[0], args.repeat, out, ports[1] if args.rpc else None, args.loop),
                 nprocs=4 if args.rpc else 2)
        results = dict(out)
    if args.loop:
        loop_split(results)
        return 0
    mb = sum(p.numel() for p in build_model(MODEL[0], MODEL[1], 0).parameters()) * 4 / 1e6
    print(f"gloo all-reduce of {mb:.2f} MB between 2 processes{' in an RPC world of 4' if args.rpc else ''}, "
          f"{args.repeat} repetitions, p50 ms per process:")
    for key in ("floor", "after backward", "after backward and a barrier", "DDP's hook", "  its division",
                "  its all-reduce and callback", "backward"):
        print(f"  {key:30} " + "  ".join(f"{statistics.median(results[r][key]):8.3f}" for r in (0, 1)))
    skew = [abs(a - b) for a, b in zip(results[0]["ended"], results[1]["ended"])]
    print(f"  {'backward ends apart (p50)':30} {statistics.median(skew):8.3f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
