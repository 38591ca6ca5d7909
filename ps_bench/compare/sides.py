"""The two sides of ``bench.py compare``: reading each (a results file, a sweep folder or its
``.jsonl``, a folder of results files) into its successful ``Run``s, and matching the points of
base and new by their configuration (``--match`` names options to ignore), with a label for each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ps_bench.config import JSON_KEYS, ConfigError
from ps_bench.options import plural
from ps_bench.results.files import NOT_HASHED, config_hash
from ps_bench.results.load import diverged, load_source
from ps_bench.strategies import SERVER_COUNTS, sends_to_servers

# Resolved options that say where a run wrote or listened, or what it derived, not what it measured.
# engine_config: derived from the options
NOT_COMPARED = (*NOT_HASHED, "model_size", "master_port", "engine_config")
# --match model also ignores the model's entry, and --match data the data's.
ENTRIES = {"model": "model_config", "data": "data_config"}
OPTION_OF_ENTRY = {entry: option for option, entry in ENTRIES.items()}


# ---------------------------------------------------------------------------- the sides


@dataclass
class Run:
    source: str  # the file, and the line of a .jsonl
    results: dict

    @property
    def config(self) -> dict:
        return self.results.get("config", {})

    @property
    def ok(self) -> bool:
        return self.results.get("status") == "ok"

    @property
    def point_name(self) -> str | None:
        return (self.results.get("point") or {}).get("name")


@dataclass
class Side:
    role: str  # "base" or "new"
    path: str
    kind: str
    runs: list[Run]  # the successful ones
    failed: list[Run] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # files of a folder that are not results files
    torn: int = 0  # lines of a results.jsonl that do not parse (a killed writer's)

    def describe(self) -> str:
        torch = sorted({str((run.results.get("env") or {}).get("torch")) for run in self.runs})
        extra = [f"{plural(len(self.failed), 'failed run')} left out"] if self.failed else []
        one = len(self.skipped) == 1
        extra += ([f"{plural(len(self.skipped), 'file')} that "
                   f"{'is not a results file' if one else 'are not results files'} skipped "
                   f"({', '.join(self.skipped)})"] if self.skipped else [])
        extra += [f"{plural(self.torn, 'torn line')} skipped"] if self.torn else []
        lost = sum(diverged(run.results) for run in self.runs)
        extra += ([f"{plural(lost, 'run')} diverged: parameters not finite, their times hold, "
                   f"their training did not"] if lost else [])
        return (f"{self.role}: {self.path} ({self.kind}, {plural(len(self.runs), 'run')}, torch "
                f"{', '.join(torch)}{''.join('; ' + e for e in extra)})")


def load_side(source: str, role: str) -> Side:
    """A results file, a sweep folder (its results.jsonl), a .jsonl file, or a folder of results
    files (those that are not results files are passed over and counted); a sweep's re-run
    point's latest line wins, each repeat of it apart."""
    loaded = load_source(source)
    latest: dict[Any, Run] = {}
    for number, (where, results) in enumerate(loaded.runs):
        point = results.get("point") or {}
        key = (point["hash"], point.get("repeat", 1)) if "hash" in point else number
        latest.pop(key, None)
        latest[key] = Run(where, results)
    runs = list(latest.values())
    if not runs:
        passed = "; ".join(loaded.passed_over())
        raise ConfigError(f"compare: {role} {source!r} holds no results (give a results file, a "
                          f"sweep folder or a folder of results files)"
                          + (f"; passed over {passed}" if passed else ""))
    ok = [run for run in runs if run.ok]
    if not ok:
        raise ConfigError(f"compare: {role} {source!r} holds no successful run "
                          f"({len(runs)} failed)")
    return Side(role, source, loaded.kind, ok, [run for run in runs if not run.ok], loaded.skipped,
                loaded.torn)


# ---------------------------------------------------------------------------- matching


def ignored_fields(match: str | None) -> list[str]:
    """The resolved option names ``--match`` lists (dash or underscore spelling, or an alias)."""
    if not match:
        return []
    names: list[str] = []
    for text in filter(None, (part.strip() for part in match.split(","))):
        name = JSON_KEYS.get(text) or JSON_KEYS.get(text.replace("-", "_"))
        if name is None or name == "config":
            known = sorted({v for v in JSON_KEYS.values()} - {"config"})
            raise ConfigError(f"--match {text!r}: not an option; options: {', '.join(known)}")
        names += [name] + ([ENTRIES[name]] if name in ENTRIES else [])
    return list(dict.fromkeys(names))


def shown(value: Any) -> str:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)


def compared_config(config: dict, ignored: Sequence[str]) -> dict:
    """The options that make the point, servers a strategy sends nothing to counted as none:
    all-reduce recorded with the idle ``--nserver 1`` every hook had before ``--nserver``
    followed the hook is the same point as today's (the pairing shows the difference). Where
    ``--match hook`` ignores the hook, the server counts are compared as they are."""
    kept = {k: v for k, v in config.items() if k not in NOT_COMPARED and k not in ignored}
    if not sends_to_servers(kept.get("hook")):
        kept.update({name: 0 for name in SERVER_COUNTS if name in kept})
    return kept


