"""How a job's processes start, run and end: the ranks and their roles (``topology``), a failed
rank's record (``failures``) and failures on purpose (``faults``), the interpreter ranks are
forked from (``preload``, ``forkserver``), the store one torchrun attempt at a time
(``rendezvous``), ranks placed on emulated hosts (``network``), supervision, the master's rounds
(``master``) and the launcher (``launch``). Imports nothing: ``bench.py`` loads ``preload``
before torch."""
