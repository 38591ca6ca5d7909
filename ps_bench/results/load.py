"""Reading results back: the one checked loader that ``report``, ``compare``, ``predict`` and
``sweep --resume`` read through.

A source is a results file, a sweep's ``results.jsonl``, a sweep folder (its ``results.jsonl``)
or a folder of results files. Whichever command reads it, a file of another schema version, a
truncated file, or a file that is not a results file stops it with the same one line (a
``ConfigError``: exit status 2) that names the file and what is wrong. Two things are passed
over rather than refused, and counted: a line of a ``results.jsonl`` that does not parse (the
line a killed writer tore; ``files.append_line`` starts the next one on a line of its own), and
a file of a folder that is not a results file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ps_bench.config import RESULTS_SCHEMA, ConfigError
from ps_bench.runfiles import is_run_options
from ps_bench.options import plural
from ps_bench.results.files import RESULTS_NAME

READS = (RESULTS_SCHEMA,)  # the schema versions this ps_bench reads
# besides "schema", in every results object
REQUIRED = {"status": str, "config": dict, "summary": list}


def check(results: Any, where: str) -> dict:
    """``results`` if it is a results object this ps_bench reads, else a ConfigError naming
    ``where``."""
    if is_run_options(results):
        raise ConfigError(f"{where} holds a run config, not results: run it with bench.py "
                          f"--config FILE, then give the results file it writes")
    if not isinstance(results, dict) or not isinstance(results.get("schema"), str):
        raise ConfigError(f"{where} is not a ps_bench results file "
                          f"(it has no \"schema\": \"{RESULTS_SCHEMA}\")")
    if results["schema"] not in READS:
        raise ConfigError(f"{where} has schema {results['schema']!r}, and this ps_bench reads "
                          f"{', '.join(READS)}: read it with the ps_bench that wrote it")
    wrong = [key for key, kind in REQUIRED.items() if not isinstance(results.get(key), kind)]
    if wrong:
        raise ConfigError(f"{where} is not a whole results file: "
                          f"{', '.join(repr(k) for k in wrong)} missing or of the wrong type")
    return results


def parse(text: str, where: str) -> Any:
    """The JSON in ``text``; a ConfigError naming ``where`` says whether it stops short or is no
    JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        cut_in_a_string = (error.msg.startswith("Unterminated string") and
                           '"' not in text[error.pos + 1:])
        if text.strip() and (error.pos >= len(text.rstrip()) or cut_in_a_string):
            end = text.rstrip()
            raise ConfigError(f"{where} is truncated: its JSON is cut off at line "
                              f"{end.count(chr(10)) + 1} column "
                              f"{len(end) - end.rfind(chr(10))} ({error.msg})") from None
        raise ConfigError(f"{where} is not JSON: {error.msg} at line {error.lineno} "
                          f"column {error.colno}") from None


def read_text(path: Path, where: str) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not a ps_bench results file (it is not text)") from None
    except OSError as error:
        raise ConfigError(f"{where} cannot be read: {error.strerror}") from None


def load_file(path: str | Path) -> dict:
    """One results file, checked."""
    where = f"results file {str(path)!r}"
    return check(parse(read_text(Path(path), where), where), where)


def diverged(results: dict) -> bool:
    """Whether a run finished with parameters that are not finite (``param_norm`` null in its
    file, NaN before it is written): its times hold, its training did not."""
    replicas = results.get("replicas") or {}
    norm = replicas.get("param_norm", 0.0)
    return (results.get("status") == "ok" and "param_norm" in replicas
            and (norm is None or not math.isfinite(norm)))


def load_lines(path: str | Path) -> list[dict]:
    """A ``results.jsonl``'s results objects, each checked, in order (a file that does not exist
    holds none)."""
    return [results for _, results in numbered_lines(Path(path))[0]]


def numbered_lines(path: Path) -> tuple[list[tuple[int, dict]], int]:
    """A ``results.jsonl``'s results objects with their line numbers, and how many torn lines
    were passed over."""
    if not path.exists():
        return [], 0
    lines, torn = [], 0
    for number, text in enumerate(read_text(path, f"results file {str(path)!r}").splitlines(),
                                  start=1):
        if not text.strip():
            continue
        try:
            results = json.loads(text)
        except json.JSONDecodeError:
            torn += 1
            continue
        lines.append((number, check(results, f"results file {str(path)!r} line {number}")))
    return lines, torn


@dataclass
class Source:
    """What one source named on a command line holds: each results object with where it came
    from."""

    path: str
    kind: str  # "results file", "sweep folder", "sweep results", "folder of results files"
    runs: list[tuple[str, dict]]  # (where, results), in file or line order
    # files of a folder that are not results files
    skipped: list[str] = field(default_factory=list)
    torn: int = 0  # lines of a results.jsonl that do not parse

    def passed_over(self) -> list[str]:
        """What of it was not read, in words (empty where it was all read)."""
        one = len(self.skipped) == 1
        return ([f"{plural(len(self.skipped), 'file')} of {self.path} that "
                 f"{'is not a results file' if one else 'are not results files'} "
                 f"({', '.join(self.skipped)})"] if self.skipped else []) + (
            [f"{plural(self.torn, 'torn line')} of {self.path}"] if self.torn else [])


def files_read(sources: list[str]) -> set[Path]:
    """The files ``load_source`` reads for ``sources`` (as far as they exist), resolved."""
    files = set()
    for source in map(Path, sources):
        if source.is_dir():
            jsonl = source / RESULTS_NAME
            files |= {jsonl} if jsonl.exists() else set(source.glob("*.json"))
        else:
            files.add(source)
    return {file.resolve() for file in files}


def load_source(source: str) -> Source:
    """A results file, a sweep folder, a ``.jsonl`` of a sweep's lines, or a folder of results
    files."""
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{source!r} does not exist (give a results file, a sweep folder or a "
                          f"folder of results files)")
    if path.is_dir() and (path / RESULTS_NAME).exists():
        return lines_source(source, path / RESULTS_NAME, "sweep folder")
    if path.is_dir():
        runs, skipped = [], []
        for file in sorted(path.glob("*.json")):
            try:
                runs.append((str(file), load_file(file)))
            except ConfigError:
                skipped.append(file.name)
        return Source(source, "folder of results files", runs, skipped)
    if path.suffix == ".jsonl":
        return lines_source(source, path, "sweep results")
    return Source(source, "results file", [(source, load_file(path))])


def lines_source(source: str, path: Path, kind: str) -> Source:
    lines, torn = numbered_lines(path)
    runs = [(f"{path}:{number}", line) for number, line in lines]
    return Source(source, kind, runs, torn=torn)
