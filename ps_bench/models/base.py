"""What every benchmark model and synthetic data set share: registries, the dataset type, and
the checks that a configuration entry is sound and that a model fits its data.

A data class is a cheap description of its data: constructing it checks the configuration,
``build(seed, labels)`` makes the tensors. Labels are ``random`` (uniform, nothing to learn:
the default for speed benchmarks) or, for a data class with a ``teacher``, ``teacher``: a
fixed, seeded function of the inputs that the family's models can learn, so training loss
falls and time to a target loss means something; ``held_out(seed, count)`` draws samples the
training set does not hold, labelled by the same teacher. A model class says which kind of input it
``takes`` and each data class which kind it ``gives``; ``fits`` compares sizes once both are known,
so a mismatch is one line before any process starts rather than an error at the first forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ps_bench.registry import Registry

MODELS: Registry = Registry("model class")
DATA: Registry = Registry("data class")
RANDOM, TEACHER = "random", "teacher"  # the labels a data class can give
LABELS = (RANDOM, TEACHER)
# random streams beside a seed's own: the teacher's, held-out inputs'
TEACHER_STREAM, HELD_OUT_STREAM = 1, 2


def stream(seed: int, which: int) -> torch.Generator:
    """A generator for one of a seed's streams (0: the training inputs and random labels)."""
    return torch.Generator().manual_seed(seed + 1_000_003 * which)


@dataclass
class Dataset:
    inputs: tuple[torch.Tensor, ...]  # the model's positional inputs, one row per sample
    targets: torch.Tensor  # class labels for CrossEntropyLoss: (samples,) or (samples, positions)

    def __len__(self) -> int:
        return len(self.targets)

    def shard(self, index: int, count: int) -> "Dataset":
        """Contiguous shard ``index`` of ``count`` equal shards; the remainder is dropped so
        every trainer runs the same number of iterations."""
        size = len(self) // count
        part = slice(index * size, (index + 1) * size)
        return Dataset(tuple(t[part].clone() for t in self.inputs), self.targets[part].clone())


class SyntheticData:
    """Base of every data class: seeded, generated in memory, nothing downloaded."""

    gives = ""  # the kind of input it makes; a model's ``takes`` must match
    # what labels ``teacher`` data, in one line; None: random labels only
    teacher: str | None = None
    sample_count: int

    def build(self, seed: int, labels: str = RANDOM) -> Dataset:
        raise NotImplementedError

    def held_out(self, seed: int, count: int) -> Dataset:
        """``count`` samples drawn apart from ``build``'s, with the teacher's labels."""
        raise NotImplementedError


class BenchmarkModel(nn.Module):
    """Base of every model class: returns logits, trained with cross-entropy."""

    takes = ""

    def fits(self, data: SyntheticData) -> str | None:
        """Why this model cannot train on ``data`` (sizes), or None."""
        return None

    def fitted_data(self, configurations: dict) -> dict:
        """The configurations of the data it trains on when ``--data`` is left out, fitted to
        this model (by default, as they are)."""
        return configurations


def need_positive(**values: int) -> None:
    """Raises ValueError naming the first size that is not a positive integer."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer; got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be at least 1; got {value}")


def build_model(class_name: str, kwargs: dict, seed: int) -> nn.Module:
    """Builds a model with seeded initialisation, so every trainer starts from the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS.get(class_name)(**kwargs)


def build_data(class_name: str, kwargs: dict, seed: int, labels: str = RANDOM) -> Dataset:
    return DATA.get(class_name)(**kwargs).build(seed, labels)


def build_held_out(class_name: str, kwargs: dict, seed: int, count: int) -> Dataset:
    return DATA.get(class_name)(**kwargs).held_out(seed, count)


# Named entries built into ps_bench (the zoo), alongside the entries of the configuration files:
# name -> {"model_class" | "data_class": ..., "configurations": {...}}, the files' own format.
MODEL_PRESETS: dict[str, dict] = {}
DATA_PRESETS: dict[str, dict] = {}
PRESET_DATA: dict[str, str] = {}  # zoo model -> the data entry it trains on by default
# zoo model small enough for the tests -> the full-size model it shrinks
TEST_SIZED: dict[str, str] = {}


def preset(name: str, model_class: str, model_kwargs: dict, data_name: str,
           data_class: str | None = None, data_kwargs: dict | None = None,
           small_of: str | None = None) -> None:
    """Registers a zoo model with the data it trains on (defined here, or by an earlier preset).
    ``small_of`` marks a test-sized version of an earlier preset (the same model class): the
    tests train every such model."""
    if name in MODEL_PRESETS:
        raise ValueError(f"zoo model {name!r} is registered twice")
    if small_of is not None and MODEL_PRESETS.get(small_of, {}).get("model_class") != model_class:
        raise ValueError(f"zoo model {name!r} is a small {small_of!r}, which must come first, "
                         f"of class {model_class}")
    MODEL_PRESETS[name] = {"model_class": model_class, "configurations": model_kwargs}
    if data_class is not None:
        DATA_PRESETS[data_name] = {"data_class": data_class, "configurations": data_kwargs or {}}
    PRESET_DATA[name] = data_name
    if small_of is not None:
        TEST_SIZED[name] = small_of
