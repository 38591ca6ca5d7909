"""Documentation that cannot rot: every ``bench.py``/``ps-bench`` command line in README.md and
docs/ parses and validates as ``bench.py`` would check it before starting anything, every
``benchmarks/*.py`` command line names that script's own options (read from its source, not
imported), every relative link and image resolves (anchors too), and every ``--help`` names the
page to read next."""

from __future__ import annotations

import ast
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from ps_bench import cli
from ps_bench.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("bash", "sh", "shell")
FENCE = re.compile(r"^```(\w*)\s*$")
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def script_constant(script: str, name: str):
    """A literal a benchmark script assigns at its top level, read from its source."""
    tree = ast.parse((ROOT / "benchmarks" / script).read_text())
    [value] = [node.value for node in tree.body if isinstance(node, ast.Assign)
               and any(isinstance(target, ast.Name) and target.id == name for target in node.targets)]
    return ast.literal_eval(value)


# The files a reader writes, or a documented command before it writes, before running what the
# docs show (what the docs say they hold).
READER_FILES = {"hosts.txt": "node1 slots=4\nnode2 slots=4\n",
                # strategy_floors.py --keep results/ab
                "results/ab/models.json": json.dumps(script_constant("strategy_floors.py", "MODEL")),
                # a run's results file (python bench.py --out results/r.json)
                "results/r.json": (ROOT / "tests" / "fixtures" / "ps-2t1s-32d8e0b.json").read_text()}


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    argv: tuple[str, ...]
    program: str = "bench.py"

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.program} {' '.join(self.argv)}"


def shell_words(segment: str) -> list[str]:
    """One shell command's words as the shell splits them (none if it cannot: an open quote)."""
    try:
        return shlex.split(segment, comments=True)
    except ValueError:
        return []


def bench_argv(segment: str) -> list[str] | None:
    """The arguments after ``bench.py`` (or ``ps-bench``) in one shell command, or None."""
    words = shell_words(segment)
    if words[:1] == ["ps-bench"]:
        return words[1:]
    for at, word in enumerate(words):
        if word == "bench.py" and at > 0 and (words[0] in ("python", "python3", "torchrun", "sudo")):
            return words[at + 1:]
    return None


def script_argv(segment: str) -> list[str] | None:
    """``benchmarks/NAME.py`` and its arguments in one shell command run by python (or sudo), or
    None."""
    words = shell_words(segment)
    if words[:1] not in (["python"], ["python3"], ["sudo"]):
        return None
    for at, word in enumerate(words):
        if re.fullmatch(r"benchmarks/\w+\.py", word):
            return words[at:]
    return None


def commands_in(text: str, page: str, first_line: int, loops: dict[str, str],
                argv_of=bench_argv) -> list[Command]:
    """The bench.py command lines (``argv_of``: those it finds) of a piece of shell: continuations
    joined, each command of an ``&&``/``;``/``|`` chain on its own, each ``for VAR in A B`` loop's
    variable given its first value."""
    found = []
    joined, start = "", first_line
    for number, line in enumerate(text.splitlines(), start=first_line):
        if not joined:
            start = number
        joined += line.strip()
        if joined.endswith("\\"):
            joined = joined[:-1] + " "
            continue
        for loop in re.finditer(r"\bfor (\w+) in ([^;]+); do", joined):  # nested ones too
            loops[loop.group(1)] = loop.group(2).split()[0]
        for name, value in loops.items():
            joined = joined.replace(f"${name}", value)
        for segment in re.split(r"&&|;|\|", joined):
            argv = argv_of(segment)
            if argv is not None:
                found.append(Command(page, start, tuple(argv)))
        joined = ""
    return found


def documented_commands(argv_of=bench_argv) -> list[Command]:
    return [command for path in PAGES
            for command in page_commands(path, str(path.relative_to(ROOT)), argv_of)]


def page_commands(path: Path, page: str, argv_of=bench_argv) -> list[Command]:
    """The commands of one page: in its inline code, and in its shell blocks, each block read
    whole (a command may go on over lines, loops may nest)."""
    found = []
    block, lines, first = None, [], 0
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        fence = FENCE.match(line)
        if fence:
            if block in SHELL_BLOCKS:  # the whole block: a command may go on over lines
                found += commands_in("\n".join(lines), page, first, {}, argv_of)
            block = None if block is not None else fence.group(1)
            lines, first = [], number + 1
            continue
        if block is None:
            for span in INLINE.findall(line):
                found += commands_in(span, page, number, {}, argv_of)
        else:
            lines.append(line)
    return found


