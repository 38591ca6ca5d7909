"""torchft's low-communication training (``--hook torchft_local_sgd``, ``--hook torchft_diloco``):
its LocalSGD and its DiLoCo, streaming DiLoCo with ``fragments`` (Douillard et al., "Streaming
DiLoCo with overlapping communication", 2025), run by torchft's own Manager over its own gloo
process group, so that torchft can be held against ps_bench's ``local_sgd`` and ``diloco``.

Every trainer is a replica group of one. The lighthouse that forms torchft's quorums runs in the
master (``beside``), bound to its interface (loopback for a job on one machine); each trainer's
store for torchft's process group is bound to the trainer's. torchft's manager server and its
HTTP checkpoint transport listen on every interface (they take no address to bind). The trainers
start from the same seeded parameters. In a job whose trainers may fail (``--inject-fault``,
``--mtbf``), a failed group is left out of the next quorum while the others go on committing
steps; the launcher starts it again, and at its first synchronisation it heals from a live peer
through torchft's own ``HTTPTransport``: the model, the inner optimizer and each fragment's
global parameters and outer optimizer, at the quorum's step. Bytes are counted at the Manager's
all-reduce (torchft's process group does not go through ``torch.distributed``'s functions), each
charged as a ring all-reduce among the replicas; ``comm`` is the time its all-reduces were open.
Everything torchft started is stopped when training is over; a trainer killed in a job without
failures (SIGKILL from outside) ends the job, named.
"""

from __future__ import annotations

import gc
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ps_bench.config import ConfigError, RunConfig
from ps_bench.metrics.costs import allreduce_bytes
from ps_bench.metrics.timers import tensor_bytes
from ps_bench.runtime.addresses import own_address
from ps_bench.runtime.membership import MEMBERSHIP
from ps_bench.strategies.base import (HookContext, OptimizerSpec, Synchroniser, fingerprint,
                                      flat_parameters)
from ps_bench.strategies.record import (AT_SYNCHRONISATION, COLLECTIVE, ENGINE, HEAL, HOOKS,
                                        LOCAL, Strategy)
from ps_bench.strategies.local import check_outer, check_period

HEARTBEAT_TIMEOUT_MS = 1000  # a group silent this long is left out of the next quorum
COMMITS_KEPT = 4096  # the steps a trainer remembers committing (time, step, fragment's digest)


def record() -> Strategy:
    return Strategy(COLLECTIVE, "float32", lossless=False, sparse_buckets=None,
                    uncompressed="allreduce", family=LOCAL, wrap=ENGINE,
                    identical=AT_SYNCHRONISATION, sends=(("all_reduce", "period"),),
                    engine="torchft", recovery=HEAL)


def bound_store(address: str, timeout: timedelta) -> dist.TCPStore:
    """A store of this trainer's own listening on ``address`` only (torch's would listen on every
    interface; handed a bound socket, it listens there)."""
    listener = socket.socket(socket.AF_INET)
    listener.bind((address, 0))
    listener.listen(socket.SOMAXCONN)
    store = dist.TCPStore(address, listener.getsockname()[1], is_master=True,
                          wait_for_workers=False, timeout=timeout,
                          master_listen_fd=listener.fileno())
    listener.detach()
    return store


