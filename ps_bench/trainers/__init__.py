"""Trainers: the DDP training loop and the communication hooks it can use."""
