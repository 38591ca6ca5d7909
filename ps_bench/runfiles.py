"""The command line and JSON files fill a ``RunConfig`` (``ps_bench.config``) and nothing else:
a JSON value checked against its option's type (``coerce``), a run file's or a sweep's options
(``option_values``), a run file or an earlier run's results file read as options
(``load_run_file``), and the precedence of command line over file over defaults
(``build_config``)."""

from __future__ import annotations

import json
from typing import Any

from ps_bench.config import (JSON_KEYS, OPTIONS, PATHS, RESULTS_SCHEMA, ConfigError, RunConfig,
                             field_type, need, read_json)
from ps_bench.registry import did_you_mean


def coerce(name: str, value: Any, source: str) -> Any:
    """Checks a JSON value against the option's type (an int is taken for a float)."""
    kind, metadata = field_type(name), OPTIONS[name].metadata
    if value is None and OPTIONS[name].default is None:
        return None
    need(value != "" or metadata["metavar"] not in PATHS,
         f"{source}: {name!r} is an empty path: name one, or leave the option out")
    if metadata["numbers_as_text"] and type(value) in (int, float):  # a bool is neither
        value = str(value)
    if kind is list:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise ConfigError(f"{source}: {name!r} must be a list of strings, "
                              f"got {json.dumps(value)}")
        return value
    try:
        return as_type(value, kind)
    except TypeError as error:
        raise ConfigError(f"{source}: {name!r} {error}, got {json.dumps(value)}") from None


TYPE_WORDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false",
              dict: "an object of KEY: VALUE"}


def as_type(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (a bool is no int; an int is taken for a float, as a
    float); otherwise TypeError, whose text says what it must be."""
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    raise TypeError(f"must be {TYPE_WORDS.get(kind, kind.__name__)}")


def option_values(raw: dict, where: str, refused: dict[str, str] | None = None) -> dict[str, Any]:
    """A JSON object of run options (a run file's, a sweep's) under the options' names, each
    value checked against its option's type; ``refused``: options it may not set, with why."""
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in JSON_KEYS:
            raise ConfigError(f"{where}: unknown option {key!r}; {did_you_mean(key, OPTIONS)}"
                              f"valid options: {', '.join(sorted(OPTIONS))}")
        name = JSON_KEYS[key]
        if name in (refused or {}):
            raise ConfigError(f"{where}: {refused[name]}")
        values[name] = coerce(name, value, where)
    return values


# what a results file's "config" holds beside the run's options: resolved entries, its own file
NOT_RERUN = ("model_config", "data_config", "model_size", "out", "dry_run")


def is_run_options(raw: Any) -> bool:
    """Whether a file's JSON is a run config: an object of run options and nothing else."""
    return isinstance(raw, dict) and bool(raw) and all(key in OPTIONS for key in raw)


def load_run_file(path: str) -> dict[str, Any]:
    """Reads a run JSON whose keys are option names (``option_values``), or a results file:
    the options of its run, but where its results went, so that the run can be made again."""
    raw = read_json(path, "run config")
    if not isinstance(raw, dict):
        raise ConfigError(f"run config {path!r} must hold a JSON object of options")
    if raw.get("schema") == RESULTS_SCHEMA and isinstance(raw.get("config"), dict):
        return option_values({key: value for key, value in raw["config"].items()
                              if key not in NOT_RERUN}, f"results file {path!r}'s config")
    if {"grid", "variants"} & set(raw) and not set(raw) & set(OPTIONS):
        raise ConfigError(f"{path!r} is a sweep file: run it with bench.py sweep {path} --out DIR")
    return option_values(raw, f"run config {path!r}")


def build_config(cli_values: dict[str, Any], config_path: str | None = None) -> RunConfig:
    """Defaults, then the JSON run file, then the command line (hook and model options by key)."""
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(load_run_file(config_path))
    cli_values = dict(cli_values)
    for name in ("hook_options", "model_options"):
        if name in cli_values:
            cli_values[name] = {**values.get(name, {}), **cli_values[name]}
    values.update(cli_values)
    return RunConfig(**values)
