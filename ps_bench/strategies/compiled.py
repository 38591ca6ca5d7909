"""``--compile``: the model's units compiled with ``torch.compile`` before the strategy wraps the
model, one by one, as torchtitan compiles a language model's transformer blocks before FSDP2
shards them (``apply_compile``, then ``apply_fsdp``).

The units are those FSDP2 shards (``sharded.shard_units``: a Hugging Face model's transformer
blocks, else every module that holds parameters of its own), compiled after
``--activation-checkpointing`` has wrapped them. A recomputed unit is compiled inside its
checkpoint wrapper, where torchtitan compiles the wrapper: the wrapper's hook that counts the
input it keeps (``recompute.inputs_kept``) is no graph's, and recomputing runs the compiled
unit again. One unit at a time keeps what the strategies overlap:
each unit's backward ends with its own gradients ready, so DDP's buckets, the hooks' pieces and
FSDP2's reduce-scatters go on as each unit's backward finishes, where one graph of the whole
model would give every gradient at its end.

``torch.compile`` compiles on a unit's first call: in the first warmup iterations (a unit met
again at another shape compiles again). ``seconds`` reads torch's own count of the time its
compiler took in this process, forward and backward graphs, which the results give apart from
the timed rounds (``compile`` there)."""

from __future__ import annotations

import threading

import torch
from torch import nn

from ps_bench.strategies.recompute import CheckpointWrapper
from ps_bench.strategies.sharded import shard_units

BACKEND = "inductor"  # torch.compile's default: Triton kernels on a GPU, C++ on the CPU


def apply(network: nn.Module) -> int:
    """Compiles ``network``'s units in place (each ``nn.Module.compile``, torch's default
    backend); returns how many. A unit that ``--activation-checkpointing`` wrapped is compiled
    inside its wrapper (``shard_units`` names the module inside, which alone owns parameters,
    or, for a model that names its units, the wrapper)."""
    units = [unit._checkpoint_wrapped_module if isinstance(unit, CheckpointWrapper) else unit
             for unit in shard_units(network)]
    # imported where a run compiles: inductor's configuration brings the compiler in
    import torch._inductor.config as inductor

    # the kernels compiled in this process, not in a pool of workers inductor would start (and
    # leave behind) in each rank: a rank is one of several sharing the machine's cores already
    inductor.compile_threads = 1
    try:  # inductor's progress bar, tqdm: a lock of this process's, not a semaphore the
        # launcher's resource tracker would count as leaked when the rank ends
        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())
    except ImportError:
        pass
    for unit in units:
        unit.compile(backend=BACKEND)
    return len(units)


class Books:
    """This process's compile time, read at the end of each round: the round's share and the
    whole so far (the warmup's is the whole less the first timed round's share)."""

    def __init__(self) -> None:
        self.read_s = 0.0

    def round(self, units: int) -> dict:
        total = seconds() if units else 0.0  # nothing compiled: torch's compiler left unloaded
        spent, self.read_s = total - self.read_s, total
        return {"units": units, "round_s": spent, "total_s": total}


BOOKS = Books()


def seconds() -> float:
    """The seconds torch's compiler has taken in this process so far: dynamo's frames and the
    backward graphs it compiled (``torch._dynamo.utils.calculate_time_spent``)."""
    spent = torch._dynamo.utils.calculate_time_spent()
    return float(spent.get("entire_frame_compile", 0.0) + spent.get("entire_backward_compile", 0.0))


def note(seen: dict[int, dict], rank: int, books: dict) -> None:
    """A timed round's books from trainer ``rank`` into ``seen`` (the results' record): the
    warmup's seconds are all before the first timed round's share."""
    kept = seen.setdefault(rank, {"units": books["units"],
                                  "warmup_s": books["total_s"] - books["round_s"],
                                  "timed_rounds_s": 0.0})
    kept["timed_rounds_s"] += books["round_s"]


def summary(seen: dict[int, dict]) -> dict:
    """The results' ``compile``: the units each trainer compiled and the seconds torch's
    compiler took, in the warmup and within the timed rounds (a unit met at a new shape compiles
    again), the slowest trainer's of each."""
    per_trainer = [{"rank": rank, **kept} for rank, kept in sorted(seen.items())]
    return {"backend": BACKEND, "units": max((kept["units"] for kept in per_trainer), default=0),
            "warmup_s": max((kept["warmup_s"] for kept in per_trainer), default=0.0),
            "timed_rounds_s": max((kept["timed_rounds_s"] for kept in per_trainer),
                                  default=0.0),
            "per_trainer": per_trainer}
