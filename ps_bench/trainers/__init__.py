"""Trainers: the DDP training loop and the communication hooks it can use, and the trainer of
servers that own the parameters (``--staleness``)."""

from ps_bench.trainers import ssp, trainer  # noqa: F401  (registers the trainers)
