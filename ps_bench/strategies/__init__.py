"""Gradient-synchronisation strategies, one module per family, registered in ``HOOKS`` by the
names users type (``--hook``). Importing the package registers every family."""

from ps_bench.strategies import (  # noqa: F401 (each registers)
    allreduce, compressors, deepspeed_zero, local, servers, sharded, stale, torchft_local)
from ps_bench.strategies.record import (COLLECTIVE, COLLECTIVE_BUCKETS, HOOKS, HOST_SERVER_BUCKETS,
                                        LOW_RANK_BUCKETS, RPC, SERVER_BUCKETS, SPARSE_ALLREDUCE,
                                        SERVER_COUNTS, SPARSE_GLOO, SPARSE_SERVER_BUCKETS,
                                        SPARSE_SERVERS, Cost, Strategy, sends_to_servers)
from ps_bench.strategies.hook_options import check_hook_options, hook_options, option_types

__all__ = ["COLLECTIVE", "COLLECTIVE_BUCKETS", "HOOKS", "HOST_SERVER_BUCKETS", "LOW_RANK_BUCKETS",
           "RPC", "SERVER_BUCKETS", "SERVER_COUNTS", "SPARSE_ALLREDUCE", "SPARSE_GLOO",
           "SPARSE_SERVER_BUCKETS", "SPARSE_SERVERS", "Cost", "Strategy", "check_hook_options",
           "hook_options", "option_types", "sends_to_servers"]
