"""Parameter servers: every aggregation algorithm lives in this package."""

from ps_bench.registry import Registry

SERVERS: Registry = Registry("server")

from ps_bench.servers import average  # noqa: E402,F401  (registers the servers)
from ps_bench.servers.base import ParameterServer  # noqa: E402,F401
