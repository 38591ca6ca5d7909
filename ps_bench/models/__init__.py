"""Benchmark models and their seeded synthetic data, one module per family; ``model_entry`` finds
what ``--model`` names: an entry of the model configuration file, a zoo model, or a Hugging Face
architecture (``hf:CONFIG``)."""

from typing import Any

# register the families
from ps_bench.models import dummy, huggingface, recsys, transformer, vision  # noqa: E402,F401
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
from ps_bench.models.entries import DEFAULT_DATA, ZOO, Entry, load_entry, with_options  # noqa: E402


def model_entry(name: str, options: dict[str, Any], config_path: str) -> Entry:
    """The model entry ``--model name`` (with ``--model-option``s) names; ConfigError if none."""
    if huggingface.is_hf(name):
        return huggingface.entry(name, options)
    return with_options(load_entry(config_path, name, "model_class", MODELS, "model",
                                   MODEL_PRESETS), options, MODELS)


def default_data(model: Entry) -> str:
    """The data a model trains on when --data is left out: a zoo model's own, tokens for a
    Hugging Face model, else upstream's default."""
    if model.class_name == huggingface.CLASS_NAME:
        return huggingface.DEFAULT_DATA
    return PRESET_DATA.get(model.id, DEFAULT_DATA) if model.source == ZOO else DEFAULT_DATA
