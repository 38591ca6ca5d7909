"""Peak resident memory of one trainer of each zoo model: the model wrapped in DDP (one-process
gloo group, so DDP's bucket copies of the gradients count), SGD, and one training step at a
given batch size, each model in a fresh process.

    python benchmarks/model_memory.py --batch-size 2 resnet18 resnet50 gpt2_small dlrm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout, installed or not
STEPS = 1  # the peak comes in the first step: gradients and DDP buckets are allocated then


def measure(model_name: str, batch_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ps_bench.config import RunConfig
    from ps_bench.job import validate
    from ps_bench.models import build_data, build_model

    torch.set_num_threads(1)
    job = validate(RunConfig(model=model_name, batch_size=batch_size, ntrainer=1, nserver=0, hook="allreduce"), gpus=0)
    model, data = job.model, job.data
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    network = DistributedDataParallel(build_model(model.class_name, model.kwargs, 0))
    optimizer = torch.optim.SGD(network.parameters(), lr=0.01)
    dataset = build_data(data.class_name, data.kwargs, 0)
    for step in range(STEPS):
        batch = slice(step * batch_size, (step + 1) * batch_size)
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(network(*(t[batch] for t in dataset.inputs)), dataset.targets[batch])
        loss.backward()
        optimizer.step()
    dist.destroy_process_group()
    os.unlink(store)
    return {"model": model_name, "batch_size": batch_size, "parameters": model.size["parameters"],
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # the measuring child
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.models[0], args.batch_size)))
        return 0
    print(f"{'model':<16}{'parameters':>14}{'batch':>7}{'peak RSS per trainer':>24}")
    for name in args.models:
        child = subprocess.run([sys.executable, __file__, "--one", "--batch-size", str(args.batch_size), name],
                               capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"{name}: {child.stderr.strip().splitlines()[-1]}")
        row = json.loads(child.stdout.splitlines()[-1])
        print(f"{name:<16}{row['parameters']:>14,}{row['batch_size']:>7}{row['peak_rss_gib']:>20.2f} GiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
