"""Averaging parameter servers."""

from __future__ import annotations

import functools

import torch

from ps_bench.servers.base import SERVERS, BucketState, ParameterServer


@SERVERS.register("average", aliases=("AverageParameterServer",))
class AverageParameterServer(ParameterServer):
    """Adds each gradient into a running sum as it arrives."""

    def accumulate(self, state: BucketState, tensor: torch.Tensor) -> None:
        # The first contribution is kept as it came (no copy); the second is added to it into
        # the bucket's buffer, the others in place.
        if state.count == 0:
            state.accumulator = tensor
        elif tensor.is_sparse:
            state.accumulator = state.accumulator + tensor
        elif state.count == 1:
            state.accumulator = torch.add(state.accumulator, tensor, out=state.buffer_like(tensor))
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
        if len(tensors) == 1:
            return tensors[0]
        total = torch.add(tensors[0], tensors[1], out=state.buffer_like(tensors[0]))
        for tensor in tensors[2:]:
            total.add_(tensor)
        return total
