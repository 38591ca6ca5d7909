"""Every family against the floor of what it really sends, on loopback and across shaped links.

Runs each strategy with ``--limits`` on a ``DummyModel`` of 2.36 M parameters (9.45 MB of dense
gradients: 1024 embeddings of 512, seven 512-wide layers), 2 trainers (4, 2 per host, for the
strategies that work within hosts) and 1 server for the parameter servers (2 for ps_node), RUNS
times each (torch seeds 1..RUNS), on loopback and with every rank behind a 1 Gbit/s link (``bench.py
emulate``, needs root), and prints per strategy and network the range of ``efficiency`` (its
floor over its cost; it should stay at or below 1.05: a floor is a floor), the floor and the cost
of run 1, and, for the compressing strategies, ``gain_over_float32`` (the float32 floor over the
same cost; above 1, compression paid). ``--set compressing`` (fp16, bf16, ps_fp16, powersgd),
``families`` (allreduce, ps, ps_node, fsdp, hsdp, zero1, local_sgd, diloco, hierarchical, the
DeepSpeed and torchft strategies) or ``all``.

    sudo $(which python) benchmarks/strategy_floors.py [--set families] [--runs 5] [--link 1gbit] [--no-emulate]
        [--keep DIR] [--only allreduce]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tabulate import tabulate

from ps_bench.results.load import load_file

ROOT = Path(__file__).resolve().parent.parent
SERVER = ("--nserver", "1")
HOSTS = ("--nserver", "0", "--ntrainer", "4", "--per-host", "2")
SERVED_HOSTS = ("--nserver", "2", "--ntrainer", "4", "--per-host", "2")  # ps_node: a server per half of a host's sum
NONE = ("--nserver", "0")
SETS = {
    "compressing": {"fp16": SERVER, "bf16": SERVER, "ps_fp16": SERVER, "powersgd": SERVER},
    "families": {"allreduce": SERVER, "ps": SERVER, "ps_node": SERVED_HOSTS, "fsdp": NONE, "hsdp": HOSTS,
                 "zero1": NONE, "local_sgd": NONE, "diloco": (*NONE, "--hook-option", "period=4"), "hierarchical": HOSTS, "deepspeed_zero2": NONE,
                 "deepspeed_zero3": NONE, "torchft_diloco": (*NONE, "--hook-option", "period=4")},
}
# RPC over TCP where it carries only the master's messages: TensorPipe's shared-memory transport
# polls, half a core per process (benchmarks/rpc_idle.py); docs/floors.md
SETS["families"] = {hook: options if hook in ("ps", "ps_node") else (*options, "--rpc-transport", "tcp")
                    for hook, options in SETS["families"].items()}
SIXTEEN_BIT = {"fp16", "bf16", "ps_fp16"}
MODEL = {"Floors9MB": {"model_class": "DummyModel", "configurations": {
    "num_embeddings": 1024, "embedding_dim": 512, "dense_input_size": 512, "dense_output_size": 512,
    "dense_layers_count": 7}}}


def run(folder: Path, link: str | None, hook: str, options: tuple[str, ...], seed: int) -> dict:
    out = folder / f"{hook}-{link or 'loopback'}-{seed}.json"
    if not out.exists():
        models = folder / "models.json"
        models.write_text(json.dumps(MODEL))
        command = [sys.executable, str(ROOT / "bench.py"), *(["emulate", "--link", link, "--"] if link else []),
                   "--model", "Floors9MB", "--model-config-path", str(models), "--data", "DummyData",
                   "--hook", hook, "--ntrainer", "2", *options, "--torch-seed", str(seed),
                   "--warmup-rounds", "1", "--rounds", "2", "--limits", "--out", str(out)]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"strategy_floors: {hook} on {link or 'loopback'} failed: "
                     f"{(done.stderr.strip().splitlines() or ['no output'])[-1]}")
    return load_file(out)["efficiency"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", choices=(*SETS, "all"), default="all", help="which strategies (default all)")
    parser.add_argument("--runs", type=int, default=5, help="runs per strategy and network (default 5)")
    parser.add_argument("--link", default="1gbit", help="the shaped link (default 1gbit)")
    parser.add_argument("--no-emulate", action="store_true", help="loopback only (no root needed)")
    parser.add_argument("--keep", metavar="DIR", help="keep the results files here (reused when run again)")
    parser.add_argument("--only", metavar="HOOK[,HOOK]", help="only these strategies of the set, e.g. allreduce")
    args = parser.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ps_bench-strategy-floors-"))
    folder.mkdir(parents=True, exist_ok=True)
    networks = [None] + ([] if args.no_emulate else [args.link])
    rows, held = [], True
    hooks = {hook: options for name, chosen in SETS.items() if args.set in (name, "all") for hook, options in chosen.items()}
    if args.only:
        unknown = set(args.only.split(",")) - set(hooks)
        if unknown:
            parser.error(f"--only: not in --set {args.set}: {', '.join(sorted(unknown))}")
        hooks = {hook: options for hook, options in hooks.items() if hook in args.only.split(",")}
    for link in networks:
        for hook, options in hooks.items():
            measured = [run(folder, link, hook, options, seed) for seed in range(1, args.runs + 1)]
            values = sorted(m["value"] for m in measured)
            gains = [m["gain_over_float32"] for m in measured if m["gain_over_float32"] is not None]
            held &= max(values) <= 1.05 and (link is None or hook not in SIXTEEN_BIT or min(gains) > 1)
            rows.append([hook, link or "loopback", f"{min(values):.3f} - {max(values):.3f}",
                         f"{values[len(values) // 2]:.3f}", measured[0]["floor_of"],
                         f"{measured[0]['floor_ms']:.2f}", f"{measured[0]['cost_ms']:.2f} ({measured[0]['cost']})",
                         f"{min(gains):.3f} - {max(gains):.3f}" if gains and hook in SETS["compressing"] else "-"])
            print(f"  {hook} on {link or 'loopback'}: {args.runs} runs", flush=True)
    print(tabulate(rows, headers=["strategy", "network", "efficiency", "median", "floor of", "floor ms (run 1)",
                                  "cost ms (run 1)", "gain over float32"], disable_numparse=True))
    print(f"\nefficiency <= 1.05 everywhere and gain > 1 for the 16-bit strategies on the link: "
          f"{'held' if held else 'missed'}; results in {folder}")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
