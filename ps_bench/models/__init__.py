"""Benchmark models and their seeded synthetic data, one module per family."""

from ps_bench.models import dummy, recsys, transformer, vision  # noqa: E402,F401  (register the families)
from ps_bench.models.base import (  # noqa: F401
    DATA,
    DATA_PRESETS,
    MODEL_PRESETS,
    MODELS,
    PRESET_DATA,
    RANDOM,
    TEACHER,
    TEST_SIZED,
    Dataset,
    build_data,
    build_held_out,
    build_model,
)
