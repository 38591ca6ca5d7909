"""Benchmark models, registered by the class names that configuration files use."""

from __future__ import annotations

import torch
from torch import nn

from ps_bench.registry import Registry

MODELS: Registry = Registry("model class")


@MODELS.register("DummyModel")
class DummyModel(nn.Module):
    """EmbeddingBag (optionally with sparse gradients) followed by a stack of linear layers.

    Returns logits: the loss applies its own softmax.
    """

    def __init__(
        self,
        num_embeddings: int = 4,
        embedding_dim: int = 4,
        dense_input_size: int = 4,
        dense_output_size: int = 4,
        dense_layers_count: int = 8,
        sparse: bool = False,
    ) -> None:
        super().__init__()
        if dense_input_size != embedding_dim:
            raise ValueError(
                f"dense_input_size ({dense_input_size}) must equal embedding_dim ({embedding_dim})"
            )
        if dense_layers_count < 1:
            raise ValueError("dense_layers_count must be at least 1")
        if dense_layers_count > 1 and dense_output_size != dense_input_size:
            raise ValueError("stacked dense layers need dense_output_size == dense_input_size")
        self.num_embeddings = num_embeddings
        self.num_classes = dense_output_size
        self.embedding = nn.EmbeddingBag(num_embeddings, embedding_dim, sparse=sparse)
        self.dense = nn.Sequential(
            *[nn.Linear(dense_input_size, dense_output_size) for _ in range(dense_layers_count)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense(self.embedding(x))


def build_model(class_name: str, kwargs: dict, seed: int) -> nn.Module:
    """Builds a model with seeded initialisation, so every trainer starts from the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS.get(class_name)(**kwargs)
