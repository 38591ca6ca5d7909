"""``bench.py predict``: batch time at scale from a short measured run. ``pipelines``: the bucket
pipelines on the formulas of ``ps_bench.metrics.costs``; ``predictor``: the calibration from
results files and a strategy's prediction; ``inputs``: its command line's parsing and the
meta-device buckets; ``rows``: each point's prediction beside its measured runs; ``command``:
the subcommand."""
