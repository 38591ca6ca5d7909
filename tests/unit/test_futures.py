"""Futures and streams on a rank's device (``runtime.futures``), as far as the CPU shows them."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.futures import Future

from ps_bench.runtime import futures


def test_settle_passes_on_a_value_and_a_failure():
    source, target = Future(), Future()
    source.set_result(torch.ones(2))
    futures.settle(target, source)
    assert torch.equal(target.wait(), torch.ones(2))
    failed, told = Future(), Future()
    failed.set_exception(ValueError("server 1 went away"))
    futures.settle(told, failed)
    with pytest.raises(ValueError, match="server 1 went away"):
        told.wait()


def test_a_cpu_device_has_no_stream_to_switch_to():
    assert isinstance(futures.default_stream(torch.device("cpu")), contextlib.nullcontext)
    assert futures.issuing_stream(torch.device("cpu")) is contextlib.nullcontext


def test_a_trainers_calls_run_under_its_devices_stream_its_constructor_under_its_argument(monkeypatch):
    """The constructor has no ``self.device`` yet: its ``device`` argument, however passed, names
    the stream; every later call reads ``self.device``."""
    entered = []

    @contextlib.contextmanager
    def recorded(device: torch.device):
        entered.append(device)
        yield

    monkeypatch.setattr(futures, "default_stream", recorded)

    class Replica:
        @futures.on_default_stream
        def __init__(self, index: int, device: str, seed: int = 0) -> None:
            self.device = torch.device(device)
            self.index = index

        @futures.on_default_stream
        def run_round(self, rounds: int) -> int:
            return rounds * 10 + self.index

    positional = Replica(1, "cuda:3")
    by_keyword = Replica(2, device="cuda:1", seed=5)
    assert entered == [torch.device("cuda:3"), torch.device("cuda:1")]
    assert positional.run_round(2) == 21 and by_keyword.run_round(rounds=4) == 42
    assert entered[2:] == [torch.device("cuda:3"), torch.device("cuda:1")]
