"""Futures and streams on a rank's device, for whoever completes a future from another's
callback: a strategy's hook, a parameter server's answer."""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, TypeVar

import torch
from torch.futures import Future

F = TypeVar("F", bound=Callable)


def device_future(device: torch.device) -> Future:
    """A future whose value lives on ``device``. On a GPU it carries CUDA events: whoever waits
    on it (DDP, before it copies a bucket's answer back) waits for the streams that made the
    value; a plain ``Future()`` carries none, and DDP could read a bucket that a collective or
    an RPC is still writing."""
    return Future(devices=[device] if device.type == "cuda" else None)


def issuing_stream(device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """The stream that work issued now on ``device`` would run on, to issue work under later,
    from a future's callback (a context manager; nothing on the CPU).

    A callback of a GPU future runs on a stream of torch's pool that waits for that future's
    events and for nothing else: a collective or a send started there on a bucket the hook's
    caller made (DDP, on its own stream) could read it before it is written."""
    if device.type != "cuda":
        return contextlib.nullcontext
    stream = torch.cuda.current_stream(device)
    return lambda: torch.cuda.stream(stream)


def settle(target: Future, source: Future) -> None:
    """Completes ``target`` as ``source`` completed: with its value or its exception."""
    try:
        target.set_result(source.value())
    except Exception as error:  # noqa: BLE001 - source's own failure, passed on
        target.set_exception(error)


def default_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """Work issued under it runs on ``device``'s default stream (nothing on the CPU).

    TensorPipe runs each call that carries CUDA tensors on a stream of torch's pool, another at
    each call. A trainer that built DDP under one (DDP holds autograd's gradient accumulators
    from then on) and runs a round under another has its backward feed accumulators of another
    stream: torch synchronises the two and warns. A trainer issues its work on the default
    stream, as a training loop outside RPC does."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream(device))


def on_default_stream(method: F) -> F:
    """``method`` runs under ``default_stream`` of its object's ``device``; a constructor, which
    sets that, under its ``device`` argument's."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        device = getattr(self, "device", None)
        if device is None:
            device = signature.bind(self, *args, **kwargs).arguments["device"]
        with default_stream(torch.device(device)):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]