class TorchftLocal(Synchroniser):
    """What both torchft strategies share: the lighthouse, the Manager, its process group and
    store, the counted all-reduce, and the parameters at each fragment's last synchronisation."""

    def __init__(self, ctx: HookContext, period: int, fragments: int = 1) -> None:
        # read once, when torchft is first imported: its servers log every quorum and commit at info
        os.environ.setdefault("RUST_LOG", "warn")
        self.period, self.fragments = period, fragments
        self.manager: Any = None
        self.trainers = (ctx.beside or {}).get("trainers", 1)
        self.parts: list[list[nn.Parameter]] = []
        self.synced: list[torch.Tensor | None] = []
        self.syncs = 0
        self.context: Any = None
        self.held: list[Any] = []  # the store, process group and transport, kept until close
        self.heals, self.failed_syncs = False, 0
        # a job whose trainers may fail: (time, step, fragment, its digest) of each commit
        self.commits: list[dict] = []
        self.on_commit: Any = None  # a group started again: told of each commit

    @classmethod
    def configure(cls, cfg: RunConfig, gpus: int) -> tuple[None, list[str]]:
        unsupported = ["--verify"] if cfg.verify else []
        unsupported += [f"--backend {cfg.backend}"] if cfg.backend != "gloo" else []
        if unsupported:
            raise ConfigError(f"--hook {cfg.hook} cannot be combined with {', '.join(unsupported)} "
                              f"(torchft's replicas all-reduce on its own gloo process group)")
        return None, []

    @classmethod
    def beside(cls, cfg: RunConfig, heals: bool) -> tuple[dict, Any]:
        """In the master, before the trainers are built: torchft's lighthouse, which forms the
        quorums, bound to the master's interface. ``heals``: the job's trainers may fail, so that
        a quorum forms without a failed group (any one group; torchft's own majority rule
        still holds). Returns what every trainer is told, and what to shut down at the end."""
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft._torchft import LighthouseServer

        address = own_address()
        # Without failures every quorum waits for every group. Where groups may fail, a quorum
        # waits for every group still sending heartbeats, as torchft's own defaults do (a group
        # late by a scheduling hiccup must not split it), and a group that stops sending them is
        # left out after HEARTBEAT_TIMEOUT_MS; a group started again joins once it asks
        lighthouse = LighthouseServer(
            bind=f"{address}:0", min_replicas=1 if heals else cfg.num_trainers,
            join_timeout_ms=int(cfg.rpc_timeout * 1000) if heals else 100, quorum_tick_ms=10,
            heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS)
        port = lighthouse.address().rsplit(":", 1)[1]
        return ({"lighthouse": f"http://{address}:{port}", "trainers": cfg.num_trainers,
                 "heals": heals}, lighthouse)

    def start(self, ctx: HookContext) -> Any:
        """The Manager of this trainer's replica group, once every trainer's has joined the
        quorum (a group started again joins at its first synchronisation, and heals there)."""
        from torchft.checkpointing.http_transport import HTTPTransport
        from torchft.checkpointing.transport import CheckpointTransport
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        class NoHealing(CheckpointTransport):
            """Replicas start identical and never fail: nothing to serve, no server to open."""

            def metadata(self) -> str:
                return "ps_bench: no checkpoints"

            def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
                raise RuntimeError(f"a torchft replica fell behind at step {step} in a job "
                                   f"without failures")

            def recv_checkpoint(self, src_rank, metadata, step, timeout):
                raise RuntimeError(f"this torchft replica fell behind at step {step} in a job "
                                   f"without failures")

        timeout = timedelta(seconds=ctx.rpc_timeout)
        beside, address = ctx.beside or {}, own_address()
        heals = bool(beside.get("heals"))
        store = bound_store(address, timeout)
        group = ProcessGroupGloo(timeout=timeout)
        transport = HTTPTransport(timeout, num_chunks=0) if heals else NoHealing()
        if heals:  # its server's handler would log every request it serves on stderr
            transport._server.RequestHandlerClass.log_message = lambda *args: None
        self.held = [store, group] + ([transport] if heals else [])
        manager = Manager(pg=group, load_state_dict=None, state_dict=None,
                          min_replica_size=1 if heals else beside["trainers"],
                          use_async_quorum=False, init_sync=False,
                          max_retries=None if heals else 0, rank=0, world_size=1,
                          store_addr=address, store_port=store.port,
                          lighthouse_addr=beside["lighthouse"],
                          replica_id=f"trainer_{ctx.trainer:05d}", hostname=address,
                          timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
                          checkpoint_transport=transport)
        if not ctx.rejoined:
            if heals:  # every group's manager is up: the first quorum waits for none of them
                dist.barrier()
            manager.start_quorum()  # the first quorum's rendezvous, outside the clock
            manager.wait_quorum()
        plain, plain_commit = manager.allreduce, manager.should_commit

        def counted(tensor: torch.Tensor, *args, **kwargs):
            ctx.wire.add_ring(allreduce_bytes(tensor_bytes(tensor), manager.num_participants()),
                              None)
            started, iteration = time.perf_counter(), ctx.iteration
            work = plain(tensor, *args, **kwargs)
            # its futures chain
            work.get_future().then(
                lambda _: ctx.comm.add((iteration, started, time.perf_counter())))
            return work

        def commit(*args, **kwargs) -> bool:
            committed = plain_commit(*args, **kwargs)
            self.failed_syncs += not committed
            return committed

        manager.allreduce, manager.should_commit = counted, commit
        self.manager, self.heals = manager, heals
        return manager

    def heal_with(self, network: nn.Module, inner: torch.optim.Optimizer) -> None:
        """What a group started again loads from a live peer besides what torchft's own
        wrappers register: the model and the inner optimizer."""
        if self.heals:
            def load(state: dict) -> None:
                network.load_state_dict(state["model"])
                inner.load_state_dict(state["optimizer"])

            self.manager.register_state_dict_fn(
                "ps_bench", load, lambda: {"model": network.state_dict(),
                                           "optimizer": inner.state_dict()})

    def fragment_modules(self, network: nn.Module) -> list[nn.Module]:
        """The model's parameters in ``fragments`` contiguous parts balanced by bytes, each a
        module of its own that holds them (no copy)."""
        parameters = list(network.parameters())
        total, made, parts = (sum(p.numel() for p in parameters), 0,
                              [[] for _ in range(self.fragments)])
        for parameter in parameters:
            parts[min(self.fragments - 1, made * self.fragments // max(1, total))].append(parameter)
            made += parameter.numel()
        self.parts = [part for part in parts if part]
        self.synced = [None] * len(self.parts)
        modules = []
        for part in self.parts:
            holder = nn.Module()
            for number, parameter in enumerate(part):
                holder.register_parameter(f"p{number}", parameter)
            modules.append(holder)
        return modules

    def after_step(self, ctx: HookContext, model: nn.Module) -> bool:
        """Whether torchft synchronised a fragment in this step (its Manager's step moved on)."""
        step = self.manager.current_step()
        if step == self.syncs:
            return False
        self.syncs = step
        return True

    def note_synchronised(self, model: nn.Module) -> None:
        """The fragment just synchronised: its parameters, as every replica now holds them (in a
        job whose trainers may fail, their digest kept with the step's)."""
        which = (self.syncs - 1) % len(self.parts)
        self.synced[which] = flat_parameters(self.parts[which]).cpu()
        if self.heals:
            entry = {"at": time.time(), "step": self.syncs, "fragment": which,
                     "failed_before": self.failed_syncs, **fingerprint(self.synced[which])}
            self.commits = self.commits[-COMMITS_KEPT + 1:] + [entry]
            if self.on_commit is not None:
                self.on_commit(entry)

    def commit_log(self) -> list[dict]:
        return self.commits

    def parameters_vector(self, model: nn.Module) -> torch.Tensor:
        """Each fragment at its own last synchronisation (the replicas' common state)."""
        if any(part is None for part in self.synced):
            return super().parameters_vector(model)
        return torch.cat(self.synced)

    def close(self) -> None:
        """Every living trainer at once (a group started again is stopped by the launcher)."""
        if self.context is not None:
            self.context.__exit__(None, None, None)
        group = MEMBERSHIP.group(self.trainers)  # None while every trainer lives
        dist.barrier(group=group)
        if self.manager is not None:
            self.manager.shutdown(wait=True)
        for held in reversed(self.held):
            if hasattr(held, "shutdown"):
                held.shutdown()
        dist.barrier(group=group)
        self.manager = self.context = None
        self.held = []
        gc.collect()


@HOOKS.register("torchft_local_sgd", aliases=("torchft_localsgd",), record=record())
class TorchftLocalSGD(TorchftLocal):
    """torchft's LocalSGD: local steps, the parameters averaged every ``period`` iterations by
    torchft's Manager."""

    def __init__(self, ctx: HookContext, period: int = 4) -> None:
        super().__init__(ctx, period)

    @staticmethod
    def check(period: int) -> None:
        check_period(period)

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torchft.local_sgd import LocalSGD

        inner = optimizer.build(network.parameters())
        self.fragment_modules(network)
        self.context = LocalSGD(self.start(ctx), network, inner, sync_every=self.period).__enter__()
        self.heal_with(network, inner)
        return network, inner


@HOOKS.register("torchft_diloco", aliases=("torchft_DiLoCo", "torchft_streaming_diloco"),
                record=record())
class TorchftDiLoCo(TorchftLocal):
    """torchft's DiLoCo: ``period`` inner steps of the run's optimizer, then each fragment's mean
    parameter change is the outer gradient of an SGD step with Nesterov momentum; with
    ``fragments`` F, streaming DiLoCo: one fragment synchronised every period/F steps, its
    all-reduce sent ``fragment_sync_delay`` steps before it is needed."""

    def __init__(self, ctx: HookContext, period: int = 16, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, fragments: int = 1,
                 fragment_sync_delay: int = 0) -> None:
        super().__init__(ctx, period, fragments)
        self.outer_lr, self.outer_momentum, self.delay = (outer_lr, outer_momentum,
                                                          fragment_sync_delay)

    @staticmethod
    def check(period: int, outer_lr: float, outer_momentum: float, fragments: int,
              fragment_sync_delay: int) -> None:
        check_outer(period, outer_lr, outer_momentum)
        if fragments < 1 or period % fragments:
            raise ValueError(f"hook option 'fragments' must divide the period ({period}); "
                             f"got {fragments}")
        if not 0 <= fragment_sync_delay < period // fragments:
            raise ValueError(f"hook option 'fragment_sync_delay' must be in [0, period/fragments = "
                             f"{period // fragments}); got {fragment_sync_delay}")

    def wrap(self, network: nn.Module, ctx: HookContext, ddp_options: dict[str, Any],
             optimizer: OptimizerSpec) -> tuple[nn.Module, torch.optim.Optimizer]:
        from torchft.local_sgd import DiLoCo

        inner = optimizer.build(network.parameters())
        fragments = self.fragment_modules(network)
        outers = [torch.optim.SGD(fragment.parameters(), lr=self.outer_lr,
                                  momentum=self.outer_momentum, nesterov=self.outer_momentum > 0)
                  for fragment in fragments]
        self.context = DiLoCo(self.start(ctx), fragments, inner, outers, sync_every=self.period,
                              backup_device=torch.device("cpu"), pin_memory=False,
                              fragment_sync_delay=self.delay).__enter__()
        self.heal_with(network, inner)
        return network, inner
