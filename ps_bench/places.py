"""Whether the places a command line names can be used, said before any work: a file or folder
that can be written (made only when the work writes it), a bundled file found from the project
root, a network interface on this node, a port number; and writing the files a command was
asked for. A check, or a write that fails after all, raises ``ConfigError`` with one line
naming the option."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from ps_bench.config import PROJECT_ROOT, ConfigError


def resolve_path(path: str) -> Path:
    """A relative path is taken from the working directory, else from the project root."""
    candidate = Path(path)
    if candidate.is_absolute() or candidate.exists():
        return candidate
    bundled = PROJECT_ROOT / candidate
    return bundled if bundled.exists() else candidate


def check_interface(name: str) -> None:
    """Raises ConfigError unless this node has a network interface called ``name``."""
    names = sorted(interface for _, interface in socket.if_nameindex())
    if name not in names:
        raise ConfigError(f"--iface {name!r}: no such network interface on {socket.gethostname()}; "
                          f"it has {', '.join(names)}")


def check_writable_folder(path: str, option_name: str) -> None:
    """A ConfigError unless the folder exists and a file can be made in it, or it could be
    created; leaves nothing (a ``--dry-run`` leaves no trace; the folder is made where the files
    are written)."""
    existing = Path(path).absolute()
    while not existing.exists():  # the nearest part of the path that exists
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{option_name} {path!r} cannot be created: "
                          f"{str(existing)!r} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{option_name} {path!r} is not writable; choose another folder")
    try:  # os.access answers yes to root almost everywhere (/proc, /sys): a file says
        with tempfile.TemporaryFile(dir=existing):  # unnamed where it can be (O_TMPFILE)
            pass
    except OSError as error:
        raise ConfigError(f"{option_name} {path!r} is not writable ({error.strerror}); choose "
                          f"another folder") from None


def check_output_file(path: str, option_name: str) -> None:
    """A ConfigError unless a file can be written at ``path`` (not a folder; its folder writable,
    or one that could be made), said before any work; creates nothing. ``-`` is refused: a
    file of that name is what it would make (``/dev/stdout`` is standard output)."""
    if path == "-":
        raise ConfigError(f"{option_name} -: give a file name (a file named '-' is what this would "
                          f"write; /dev/stdout writes to standard output)")
    if Path(path).is_dir():
        raise ConfigError(f"{option_name} {path!r} is a folder; give a file name")
    check_writable_folder(str(Path(path).absolute().parent), f"{option_name}'s folder")


def check_apart(outputs: dict[str, str | None], inputs: set[Path] = frozenset()) -> None:
    """A ConfigError where two of a command's output flags (flag -> path) name one file (the one
    written last would replace the other), or one names a file it reads (``inputs``, resolved):
    it would be lost."""
    seen: dict[Path, str] = {}
    for flag, path in outputs.items():
        if path is None:
            continue
        file = Path(path).resolve()
        if file in inputs:
            raise ConfigError(f"{flag} {path!r} is a file this command reads: writing it would "
                              f"lose what it holds; give another file")
        if file in seen:
            raise ConfigError(f"{seen[file]} and {flag} both name {path!r}: the one written last "
                              f"would replace the other; give each its own file")
        seen[file] = flag


def check_results_file(path: str, option_name: str) -> None:
    """``check_output_file`` for a run's results, a new file that never replaces another (a name
    taken gets a number): not ``-`` (standard output carries the run's table) and not a device,
    pipe or socket, beside which a numbered file would go (``/dev/null-1``)."""
    if path == "-":
        raise ConfigError(f"{option_name} -: the results are a file (standard output carries the "
                          f"run's table); give a file name")
    if Path(path).exists() and not Path(path).is_file() and not Path(path).is_dir():
        raise ConfigError(f"{option_name} {path!r} is not a regular file: the results are "
                          f"written as a new file, never into another; give a file name")
    check_output_file(path, option_name)


def why_not_written(error: OSError) -> str:
    """What stopped a write, for a user: the system's words (``No space left on device``), but
    for mkdir's ``File exists``, which means a file stands where a folder of the path should."""
    if isinstance(error, FileExistsError) and error.filename:
        return f"{error.filename} is a file, not a folder"
    return error.strerror or str(error)


def write_output(path: str, flag: str, writer: Callable[[str], object]) -> None:
    """``writer(path)``, its folder made first: a file the command was asked for that cannot be
    written after all (checked before the work, but a disk or a quota fills, a folder goes) is
    one line naming the option, not a traceback."""
    try:
        Path(path).absolute().parent.mkdir(parents=True, exist_ok=True)
        writer(path)
    except OSError as error:
        raise ConfigError(f"{flag} {path}: {why_not_written(error)}") from None


def check_port(flag: str, port: int) -> None:
    """Raises ConfigError unless ``port`` is a TCP port number."""
    if not 1 <= port <= 65535:
        raise ConfigError(f"{flag} must be in 1..65535; got {port}")
