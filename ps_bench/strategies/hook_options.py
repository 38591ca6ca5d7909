"""A strategy's options (``--hook-option KEY=VALUE``): the keyword arguments of its factory, their
types and defaults, checked like every other option (and by the factory's own ``check``)."""

from __future__ import annotations

import inspect
import types
import typing
from typing import Any

from ps_bench.runfiles import as_type
from ps_bench.strategies.record import HOOKS


def option_types(name: str) -> dict[str, tuple[type, Any]]:
    """The options a hook takes: name -> (type, default)."""
    factory = HOOKS.get(name)
    target = factory.__init__ if inspect.isclass(factory) else factory
    hints = typing.get_type_hints(target)
    out = {}
    for parameter in list(inspect.signature(factory).parameters.values())[1:]:  # after ctx
        kind = hints[parameter.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None: None is the
            kind, = [arg for arg in typing.get_args(kind) if arg is not type(None)]  # default
        out[parameter.name] = (kind, parameter.default)
    return out


def hook_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options a hook runs with: its defaults, then ``options``."""
    return {**{key: default for key, (_, default) in option_types(name).items()}, **options}


def check_hook_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """Validates options for a hook; raises ValueError with a sentence for people."""
    known = option_types(name)
    checked = {}
    for key, value in options.items():
        if key not in known:
            valid = ", ".join(known) if known else "none (this hook takes no options)"
            raise ValueError(f"hook {name!r} has no option {key!r}; its options: {valid}")
        kind = known[key][0]
        try:
            checked[key] = as_type(value, kind)
        except TypeError as error:
            raise ValueError(f"hook option {key!r} {error}; got {value!r}") from None
    factory = HOOKS.get(name)
    if hasattr(factory, "check"):
        factory.check(**{k: d for k, (_, d) in known.items()} | checked)
    return checked
