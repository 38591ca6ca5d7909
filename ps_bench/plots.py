"""What every figure-drawing subcommand (report, compare, predict) draws with: matplotlib,
imported only when a figure is asked for."""

from __future__ import annotations

from pathlib import Path

from ps_bench.config import ConfigError
from ps_bench.places import check_output_file


def pyplot(command: str = "report"):
    """matplotlib's pyplot, drawing to files; a one-line error naming ``command`` where it is
    missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError(f"{command} --plot needs matplotlib: pip install -e '.[plot]'") from None
    return plt


def check_plot_file(path: str, command: str, flag: str = "--plot") -> None:
    """``check_output_file`` for ``--plot``, and a ConfigError, before any work, unless
    matplotlib is installed and writes the kind of figure ``path``'s extension names (without
    one it would add ``.png`` to the name)."""
    check_output_file(path, flag)
    pyplot(command)
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = sorted(FigureCanvasBase.get_supported_filetypes())
    if Path(path).suffix[1:].lower() not in kinds:
        raise ConfigError(f"{flag} {path!r}: name a kind of figure by its extension, one of "
                          f".{', .'.join(kinds)}")