COMMANDS = documented_commands()
def script_commands(found: list[Command]) -> list[Command]:
    """``script_argv``'s finds as commands of their script (its path the program)."""
    return [Command(command.page, command.line, command.argv[1:], command.argv[0])
            for command in found]


SCRIPT_COMMANDS = script_commands(documented_commands(script_argv))


@pytest.fixture
def reader_folder(tmp_path, monkeypatch):
    """A folder like the checkout's root, with the files a reader writes themselves."""
    for entry in ROOT.iterdir():  # results/: the reader's own, as in a fresh clone
        if not entry.name.startswith(".") and entry.name != "results":
            (tmp_path / entry.name).symlink_to(entry)
    for name, text in READER_FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_the_docs_hold_the_commands_of_every_subcommand():
    used = {command.argv[0] for command in COMMANDS if command.argv and command.argv[0] in cli.SUBCOMMANDS}
    assert used == set(cli.SUBCOMMANDS)
    assert len(COMMANDS) >= 50


@pytest.mark.parametrize("command", COMMANDS, ids=str)
def test_each_documented_command_line_validates(command, reader_folder):
    try:
        cli.check(list(command.argv))
    except ConfigError as error:
        pytest.fail(f"{command}\n  is refused: {error}")
    except SystemExit as stop:  # argparse: 0 after --help, 2 for a flag it does not know
        assert stop.code == 0, f"{command}\n  does not parse (exit {stop.code})"


def test_a_renamed_option_is_caught(reader_folder):
    """What the check above is for: a command line that names an option that is not there fails."""
    with pytest.raises(SystemExit) as stop:
        cli.check(["--ntrainers", "4", "--nserver", "2"])
    assert stop.value.code == 2
    with pytest.raises(ConfigError, match="--nodes"):
        cli.check(["slurm", "--nodes", "0", "--", "--ntrainer", "2"])
    with pytest.raises(ConfigError):
        cli.check(["emulate", "--link", "fast", "--", "--ntrainer", "2"])


def test_the_extractor_reads_shell_as_a_reader_would():
    text = ("pip install -e . && python bench.py --rounds 2  # the job\n"
            "for hook in allreduce ps; do\n"
            "  python bench.py --hook $hook \\\n"
            "    --limits\n"
            "done\n"
            "sudo $(which python) bench.py emulate --link 1gbit -- --hook fp16\n"
            "torchrun --nproc-per-node 4 bench.py --ntrainer 2\n"
            "python benchmarks/floors.py\n")
    found = [command.argv for command in commands_in(text, "x.md", 1, {})]
    assert found == [("--rounds", "2"), ("--hook", "allreduce", "--limits"),
                     ("emulate", "--link", "1gbit", "--", "--hook", "fp16"), ("--ntrainer", "2")]


def test_a_page_is_read_whole_block_by_block(tmp_path):
    """A command that goes on over lines of a shell block, inside nested loops, is found whole,
    at the line it starts on; a block of another language is not read."""
    page = tmp_path / "page.md"
    page.write_text("Run `python bench.py --rounds 1` first.\n\n"
                    "```bash\n"
                    "for a in x y; do for b in p q; do\n"
                    "  python bench.py --hook $a \\\n"
                    "    --out $b.json\n"
                    "done; done\n"
                    "```\n\n"
                    "```text\n"
                    "python bench.py --not-read\n"
                    "```\n")
    assert page_commands(page, "page.md") == [Command("page.md", 1, ("--rounds", "1")),
                                              Command("page.md", 5, ("--hook", "x", "--out", "p.json"))]


def script_options(script: Path) -> dict[str, tuple[str, ...] | None]:
    """The options a benchmark script's argparse parser defines, read from its source: each flag
    and its ``choices`` where the source spells them out (None where any value goes, or where
    they are computed)."""
    options = {}
    for node in ast.walk(ast.parse(script.read_text())):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        choices = next((keyword.value for keyword in node.keywords if keyword.arg == "choices"), None)
        literal = isinstance(choices, (ast.Tuple, ast.List)) and all(
            isinstance(element, ast.Constant) for element in choices.elts)
        allowed = tuple(element.value for element in choices.elts) if literal else None
        for argument in node.args:
            if isinstance(argument, ast.Constant) and str(argument.value).startswith("-"):
                options[argument.value] = allowed
    return options


