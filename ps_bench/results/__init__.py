"""Results: the books of one run (``record``: rounds in, the ``ps_bench.result/1`` object out), its
file and a sweep's lines written (``files``), read back through one checked loader (``load``), and
its printed report (``printed``). docs/results.md is the contract."""