def point_key(run: Run, ignored: Sequence[str]) -> str:
    """The sweep's configuration hash of a run (of what is left once ``ignored`` is taken out)."""
    return config_hash(compared_config(run.config, ignored))


def group_points(side: Side, ignored: Sequence[str]) -> dict[str, list[Run]]:
    points: dict[str, list[Run]] = {}
    for run in side.runs:
        points.setdefault(point_key(run, ignored), []).append(run)
    return points


def differing_fields(base: list[Run], new: list[Run]) -> dict[str, tuple[str, str]]:
    """Options whose values differ between two groups of runs: name -> (base's, new's)."""
    names = list(dict.fromkeys(k for run in base + new for k in run.config
                               if k not in NOT_COMPARED))
    out = {}
    for name in names:
        before = sorted({shown(run.config.get(name)) for run in base})
        after = sorted({shown(run.config.get(name)) for run in new})
        if before != after:
            out[name] = (", ".join(before), ", ".join(after))
    return out


@dataclass
class Pairing:
    base: list[Run]
    new: list[Run]
    key: str
    # fields that differ between base and new (ignored, or a forced pair)
    differs: dict[str, tuple[str, str]]
    label: str = ""


def pair_points(base: Side, new: Side,
                ignored: Sequence[str]) -> tuple[list[Pairing], list[list[Run]], list[list[Run]]]:
    """Matched points, and the points of base and of new that match nothing. Two sides of one
    point each are paired whatever else differs (the fields that do are shown); two models
    are refused unless --match model says to ignore the model."""
    if "model" not in ignored:
        models_base = {shown(run.config.get("model")) for run in base.runs}
        models_new = {shown(run.config.get("model")) for run in new.runs}
        if not models_base & models_new:
            raise ConfigError(f"compare: base runs model {', '.join(sorted(models_base))} and new "
                              f"runs {', '.join(sorted(models_new))}: compare runs of one model, "
                              f"or add --match model to compare them all the same")
    points_base, points_new = group_points(base, ignored), group_points(new, ignored)
    common = [key for key in points_base if key in points_new]
    if not common and len(points_base) == 1 and len(points_new) == 1:
        (key, runs_base), (_, runs_new) = (next(iter(points_base.items())),
                                           next(iter(points_new.items())))
        pairing = Pairing(runs_base, runs_new, key, differing_fields(runs_base, runs_new))
        label_points([runs_base + runs_new], [pairing])
        return [pairing], [], []
    if not common:
        # an entry differs with its option (model_config with model): --match takes the option
        differs = list(dict.fromkeys(OPTION_OF_ENTRY.get(name, name)
                                     for name in differing_fields(base.runs, new.runs)))
        hint = (f"; --match {','.join(differs)} ignores them" if differs else "")
        raise ConfigError(f"compare: no point of {new.path!r} has the configuration of a point of "
                          f"{base.path!r} ({len(points_base)} and {len(points_new)} points); the "
                          f"options that differ: {', '.join(differs) or 'none'}{hint}")
    pairings = [Pairing(points_base[key], points_new[key], key,
                        differing_fields(points_base[key], points_new[key]))
                for key in common]
    label_points([*points_base.values(), *points_new.values()], pairings)
    return (pairings, [runs for key, runs in points_base.items() if key not in common],
            [runs for key, runs in points_new.items() if key not in common])


def varying(groups: list[list[Run]]) -> list[str]:
    names = list(dict.fromkeys(k for runs in groups for run in runs for k in run.config
                               if k not in NOT_COMPARED and k not in ENTRIES.values()))
    return [n for n in names
            if len({shown(run.config.get(n)) for runs in groups for run in runs}) > 1]


def point_label(runs: list[Run], columns: list[str]) -> str:
    """Its name in the sweep (where every run of it has one, the same), else the options that tell
    it from the other points, else its model."""
    names = {run.point_name for run in runs}
    if len(names) == 1 and None not in names:
        return names.pop()
    return (" ".join(f"{c}={shown(runs[0].config.get(c))}" for c in columns) or
            shown(runs[0].config.get("model")))


def label_points(groups: list[list[Run]], pairings: list[Pairing]) -> None:
    columns = [c for c in varying(groups) if not any(c in p.differs for p in pairings)]
    for pairing in pairings:
        label = point_label(pairing.base + pairing.new, columns)
        changed = "; ".join(f"{name}: {before} -> {after}"
                            for name, (before, after) in pairing.differs.items()
                            if name not in ENTRIES.values())
        pairing.label = (f"{label} ({changed})" if changed and len(pairings) > 1
                         else changed or label)
