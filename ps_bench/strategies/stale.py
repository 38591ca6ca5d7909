"""Stale-synchronous parameter servers (``--hook ps --staleness S``): the servers own the
parameters and step them with SGD as gradients arrive; each trainer pushes its gradients and
reads the parameters back, and may run at most S iterations (clocks) ahead of the slowest
trainer (Ho et al., "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
Server", NIPS 2013). S = 0 is bulk-synchronous (it trains as ``ps`` does), ``inf`` fully
asynchronous (Hogwild-style updates, as in Dean et al.'s Downpour SGD, NIPS 2012).

The strategy is the ``ps`` hook in another mode, not a hook of its own: its record
(``STALE_SYNCHRONOUS``) is what a validated job carries in place of ``ps``'s, and its processes
are the ``ssp`` server (``ps_bench.servers.ssp``) and trainer (``ps_bench.trainers.ssp``), which
have no DDP and no buckets. This module holds what says so: the record, the option ``S`` and
what the mode cannot be combined with.
"""

from __future__ import annotations

import math

from ps_bench.config import ConfigError, RunConfig, flag, need
from ps_bench.strategies.record import (RPC, SERVERS, SERVERS_KEEP, SERVERS_MODEL, SERVER_OWNED,
                                        Strategy)

STALE_SYNCHRONOUS = Strategy(transport=RPC, payload="float32", lossless=False, uncompressed="ps",
                             sparse_buckets=None, family=SERVERS, wrap=SERVER_OWNED,
                             identical=SERVERS_MODEL, recovery=SERVERS_KEEP)
MODE = "ssp"  # the trainer and server the mode runs


def parse_staleness(text: str) -> float:
    """``S`` as given (an integer of 0 or more, or ``inf``); raises ValueError with a sentence."""
    if str(text).strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        value = int(str(text))
    except ValueError:
        raise ValueError(f"--staleness must be an integer of 0 or more, or inf; "
                         f"got {text!r}") from None
    if value < 0:
        raise ValueError(f"--staleness must be an integer of 0 or more, or inf; got {value}")
    return float(value)


def resolve(cfg: RunConfig, record: Strategy) -> Strategy:
    """The strategy a run with ``--hook`` of ``record`` trains with: ``STALE_SYNCHRONOUS`` under
    ``--staleness`` (checked here: it needs ``ps``, and it chooses its own trainer and server),
    else ``record``. Canonicalises ``cfg.staleness`` to an integer or ``inf``."""
    if cfg.staleness is None:
        for name in ("trainer", "server"):
            need(getattr(cfg, name) != MODE,
                 f"--{name} {MODE} is the mode of --staleness S: set --staleness")
        return record
    try:
        bound = parse_staleness(cfg.staleness)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    cfg.staleness = "inf" if bound == math.inf else str(int(bound))
    need(cfg.hook == "ps", f"--staleness {cfg.staleness} trains with servers that own the "
                           f"parameters, which trainers push gradients to and read from: it needs "
                           f"--hook ps (got --hook {cfg.hook})")
    need(cfg.trainer in ("ddp", MODE) and cfg.server in ("average", MODE),
         f"--staleness chooses its own trainer and server ({MODE}): leave --trainer and --server "
         f"out (got {cfg.trainer} and {cfg.server})")
    cfg.trainer = cfg.server = MODE
    need(cfg.optimizer == "sgd" and not cfg.momentum,
         "--staleness: the servers step the parameters with plain SGD; "
         "leave --optimizer and --momentum out")
    unsupported = [flag(name) for name in ("ncudatrainer", "ncudaserver", "verify", "limits")
                   if getattr(cfg, name)]
    unsupported += ["--profile"] if cfg.profile is not None else []
    unsupported += [f"--backend {cfg.backend}"] if cfg.backend != "gloo" else []
    unsupported += ["--mapping group"] if cfg.mapping == "group" else []
    need(not unsupported, f"--staleness runs CPU trainers and servers without DDP's buckets: it "
                          f"cannot be combined with {', '.join(unsupported)}")
    return STALE_SYNCHRONOUS
