"""Averaging parameter servers."""

from __future__ import annotations

import functools

import torch

from ps_bench.servers import SERVERS
from ps_bench.servers.base import BucketState, ParameterServer


@SERVERS.register("average", aliases=("AverageParameterServer",))
class AverageParameterServer(ParameterServer):
    """Adds each gradient into a running sum as it arrives."""

    def accumulate(self, state: BucketState, tensor: torch.Tensor) -> None:
        if state.accumulator is None:
            state.accumulator = tensor.clone()
        elif tensor.is_sparse:
            state.accumulator = state.accumulator + tensor
        else:
            state.accumulator.add_(tensor)

    def total(self, state: BucketState) -> torch.Tensor:
        return state.accumulator


@SERVERS.register("average_batch", aliases=("AverageBatchParameterServer",))
class AverageBatchParameterServer(ParameterServer):
    """Keeps every contribution and sums them in one pass once all have arrived."""

    def accumulate(self, state: BucketState, tensor: torch.Tensor) -> None:
        if state.accumulator is None:
            state.accumulator = []
        state.accumulator.append(tensor)

    def total(self, state: BucketState) -> torch.Tensor:
        tensors = state.accumulator
        if tensors[0].is_sparse:
            return functools.reduce(torch.add, tensors)
        return torch.stack(tensors).sum(dim=0)
