"""The processes of one job, above ``ps_bench.job``: the store one torchrun attempt at a time
(``rendezvous``), a local job's ranks watched and stopped (``supervision``), the master's RPC
rounds (``master``) and the launcher (``launch``: local ranks, or one rank under torchrun)."""
