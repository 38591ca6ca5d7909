"""Past one machine: each module writes or starts the commands of one engine (``slurm``; SSH
``hosts``; ``cloud`` for SkyPilot), all built from the one torchrun line in ``torchrun``, and
``emulate``, a cluster's network on this machine (its ranks placed by ``ps_bench.runtime.network``).
torchrun does the distributed work (rendezvous, supervision, restarts); these modules never
supervise ranks themselves."""
