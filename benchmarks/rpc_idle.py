"""What an idle TensorPipe RPC world costs the machine, per transport: four processes join RPC
(as a master, two trainers and a server do in ps_bench), send nothing for ``--seconds``, and
report the CPU time each spent meanwhile (``time.process_time``: every thread of the process).

TensorPipe's shared-memory transport (``shm``, its choice between processes of one machine)
polls its rings; the TCP transport (``uv``) sleeps in epoll. On a machine of few cores the
polling is the trainers' loss. ``python benchmarks/rpc_idle.py [--seconds 5]``; about 20 s.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
import warnings

import torch
import torch.multiprocessing as mp
from torch.distributed import rpc

TRANSPORTS = {"auto (TensorPipe's choice: shm, cma)": {},
              "tcp (uv, basic: ps_bench's --rpc-transport tcp)": {"_transports": ["uv"], "_channels": ["basic"]}}


def worker(rank: int, port: int, seconds: float, options: dict, out: dict) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch's own, from init_rpc
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=4, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
        init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60, **options))
    start = time.process_time()
    time.sleep(seconds)
    out[rank] = time.process_time() - start
    rpc.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="idle time measured (default 5)")
    args = parser.parse_args()
    print(f"CPU seconds per second of an idle RPC world of 4 processes ({os.cpu_count()} cores):")
    for name, options in TRANSPORTS.items():
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(worker, args=(port, args.seconds, options, out), nprocs=4)
            per_process = [out[rank] / args.seconds for rank in range(4)]
        print(f"  {name:48} " + "  ".join(f"{value:.2f}" for value in per_process)
              + f"   in all {sum(per_process):.2f} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
