"""Parameter servers: every aggregation algorithm lives in this package, registered in
``SERVERS``."""

from ps_bench.servers import average, ssp  # noqa: F401  (registers the servers)
from ps_bench.servers.base import SERVERS, ParameterServer  # noqa: F401

# The servers that average gradients for the synchronous strategies (not those that own the
# parameters)
AVERAGING = [name for name in SERVERS.names() if issubclass(SERVERS.get(name), ParameterServer)]
