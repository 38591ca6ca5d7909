"""What every layer may use about a job's ranks: their roles and places (``topology``), the
address a rank binds to (``addresses``), a failed rank's record (``failures``) and failures on
purpose (``faults``), ranks placed on hosts and emulated hosts (``network``), objects that live
on the rank that made them (``resident``), and the interpreter ranks are forked from
(``preload``, ``forkserver``). Imports nothing: ``bench.py`` loads ``preload`` before torch.
The job's own processes, which use every layer, are ``ps_bench.processes``."""
