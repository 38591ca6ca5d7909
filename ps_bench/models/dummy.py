"""Upstream's benchmark model and data: an EmbeddingBag and a stack of linear layers, trained on
random bags of indices."""

from __future__ import annotations

import torch
from torch import nn

from ps_bench.models.base import (DATA, HELD_OUT_STREAM, MODELS, RANDOM, TEACHER_STREAM,
                                  BenchmarkModel, Dataset, SyntheticData, need_positive, stream)

BAGS = "bags of embedding indices"


@DATA.register("DummyData")
class DummyData(SyntheticData):
    """Random bags of indices drawn from ``(100 - sparsity_percentage)``% of ``[0, max_val)``.

    ``sparsity_percentage`` is the share of embedding rows that no sample touches, so sparse
    embedding gradients stay sparse. ``sample_count`` and ``sample_length`` are upstream's
    current names; ``input_samples`` and ``input_dim`` its older ones, accepted as aliases.

    Teacher labels: each row in use belongs to one class (a seeded shuffle dealt round-robin),
    and a bag's label is the class most of its rows belong to (ties to the lower class). So
    that most bags have a clear majority, each bag draws every index with probability
    ``1/2`` from the rows of one seeded class, else from all rows in use. An EmbeddingBag's
    mean followed by a linear map computes the rule exactly.
    """

    gives = BAGS
    teacher = ("the class most of the bag's rows belong to (rows dealt to classes by a seeded "
               "shuffle)")

    def __init__(
        self,
        max_val: int,
        sample_count: int | None = None,
        sample_length: int | None = None,
        sparsity_percentage: int = 0,
        num_classes: int = 10,
        input_samples: int | None = None,
        input_dim: int | None = None,
    ) -> None:
        self.sample_count = one_of("sample_count", sample_count, "input_samples", input_samples)
        self.sample_length = one_of("sample_length", sample_length, "input_dim", input_dim)
        need_positive(max_val=max_val, sample_count=self.sample_count,
                      sample_length=self.sample_length, num_classes=num_classes)
        if isinstance(sparsity_percentage, bool) or not isinstance(sparsity_percentage, int) \
                or not 0 <= sparsity_percentage < 100:
            raise ValueError(f"sparsity_percentage must be an integer in [0, 100); "
                             f"got {sparsity_percentage!r}")
        self.max_val, self.sparsity_percentage, self.num_classes = (max_val, sparsity_percentage,
                                                                    num_classes)

    def build(self, seed: int, labels: str = RANDOM) -> Dataset:
        generator = torch.Generator().manual_seed(seed)
        rows = self.rows_in_use(generator)
        if labels != RANDOM:
            return self.taught(rows, self.sample_count, stream(seed, TEACHER_STREAM))
        picks = torch.randint(0, len(rows), (self.sample_count, self.sample_length),
                              generator=generator)
        targets = torch.randint(0, self.num_classes, (self.sample_count,), generator=generator)
        return Dataset((rows[picks],), targets)

    def held_out(self, seed: int, count: int) -> Dataset:
        return self.taught(self.rows_in_use(torch.Generator().manual_seed(seed)), count,
                           stream(seed, HELD_OUT_STREAM))

    def rows_in_use(self, generator: torch.Generator) -> torch.Tensor:
        used = max(1, int(self.max_val * (100 - self.sparsity_percentage) / 100))
        return torch.randperm(self.max_val, generator=generator)[:used]

    def taught(self, rows: torch.Tensor, count: int, generator: torch.Generator) -> Dataset:
        """``count`` bags of ``rows`` (the rows in use, in their seeded order, dealt to the
        classes round-robin), each leaning to a drawn class, labelled by their majority class."""
        classes = torch.arange(len(rows)) % self.num_classes
        leaning = torch.randint(0, self.num_classes, (count,), generator=generator)
        anywhere = torch.randint(0, len(rows), (count, self.sample_length), generator=generator)
        # an index into the leaning class's rows: rows c, c + C, c + 2C, ... belong to class c
        # rows of each bag's class
        per_class = (len(rows) - leaning + self.num_classes - 1) // self.num_classes
        within = (torch.rand(count, self.sample_length, generator=generator) *
                  per_class[:, None]).long()
        own = leaning[:, None] + self.num_classes * within
        lean = torch.rand(count, self.sample_length, generator=generator) < 0.5
        picks = torch.where(lean & (per_class[:, None] > 0), own, anywhere)
        votes = torch.nn.functional.one_hot(classes[picks], self.num_classes).sum(dim=1)
        return Dataset((rows[picks],), votes.argmax(dim=1))


def one_of(name: str, value: int | None, old_name: str, old_value: int | None) -> int:
    """Upstream renamed some data settings: either spelling is accepted, never both."""
    if value is not None and old_value is not None:
            raise ValueError(f"gives both {name!r} and {old_name!r}, two names for one setting; "
                             f"keep {name!r}")
    if value is None and old_value is None:
        raise ValueError(f"needs {name!r} (or its older name {old_name!r})")
    return value if value is not None else old_value


@MODELS.register("DummyModel")
class DummyModel(BenchmarkModel):
    """EmbeddingBag (optionally with sparse gradients) followed by a stack of linear layers.

    Returns logits: the loss applies its own softmax.
    """

    takes = BAGS

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
        need_positive(num_embeddings=num_embeddings, embedding_dim=embedding_dim,
                      dense_input_size=dense_input_size, dense_output_size=dense_output_size,
                      dense_layers_count=dense_layers_count)
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be true or false; got {sparse!r}")
        if dense_input_size != embedding_dim:
            raise ValueError(f"dense_input_size ({dense_input_size}) must equal embedding_dim "
                             f"({embedding_dim})")
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

    def fits(self, data: SyntheticData) -> str | None:
        if data.max_val > self.num_embeddings:
            return (f"draws indices below max_val={data.max_val} but the model has only "
                    f"{self.num_embeddings} embeddings")
        if data.num_classes > self.num_classes:
            return f"has {data.num_classes} classes but the model outputs {self.num_classes}"
        return None
