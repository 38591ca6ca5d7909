"""What every figure-drawing subcommand (report, compare, predict) draws with: matplotlib,
imported only when a figure is asked for."""

from __future__ import annotations

from ps_bench.config import ConfigError


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
