"""The points ``bench.py report`` shows: each results file as a ``Row``, read from files or
folders, and the options that vary across them."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ps_bench.config import ConfigError
from ps_bench.results.load import files_read, load_source
from ps_bench.registry import UnknownNameError
from ps_bench.strategies import HOOKS, SERVER_COUNTS

# Resolved options never shown as columns: they describe the output, or repeat another column.
HIDDEN = {"out", "dry_run", "per_rank", "debug", "verbose", "emulate_keep", "model_config",
          "data_config", "model_size", "master_port", "engine_config"}


# what an iteration computes: points that differ in any of these do different work, no speedup
WORKLOAD = ("model", "model_options", "data", "batch_size", "grad_accum")


@dataclass
class Row:
    label: str
    results: dict
    run: int | None = None  # which run of a point a sweep ran several times (its ``repeat``)

    @property
    def ok(self) -> bool:
        return self.results.get("status") == "ok"

    def option(self, name: str) -> Any:
        value = self.results.get("config", {}).get(name)
        return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value

    def stat(self, metric: str, statistic: str, role: str | None = None) -> float | None:
        """A summary row's statistic: the first of ``metric``'s, or of ``role``'s."""
        for row in self.results.get("summary", []):
            if row["metric"] == metric and role in (None, row["role"]):
                return row.get(statistic)
        return None

    @property
    def periodic(self) -> bool:
        """Whether its strategy synchronises once a period (``Strategy.periodic``)."""
        hook = self.results.get("config", {}).get("hook")
        try:
            return isinstance(hook, str) and HOOKS.record(HOOKS.canonical(hook)).periodic
        except UnknownNameError:  # a strategy this version does not know
            return False

    @property
    def trainer_peak(self) -> int | None:
        """The most memory a trainer held, as its run's Memory table gives it: on a GPU the
        allocator's peak, on the CPU its model states, activations and kept buffers."""
        return ((self.results.get("memory") or {}).get("trainer") or {}).get("peak_bytes")

    def count(self, *names: str) -> int:
        return sum(int(self.results.get("config", {}).get(name, 0)) for name in names)

    @property
    def point(self) -> tuple:
        """What the runs of one point share (a sweep line's name and configuration hash); a
        results file is a point of its own."""
        where = self.results.get("point", {}).get("hash")
        return (self.label, where) if where else (self.label, id(self))

    @property
    def workload(self) -> tuple:
        return tuple(self.option(name) for name in WORKLOAD)

    @property
    def has_loss_curve(self) -> bool:
        """A run to --target-loss, with the loss curve report --plot draws."""
        return bool((self.results.get("convergence") or {}).get("loss_curve"))

    def raw(self, metric: str) -> list[float]:
        return [v for entry in self.results.get("samples", [])
                for v in entry.get("metrics", {}).get(metric, [])]


def load_rows(sources: list[str]) -> list[Row]:
    """Points from sweep folders (their results.jsonl; a re-run point's latest line wins, each
    run of a point the sweep repeats a row of its own, ``run``), .jsonl files, folders of
    results files and single results files, in the order given."""
    rows: list[Row] = []
    sources_read = [load_source(source) for source in sources]
    read_by: dict[Path, str] = {}
    for source in sources:
        for file in files_read([source]):
            if read_by.get(file) == source:
                raise ConfigError(f"{source!r} is given twice: give it once (a run counted twice "
                                  f"weighs twice in the medians)")
            if file in read_by:
                raise ConfigError(f"{read_by[file]!r} and {source!r} both hold the runs of "
                                  f"{file}: give each once (a run counted twice weighs twice in "
                                  f"the medians)")
            read_by[file] = source
    passed_over = [what for loaded in sources_read for what in loaded.passed_over()]
    for source, loaded in zip(sources, sources_read):
        if loaded.kind in ("sweep folder", "sweep results"):
            latest: dict[tuple, dict] = {}
            for _, line in loaded.runs:
                point = line.get("point", {})
                key = (point.get("hash") or str(len(latest)), point.get("repeat", 1))
                latest.pop(key, None)
                latest[key] = line
            repeated = {key[0] for key in latest if key[1] > 1}
            for (hash_, repeat), line in sorted(
                    latest.items(), key=lambda item: (item[1].get("point", {}).get("index", 0),
                                                      item[0][1])):
                rows.append(Row(line.get("point", {}).get("name", Path(source).stem), line,
                                repeat if hash_ in repeated else None))
        else:
            rows += [Row(Path(where).stem, results) for where, results in loaded.runs]
    if not rows:
        raise ConfigError(f"report: no results in {', '.join(sources)}"
                          + (f" (passed over {'; '.join(passed_over)})" if passed_over else ""))
    for what in passed_over:
        print(f"ps_bench: report: passed over {what}", file=sys.stderr)
    return rows


def varying_options(rows: list[Row]) -> list[str]:
    """The options that take two values or more over ``rows``, as they appear in the config; the
    server counts left out where they only go with the hook (as many as each strategy sends to,
    what ``--nserver`` left out gives)."""
    names: list[str] = []
    for row in rows:
        for name in row.results.get("config", {}):
            if name not in names and name not in HIDDEN:
                names.append(name)
    varying = [n for n in names if len({str(row.option(n)) for row in rows}) > 1]
    return [n for n in varying if not (n in SERVER_COUNTS and "hook" in varying
                                       and follows(rows, n, "hook"))]


def follows(rows: list[Row], name: str, leader: str) -> bool:
    """Whether ``name`` takes one value for each value of ``leader`` over ``rows``."""
    value_of: dict[str, str] = {}
    return all(value_of.setdefault(str(row.option(leader)), str(row.option(name)))
               == str(row.option(name)) for row in rows)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
