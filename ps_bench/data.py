"""Synthetic, seeded benchmark data, registered by the class names configuration files use."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ps_bench.registry import Registry

DATA: Registry = Registry("data class")


@dataclass
class Dataset:
    inputs: torch.Tensor  # (samples, input_dim) int64 embedding indices
    targets: torch.Tensor  # (samples,) int64 class labels

    def __len__(self) -> int:
        return len(self.targets)

    def shard(self, index: int, count: int) -> "Dataset":
        """Contiguous shard ``index`` of ``count`` equal shards; the remainder is dropped so
        every trainer runs the same number of iterations."""
        size = len(self) // count
        part = slice(index * size, (index + 1) * size)
        return Dataset(self.inputs[part].clone(), self.targets[part].clone())


@DATA.register("DummyData")
def dummy_data(
    max_val: int,
    input_samples: int,
    input_dim: int,
    sparsity_percentage: int,
    num_classes: int = 10,
    seed: int = 0,
) -> Dataset:
    """Random bags of indices drawn from ``(100 - sparsity_percentage)``% of ``[0, max_val)``.

    ``sparsity_percentage`` is the share of embedding rows that no sample touches, so
    sparse embedding gradients stay sparse.
    """
    if not 0 <= sparsity_percentage < 100:
        raise ValueError("sparsity_percentage must be in [0, 100)")
    for name, value in (("max_val", max_val), ("input_samples", input_samples), ("input_dim", input_dim),
                        ("num_classes", num_classes)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1")
    generator = torch.Generator().manual_seed(seed)
    used = max(1, int(max_val * (100 - sparsity_percentage) / 100))
    rows = torch.randperm(max_val, generator=generator)[:used]
    picks = torch.randint(0, used, (input_samples, input_dim), generator=generator)
    targets = torch.randint(0, num_classes, (input_samples,), generator=generator)
    return Dataset(rows[picks], targets)


def build_data(class_name: str, kwargs: dict, seed: int) -> Dataset:
    return DATA.get(class_name)(**kwargs, seed=seed)
