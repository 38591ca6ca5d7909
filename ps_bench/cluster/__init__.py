"""Past one machine: each module writes or starts the commands of one engine (``slurm``; SSH
``hosts``; ``cloud`` for SkyPilot), all built from the one torchrun line in ``torchrun``.
torchrun does the distributed work (rendezvous, supervision, restarts); these modules never
supervise ranks themselves."""
