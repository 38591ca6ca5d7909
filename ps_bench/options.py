"""What every command line of ps_bench shares: the parser that reports bad input in one line
with exit status 2, the exit statuses, and the run's own options (one flag per ``RunConfig``
field, which subcommands that start runs parse after their ``--``)."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
import textwrap
import traceback
from typing import Any, NoReturn

from ps_bench.config import (CONVERGENCE, FAILURES, NETWORK, OPTIONS, PATHS, RUN, STRATEGY,
                             TOPOLOGY, ConfigError, field_type)
from ps_bench.runfiles import TYPE_WORDS
from ps_bench.models import MODEL_PRESETS, TEST_SIZED
from ps_bench.servers import SERVERS
from ps_bench.strategies import HOOKS
from ps_bench.trainers.trainer import TRAINERS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143
# Options that name a registered piece: their --help lists the registry's entries.
REGISTRIES = {"hook": HOOKS, "server": SERVERS, "trainer": TRAINERS}
# Upstream launcher flags with nothing left to choose: each takes exactly the values upstream had
# (None: any value), so upstream's command lines run unchanged and a value it never had is refused.
UPSTREAM_FIXED = {
    "filestore": None,
    "create_criterion": ("cel",),
    "create_ddp_model": ("basic_ddp_model",),
    "create_optimizer": ("sgd_optimizer",),
    "preprocess_data": ("preprocess_dummy_data",),
    "iteration_step": ("basic_iteration_step",),
    "hook_state": ("BasicHookState",),
}
# Upstream launcher flags that named JSON files ps_bench does not read: refused with what to do
# instead.
UPSTREAM_REFUSED = {
    "trainer_config_path": "ps_bench has no trainer configuration file: choose the trainer with "
                           "--trainer and set its options (--batch-size, --lr, --epochs, --hook) "
                           "on the command line or in a --config run file",
    "server_config_path": "ps_bench has no server configuration file: choose the server with "
                          "--server and the layout with --nserver, --ncudaserver and --mapping, on "
                          "the command line or in a --config run file",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written; an option's help wrapped line by line, so a list
    after its first line (a registry's entries, one a line) keeps its lines, each entry's
    continuation indented."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        lines = []
        for number, line in enumerate(text.splitlines()):
            lines += textwrap.wrap(line, width, subsequent_indent="  " if number else "") or [""]
        return lines


# A negative number, with an exponent or a unit (-1e-3, -5us, -1gbit): an option's value, which
# its own check refuses in words, where argparse's own pattern takes it for a flag
NEGATIVE_VALUE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?[A-Za-z%]*$")


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line and exit status 2."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        unknown = "unrecognized arguments: "
        if message.startswith(unknown):  # the flag meant, before any other hint
            extra, opening, rest = message[len(unknown):].partition(" (")
            message = f"{unknown}{extra}{flag_hint(self, extra.split())}{opening}{rest}"
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args=None, namespace=None):
        """argparse's, with an empty path refused: "" would name the working folder where a file
        is meant (an unset shell variable, most often)."""
        known, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(known, action.dest, None)
            if action.metavar in PATHS and "" in (value if isinstance(value, list) else [value]):
                self.error(f"argument {(action.option_strings or [action.metavar])[0]}: "
                           "an empty path")
        return known, extra


def usage_error(error: ConfigError, debug: bool) -> int:
    """Bad input: one line on stderr (the traceback too with --debug), and the usage exit status."""
    if debug:
        traceback.print_exc()
    sys.stderr.write(f"ps_bench: error: {error}\n")
    return EXIT_USAGE


def typed(kind: type, flag: str):
    """An argparse ``type`` whose error names the type expected and the text given."""

    def convert(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {TYPE_WORDS.get(kind, kind.__name__)}, got {text!r}") from None

    convert.__name__ = kind.__name__
    return convert


def plural(count: int, noun: str) -> str:
    """``1 run``, ``3 runs``, ``2 processes``."""
    ending = "es" if noun.endswith(("s", "sh", "ch", "x")) else "s"
    return f"{count} {noun}{'' if count == 1 else ending}"


def flags(name: str) -> list[str]:
    """Every spelling of an option: dashes and underscores, and its aliases."""
    out = []
    for spelling in (name, *OPTIONS[name].metadata["aliases"]):
        for variant in (spelling.replace("_", "-"), spelling):
            if f"--{variant}" not in out:
                out.append(f"--{variant}")
    return out


def key_values(text: str) -> dict | None:
    """``KEY=VALUE`` pairs as a dict, several separated by commas (``a=1,b=2``); VALUE parsed as
    JSON when it can be. None when a pair has no ``=`` or no key."""
    options = {}
    for pair in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_.]*=)", text):
        key, sep, value = pair.strip().partition("=")
        if not sep or not key:
            return None
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


class KeyValue(argparse.Action):
    """Collects ``KEY=VALUE`` pairs into a dict (``key_values``), the flag given once or more."""

    def __call__(self, parser, namespace, value, option_string=None):
        pairs = key_values(value)
        if pairs is None:
            parser.error(f"argument {option_string}: expected KEY=VALUE, got {value!r}")
        setattr(namespace, self.dest, {**(getattr(namespace, self.dest, None) or {}), **pairs})


class HookKeyValue(argparse.Action):
    """Collects ``HOOK:KEY=VALUE[,KEY=VALUE]`` into ``{hook: {key: value}}``, the flag given
    once or more (the names are checked later, against the registry)."""

    def __call__(self, parser, namespace, value, option_string=None):
        hook, sep, text = value.partition(":")
        pairs = key_values(text) if sep and hook.strip() else None
        if pairs is None:
            parser.error(f"argument {option_string}: expected HOOK:KEY=VALUE, got {value!r}")
        given = dict(getattr(namespace, self.dest, None) or {})
        given[hook.strip()] = {**given.get(hook.strip(), {}), **pairs}
        setattr(namespace, self.dest, given)


class Refused(argparse.Action):
    def __call__(self, parser, namespace, value, option_string=None):
        parser.error(f"{option_string}: {UPSTREAM_REFUSED[self.dest.removeprefix('refused_')]}")


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """One flag per ``RunConfig`` field, grouped as the field says; given options only (argparse
    sets no defaults, so a --config file fills the rest)."""
    parser.add_argument("--config", "--config-file", metavar="FILE",
                        help="run options as a JSON object whose keys are these option names, or "
                             "a results file (its run's options, but --out: that run again)")
    groups = {name: parser.add_argument_group(name)
              for name in (TOPOLOGY, STRATEGY, CONVERGENCE, RUN, FAILURES, NETWORK)}
    for name, field in OPTIONS.items():
        meta, default, kind = field.metadata, field.default, field_type(name)
        group = groups[meta["group"]]
        help_text = (meta["help"] if default is None or kind is bool
                     else f"{meta['help']} (default: {default})")
        if name in REGISTRIES:
            help_text += ":\n" + REGISTRIES[name].describe()
        if name == "model":
            help_text += (f"; zoo: {', '.join(m for m in MODEL_PRESETS if m not in TEST_SIZED)}, "
                          f"and their test-sized {', '.join(TEST_SIZED)}")
        if kind is dict:  # hook_options, model_options: --hook-option KEY=VALUE, repeated
            singular = name.removesuffix("s")
            group.add_argument(f"--{singular.replace('_', '-')}", f"--{singular}", dest=name,
                               action=KeyValue, metavar="KEY=VALUE",
                               help=f"{meta['help']} (repeat, or separate pairs with commas); "
                                    f"VALUE is JSON (4, true, 0.5) or text; in a JSON run file: "
                                    f"\"{name}\": {{...}}")
        elif kind is bool:
            group.add_argument(*flags(name), dest=name, action="store_true", help=help_text)
        elif kind is list:  # repeated: each occurrence adds one
            group.add_argument(*flags(name), dest=name, action="append", metavar=meta["metavar"],
                               help=meta["help"])
        else:
            metavar = (None if meta["choices"]
                       else meta["metavar"] or {int: "N", float: "X"}.get(kind, "NAME"))
            group.add_argument(*flags(name), dest=name, type=typed(kind, name),
                               choices=meta["choices"] or None,
                               metavar=metavar, help=help_text)
    compat = parser.add_argument_group(
        "upstream launcher flags", "accepted so upstream's experiment command lines run unchanged; "
        "ps_bench has one way to do each, so they choose nothing (the rendezvous uses a TCP store, "
        "not --filestore)")
    for name, allowed in UPSTREAM_FIXED.items():
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        compat.add_argument(*spellings, dest=f"ignored_{name}", choices=allowed,
                            metavar="PATH" if allowed is None else allowed[0],
                            help=("ignored" if allowed is None
                                  else "upstream's only value; anything else is refused"))
    for name in UPSTREAM_REFUSED:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('_', '-')}"])
        compat.add_argument(*spellings, dest=f"refused_{name}", action=Refused, metavar="PATH",
                            help="refused, with what to use instead")


def file_hint(extra: list[str]) -> str:
    """Where a file given with no flag goes: a run file after --config, a sweep after sweep."""
    files = [arg for arg in extra if arg.endswith(".json") and not arg.startswith("-")]
    if not files:
        return ""
    return (f" (a run file goes after --config: bench.py --config {files[0]}; a sweep file "
            f"after sweep: bench.py sweep {files[0]} --out DIR)")


def flag_hint(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``; did you mean '--ntrainer'?`` for the first unknown flag close to one of the parser's,
    compared without the dashes every flag starts with, and held closer than a name's match."""
    flags = [word.split("=", 1)[0][2:] for word in extra if word.startswith("--")]
    names = {spelling[2:] for action in parser._actions for spelling in action.option_strings
             if spelling.startswith("--")}
    names = sorted({name.replace("_", "-") if name.replace("_", "-") in names else name
                    for name in names})  # --batch-size, not its alias --batch_size
    close = difflib.get_close_matches(flags[0], names, n=1, cutoff=0.75) if flags else []
    return f"; did you mean '--{close[0]}'?" if close else ""


def parse_run_options(argv: list[str],
                      parser: argparse.ArgumentParser | None = None
                      ) -> tuple[dict[str, Any], str | None]:
    """The run options given in ``argv`` (a bad flag exits 2 with one line), and --config."""
    if parser is None:
        parser = Parser(prog="bench.py", argument_default=argparse.SUPPRESS)
        add_run_options(parser)
    known, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}{file_hint(extra)}")
    args = vars(known)
    config_path = args.pop("config", None)
    return ({k: v for k, v in args.items() if not k.startswith(("ignored_", "refused_"))},
            config_path)
