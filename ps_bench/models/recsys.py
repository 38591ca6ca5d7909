"""A DLRM-style recommendation model: large EmbeddingBag tables (dense or sparse gradients) and
MLPs, on seeded synthetic clicks; the workload parameter servers were made for."""

from __future__ import annotations

import torch
from torch import nn

from ps_bench.models.base import (DATA, HELD_OUT_STREAM, MODELS, RANDOM, TEACHER_STREAM,
                                  BenchmarkModel, Dataset, SyntheticData, need_positive, preset,
                                  stream)

CLICKS = "dense features and bags of ids per table"


@DATA.register("SyntheticClicks")
class SyntheticClicks(SyntheticData):
    """Normal dense features, ``bag_size`` uniformly drawn ids per table, and a click label.

    Teacher clicks: a click when a seeded score is positive. The score is the sum of seeded
    +1/-1 values of every id in the sample's bags, divided by the square root of their number,
    plus the dense features' projection on a seeded unit direction; both parts count alike.
    The dense features are then moved ``MARGIN`` along that direction, away from the boundary,
    so every sample is decided by a clear margin (what lets the loss fall tenfold)."""

    gives = CLICKS
    teacher = ("a click when seeded +1/-1 values of the sample's ids and a seeded projection of "
               "its dense features sum above 0")
    MARGIN = 1.0

    def __init__(self, sample_count: int, dense_features: int = 13, tables: int = 8,
                 rows_per_table: int = 250_000, bag_size: int = 4) -> None:
        need_positive(sample_count=sample_count, dense_features=dense_features, tables=tables,
                      rows_per_table=rows_per_table, bag_size=bag_size)
        self.sample_count, self.dense_features, self.tables = sample_count, dense_features, tables
        self.rows_per_table, self.bag_size = rows_per_table, bag_size
        self.num_classes = 2

    def build(self, seed: int, labels: str = RANDOM) -> Dataset:
        generator = torch.Generator().manual_seed(seed)
        dense, ids = self.inputs(self.sample_count, generator)
        if labels != RANDOM:
            return self.taught(dense, ids, seed)
        return Dataset((dense, ids), torch.randint(0, 2, (self.sample_count,),
                                                   generator=generator))

    def held_out(self, seed: int, count: int) -> Dataset:
        return self.taught(*self.inputs(count, stream(seed, HELD_OUT_STREAM)), seed)

    def inputs(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        dense = torch.randn(count, self.dense_features, generator=generator)
        return dense, torch.randint(0, self.rows_per_table, (count, self.tables, self.bag_size),
                                    generator=generator)

    def taught(self, dense: torch.Tensor, ids: torch.Tensor, seed: int) -> Dataset:
        teacher = stream(seed, TEACHER_STREAM)
        direction = torch.randn(self.dense_features, generator=teacher)
        direction /= direction.norm()
        values = torch.randint(0, 2, (self.tables, self.rows_per_table),
                               generator=teacher) * 2.0 - 1.0
        from_ids = values[torch.arange(self.tables)[:, None], ids].sum(dim=(1, 2))
        from_ids /= (self.tables * self.bag_size) ** 0.5
        clicks = (from_ids + dense @ direction > 0).long()
        dense = dense + (2.0 * clicks - 1.0)[:, None] * self.MARGIN * direction
        return Dataset((dense, ids), clicks)


def mlp(sizes: list[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for inputs, outputs in zip(sizes, sizes[1:]):
        layers += [nn.Linear(inputs, outputs), nn.ReLU()]
    return nn.Sequential(*layers[:-1])  # logits and the interaction take the last layer raw


@MODELS.register("DLRM")
class DLRM(BenchmarkModel):
    """Bottom MLP over dense features, one EmbeddingBag per table, pairwise dot products of
    all those vectors, and a top MLP to click / no-click logits."""

    takes = CLICKS

    def __init__(self, dense_features: int = 13, tables: int = 8, rows_per_table: int = 250_000,
                 embedding_dim: int = 64, bottom_mlp: list[int] | None = None,
                 top_mlp: list[int] | None = None, sparse: bool = True) -> None:
        super().__init__()
        bottom_mlp = [512, 256] if bottom_mlp is None else bottom_mlp
        top_mlp = [512, 256] if top_mlp is None else top_mlp
        need_positive(dense_features=dense_features, tables=tables, rows_per_table=rows_per_table,
                      embedding_dim=embedding_dim)
        for name, sizes in (("bottom_mlp", bottom_mlp), ("top_mlp", top_mlp)):
            if not isinstance(sizes, list):
                raise ValueError(f"{name} must be a list of layer widths; got {sizes!r}")
            need_positive(**{f"{name}[{i}]": width for i, width in enumerate(sizes)})
        if not isinstance(sparse, bool):
            raise ValueError(f"sparse must be true or false; got {sparse!r}")
        self.dense_features, self.tables, self.rows_per_table = (dense_features, tables,
                                                                 rows_per_table)
        self.num_classes = 2
        self.bottom = mlp([dense_features, *bottom_mlp, embedding_dim])
        self.embeddings = nn.ModuleList(
            nn.EmbeddingBag(rows_per_table, embedding_dim, mode="sum", sparse=sparse)
            for _ in range(tables))
        pairs = (tables + 1) * tables // 2
        self.top = mlp([embedding_dim + pairs, *top_mlp, 2])

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = self.bottom(dense)
        vectors = torch.stack([x, *(table(ids[:, t]) for t, table in enumerate(self.embeddings))],
                              dim=1)
        products = torch.bmm(vectors, vectors.transpose(1, 2))
        upper = torch.triu_indices(self.tables + 1, self.tables + 1, offset=1, device=dense.device)
        return self.top(torch.cat([x, products[:, upper[0], upper[1]]], dim=1))

    def fits(self, data: SyntheticData) -> str | None:
        if (data.tables, data.dense_features) != (self.tables, self.dense_features):
            return (f"has {data.tables} tables and {data.dense_features} dense features but the "
                    f"model takes {self.tables} and {self.dense_features}")
        if data.rows_per_table > self.rows_per_table:
            return (f"draws ids below {data.rows_per_table} but the model's tables have "
                    f"{self.rows_per_table} rows")
        return None


preset("dlrm", "DLRM", {}, "clicks", "SyntheticClicks", {"sample_count": 2048})
preset("dlrm_small", "DLRM", {"tables": 4, "rows_per_table": 1000, "embedding_dim": 16,
                              "bottom_mlp": [32], "top_mlp": [32]},
       "clicks_small", "SyntheticClicks",
       {"sample_count": 512, "tables": 4, "rows_per_table": 1000}, small_of="dlrm")
