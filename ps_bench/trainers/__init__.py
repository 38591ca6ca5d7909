"""Trainers, registered in ``TRAINERS``: the loop that trains a replica the way its strategy's
``Synchroniser`` wraps and steps it (``trainer``; the strategies live in ``ps_bench.strategies``),
the averaged model's loss for ``--target-loss`` (``convergence``), and the trainer of servers that
own the parameters (``ssp``, ``--staleness``)."""

from ps_bench.trainers import ssp, trainer  # noqa: F401  (registers the trainers)