def refused_script_words(command: Command) -> list[str]:
    """The words of a documented benchmark command its script would refuse: a missing script, an
    option it does not define, a value outside an option's choices (up to a ``--``, after which
    some scripts pass the rest to bench.py)."""
    script = ROOT / command.program
    if not script.exists():
        return [command.program]
    options = {**script_options(script), "--help": None, "-h": None}
    argv = list(command.argv)
    argv = argv[:argv.index("--")] if "--" in argv else argv
    refused = []
    for at, word in enumerate(argv):
        if not word.startswith("-") or word == "-":
            continue
        flag, _, value = word.partition("=")
        if flag not in options:
            refused.append(word)
            continue
        value = value or (argv[at + 1] if at + 1 < len(argv) else "")
        if options[flag] is not None and value and not value.startswith("-") and value not in options[flag]:
            refused.append(f"{flag} {value}")
    return refused


def test_the_docs_hold_the_commands_of_the_benchmark_scripts():
    assert len(SCRIPT_COMMANDS) >= 20
    assert {command.program for command in SCRIPT_COMMANDS} >= {
        "benchmarks/published_check.py", "benchmarks/predict_check.py", "benchmarks/partition_check.py"}


@pytest.mark.parametrize("command", SCRIPT_COMMANDS, ids=str)
def test_each_documented_benchmark_command_names_its_scripts_options(command):
    refused = refused_script_words(command)
    assert not refused, f"{command}\n  its script has no {refused}"


def test_a_renamed_benchmark_option_is_caught():
    text = ("sudo $(which python) benchmarks/predict_check.py --cases hosts --runs 3\n"
            "python benchmarks/predict_check.py --case everything\n"
            "python benchmarks/no_such_check.py\n"
            "python benchmarks/startup.py --rounds 2 -- --ntrainer 2\n"
            "python benchmarks/predict_check.py --case=hosts --split 500mbit\n")
    commands = script_commands(commands_in(text, "x.md", 1, {}, script_argv))
    assert [refused_script_words(command) for command in commands] == [
        ["--cases"], ["--case everything"], ["benchmarks/no_such_check.py"], ["--rounds"], []]


def slug(heading: str) -> str:
    """A heading's anchor, as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, in_code = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and re.match(r"^#{1,6} ", line):
            found.add(slug(line.lstrip("#")))
    return found


def links() -> list[tuple[str, str]]:
    found = []
    for path in PAGES:
        in_code = False
        for line in path.read_text().splitlines():
            if FENCE.match(line):
                in_code = not in_code
            elif not in_code:
                found += [(str(path.relative_to(ROOT)), target) for target in LINK.findall(line)]
    return found


@pytest.mark.parametrize("page,target", links(), ids=lambda value: str(value))
def test_each_relative_link_and_image_resolves(page, target):
    if re.match(r"^[a-z]+:", target):
        return  # an absolute address: not checked offline
    file, _, anchor = target.partition("#")
    path = (ROOT / page).parent / file if file else ROOT / page
    assert path.exists(), f"{page}: {target}: {path.relative_to(ROOT)} does not exist"
    if anchor:
        assert anchor in anchors(path), f"{page}: {target}: no heading with anchor #{anchor} in {file or page}"


def test_every_docs_page_is_linked_from_the_readme_and_says_what_it_answers():
    readme = (ROOT / "README.md").read_text()
    for path in PAGES[1:]:
        assert f"](docs/{path.name}" in readme, f"README.md does not link docs/{path.name}"
        assert "What this page answers" in path.read_text().split("\n\n")[1], path.name


def test_the_readme_stays_a_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) < 250


@pytest.mark.parametrize("argv", [["--help"], *([name, "--help"] for name in cli.SUBCOMMANDS)], ids=" ".join)
def test_each_help_names_the_docs_page_to_read_next(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    assert stop.value.code == 0
    shown = capsys.readouterr().out
    pages = re.findall(r"read next: (docs/\w+\.md)", shown)
    assert pages and all((ROOT / page).exists() for page in pages), shown[-400:]
