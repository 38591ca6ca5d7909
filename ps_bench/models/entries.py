"""Model and data entries: one entry of an upstream-format configuration file
(``{"Id": {"model_class" | "data_class": ..., "configurations": {...}}}``) or of the zoo,
found, checked and sized before any process starts."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ps_bench.config import ConfigError, read_json
from ps_bench.places import resolve_path
from ps_bench.registry import Registry, did_you_mean


@dataclass(frozen=True)
class Entry:
    """One entry of an upstream-format data or model configuration file, or of the zoo."""

    id: str
    class_name: str
    kwargs: dict[str, Any]
    source: str  # the file it came from, or ZOO
    size: dict[str, int] | None = None  # models: parameters and gradient bytes (see model_size)
    options: dict[str, Any] | None = None  # the --model-option values over the entry's own

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "class": self.class_name, "configurations": self.kwargs,
                "source": self.source}


ZOO = "the model zoo"
DEFAULT_DATA = "DummyDataSmall"


def load_entry(path: str, entry_id: str, class_key: str, registry: Registry, option_name: str,
               zoo: dict[str, dict]) -> Entry:
    """Finds ``entry_id`` in the file ``{"Id": {"<class_key>": ..., "configurations": {...}}}``,
    else among the zoo's entries of the same format, and checks its keys."""
    file_option = f"--{option_name}-config-path"
    table = read_json(resolve_path(path), f"{file_option}")
    if not isinstance(table, dict):
        raise ConfigError(f"{file_option} {path!r} must hold a JSON object of entries")
    if entry_id in table:
        entry, source = table[entry_id], str(path)
    elif entry_id in zoo:
        entry, source = zoo[entry_id], ZOO
    else:
        hint = did_you_mean(entry_id, [*table, *zoo])
        raise ConfigError(f"--{option_name} {entry_id!r} is not in {path} or {ZOO}; {hint}entries: "
                          f"{', '.join(sorted(table))}; zoo: {', '.join(zoo)}")
    if not isinstance(entry, dict) or class_key not in entry:
        raise ConfigError(f"{source}: entry {entry_id!r} needs a {class_key!r} key")
    kwargs = entry.get("configurations", {})
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{source}: entry {entry_id!r}: 'configurations' must be an object")
    try:
        factory = registry.get(entry[class_key])
    except KeyError as error:
        raise ConfigError(f"{source}: entry {entry_id!r}: {error}") from None
    check_keys(factory, kwargs, f"{source}: entry {entry_id!r}: unknown configuration")
    return Entry(entry_id, registry.canonical(entry[class_key]), dict(kwargs), source)


def check_keys(factory: Any, kwargs: dict[str, Any], what: str) -> None:
    """A ConfigError (``what`` KEY; the valid keys) unless ``factory`` takes every key of
    ``kwargs``."""
    accepted = [name for name in inspect.signature(factory).parameters if name != "self"]
    for key in kwargs:
        if key not in accepted:
            raise ConfigError(f"{what} {key!r}; valid: {', '.join(accepted)}")


def with_options(entry: Entry, options: dict[str, Any], registry: Registry) -> Entry:
    """``entry`` with ``--model-option``s over its configurations."""
    if not options:
        return entry
    check_keys(registry.get(entry.class_name), options,
               f"--model-option: --model {entry.id} has no configuration")
    return dataclasses.replace(entry, kwargs={**entry.kwargs, **options}, options=dict(options))


class SkipMetaInit(TorchFunctionMode):
    """Initialising a meta tensor computes nothing, yet torch runs some initialisers on the meta
    device through Python reference code whose first call imports torch._dynamo (1 to 3 s on
    the development machine, in the launcher, before any rank starts): skipped."""

    RANDOM = {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_,
              torch.Tensor.exponential_, torch.Tensor.bernoulli_, torch.Tensor.log_normal_,
              torch.Tensor.cauchy_, torch.Tensor.geometric_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.RANDOM or getattr(func, "__module__", None) == "torch.nn.init":
            tensor = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def construct(entry: Entry, registry: Registry) -> Any:
    """Builds an entry's model (on the meta device: no weights are allocated or initialised) or
    data description, so that any error in its configuration is one line naming the entry."""
    try:
        with torch.device("meta"), SkipMetaInit():
            return registry.get(entry.class_name)(**entry.kwargs)
    except Exception as error:  # noqa: BLE001 - a constructor may raise anything on bad sizes
        text = str(error).strip()
        reason = text.splitlines()[0] if text else type(error).__name__
        if entry.options:  # what the user gave, rather than the file's entry it changed
            given = ",".join(f"{key}={value}" for key, value in entry.options.items())
            raise ConfigError(f"--model-option {given}: --model {entry.id}: {reason}") from None
        raise ConfigError(f"{entry.source}: entry {entry.id!r}: {reason}") from None


def model_size(network: Any) -> dict[str, int]:
    """Parameters (shared ones once) and the bytes of their gradients: dense, and sparse
    (embeddings with sparse gradients, counted at their dense size; what they really send
    depends on the rows a batch touches)."""
    sparse = {id(module.weight) for module in network.modules() if getattr(module, "sparse", False)}
    parameters = list(network.parameters())
    nbytes = {id(p): p.numel() * p.element_size() for p in parameters}
    return {
        "parameters": sum(p.numel() for p in parameters),
        "dense_gradient_bytes": sum(n for key, n in nbytes.items() if key not in sparse),
        "sparse_gradient_bytes": sum(n for key, n in nbytes.items() if key in sparse),
    }
