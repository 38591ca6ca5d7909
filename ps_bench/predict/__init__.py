"""``bench.py predict``: batch time at scale from a short measured run. ``models``: the
transports' arithmetic and the bucket pipeline; ``predictor``: the calibration from results
files and a strategy's prediction; ``command``: the subcommand."""
