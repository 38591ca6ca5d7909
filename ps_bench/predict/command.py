"""``bench.py predict``: batch time of each strategy at trainer and server counts you cannot run,
calibrated on runs you did, and checked against every given run that matches a predicted point."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

from ps_bench.config import ConfigError
from ps_bench.options import HookKeyValue, KeyValue
from ps_bench.places import check_apart, check_output_file, write_output
from ps_bench.plots import check_plot_file
from ps_bench.predict import goodput, memory, pipelines
from ps_bench.predict.inputs import (LINK_KINDS, LOCAL_KINDS, NETWORK_KINDS, TargetLink, count_list,
                                     model_buckets, parse_phases, target_links)
from ps_bench.predict.calibration import (Calibration, add_engine_terms, add_payloads, borrowed,
                                          from_compute_ms, give_options, other_precision,
                                          runs_model)
from ps_bench.predict.predictor import calibrate
from ps_bench.predict.rows import (DEFAULT_HOOKS, choose_hooks, prediction_rows, strategies,
                                   strategy, unplaced)
from ps_bench.predict.runs import Run, accumulating, runs_of
from ps_bench.results.load import files_read
from ps_bench.runtime.network import parse_delay
from ps_bench.predict.tables import (describe_calibration, ethernet_note, plot, render,
                                     render_winners, winners)
from ps_bench.strategies import HOOKS, check_hook_options
from ps_bench.strategies.deepspeed_config import predicted_config

PREDICTION_SCHEMA = "ps_bench.prediction/1"
DESCRIPTION = (
    "Predict the batch time and throughput of each strategy at trainer and server counts you "
    "cannot run, from runs you did: compute phases, when each DDP bucket becomes ready, the link "
    "(fitted to the runs' --limits link probe, or the target network from --link/--latency) and "
    "each strategy's own compute (from its run). One model per transport (ring all-reduce, "
    "all-gather for sparse buckets, sharded or grouped parameter servers), with the overlap of "
    "transfers and backward computed bucket by bucket. Every given run that matches a predicted "
    "point is shown beside it, with the error. With a model built on the meta device "
    "(--compute-ms, or --gpu-memory), each row has the memory a GPU holds under the strategy, "
    "and --gpu-memory says whether it fits.")
EPILOG = """\
examples:
  python bench.py --ntrainer 2 --nserver 1 --hook ps --limits --out ps.json    # calibration runs
  python bench.py --ntrainer 2 --nserver 1 --hook allreduce --limits --out ar.json
  python bench.py predict ps.json ar.json --trainers 8,64,256,1024 --servers 1,8,auto
  python bench.py predict ps.json ar.json --trainers 8,1024 --link 100gbit --latency 5us \\
      --plot scale.png
  python bench.py predict ar.json --nodes 1,8,64 --per-node 8 --intra-link 900gbit \\
      --link 400gbit --hooks allreduce,hierarchical,ps \\
      --servers-on dedicated,colocated                                 # nodes of 8 GPUs
  python bench.py predict --model resnet50 --batch-size 256 \\
      --compute-ms forward=30,backward=60,optimizer=5 --link 100gbit --latency 5us \\
      --per-node 8 --intra-link 900gbit --nodes 1,16,128               # no run at all
  python benchmarks/predict_check.py    # predictions against emulated runs (needs root)

--servers auto picks, at each trainer count, the server count (1, 2, 4, ... up to the trainers;
co-located, 1, 2, 4, ... on each node, up to its trainers) with the shortest predicted batch. A
strategy with no run given takes the own compute of the one it costs like (ps_fp16 and ps_node
that of ps; a note names those that encode the gradients), else 0; PowerSGD's factors are
counted from the layers' shapes where no run of it is given.

Nodes of several GPUs (--per-node G, trainers = nodes x G): a node's G trainers share its local
link (--intra-link, or fitted from a run whose trainers all shared one emulated host) and one
network link (--link). Each strategy has its model: a flat ring ordered node by node,
hierarchical (within, across, within), hsdp, parameter servers on hosts of their own
(dedicated) or one on each node (colocated); every formula and its reference is in
ps_bench/metrics/costs.py, the bucket pipelines in ps_bench/predict/pipelines.py.
--compute RUN.json takes the compute phases and bucket timeline from a run on the device you
will train on (e.g. --backend nccl --ntrainer 1 --hook noop); --compute-ms needs no
run: DDP's buckets for --model, each ready when backward has done the FLOPs of the layers after
its parameters' (counted on the meta device over a batch of the model's own data).
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("results", nargs="*", metavar="RESULTS.json",
                        help="results files of finished runs of one model and batch size (with "
                        "--limits, unless --link is given), or sweep folders, their "
                        "results.jsonl or folders of results files (their finished runs); none "
                        "with --compute-ms")
    parser.add_argument("--compare", nargs="+", default=[], metavar="RESULTS.json",
                        help="more results files (or sweep folders), shown beside the predictions "
                        "they match but not used to calibrate (a check)")
    parser.add_argument("--trainers", metavar="N,...",
                        help=f"trainer counts to predict (default: {DEFAULT_TRAINERS} and "
                        "those of the runs given with --compare)")
    parser.add_argument("--servers", metavar="K,...|auto",
                        help="server counts for parameter-server strategies, auto for the best "
                        "(default: the server counts of the runs, --compare's too)")
    parser.add_argument("--hooks", metavar="NAME,...",
                        help="strategies to predict (default: the runs' strategies "
                        f"and {', '.join(DEFAULT_HOOKS)})")
    parser.add_argument("--mapping", choices=("shard", "group"), default="shard",
                        help="how trainers' buckets map to servers (default: shard)")
    parser.add_argument("--link", metavar="RATE", help="the target network's line rate, each way, "
                        "e.g. 25gbit, 100gbit; predict takes --link-kind's share of it (default: "
                        "the link fitted to the runs' --limits)")
    parser.add_argument("--link-kind", choices=NETWORK_KINDS,
                        help="what the network is, for its achievable share of the line rate and "
                        "its latency per message: " + kinds(NETWORK_KINDS) + " (default: ethernet)")
    parser.add_argument("--link-efficiency", type=float, metavar="F", help="the share of --link's "
                        "line rate a transfer achieves, instead of --link-kind's")
    parser.add_argument("--latency", metavar="TIME", help="the target link's latency per message, "
                        "e.g. 5us (default: --link-kind's, or the fitted one)")
    parser.add_argument("--per-node", type=int, default=1, metavar="G",
                        help="trainers (GPUs) per node, sharing its local link and one network "
                        "link (default: 1)")
    parser.add_argument("--nodes", metavar="N,...", help="node counts to predict: trainers = nodes "
                        "x --per-node (instead of --trainers)")
    parser.add_argument("--intra-link", metavar="RATE", help="a node's local link between its "
                        "trainers, its line rate each way, e.g. 1200gbit for a V100's NVLink, "
                        "126gbit for PCIe 3.0 x16 (default: fitted from a run whose trainers "
                        "shared one host)")
    parser.add_argument("--intra-link-kind", choices=LOCAL_KINDS,
                        help="what a node's local link is: " + kinds(LOCAL_KINDS) +
                        " (default: pcie)")
    parser.add_argument("--intra-link-efficiency", type=float, metavar="F", help="the share of "
                        "--intra-link's line rate a transfer achieves, instead of its kind's")
    parser.add_argument("--servers-on", default="dedicated", metavar="WHERE,...",
                        help="parameter servers on hosts of their own (dedicated), one on each "
                        "node (colocated), or both: dedicated,colocated (default: dedicated)")
    parser.add_argument("--compute", metavar="RUN.json", help="the compute phases and bucket "
                        "timeline from this run of the same model and batch size (on the device "
                        "you will train on)")
    parser.add_argument("--compute-ms", metavar="forward=F,backward=B,optimizer=O",
                        help="the compute phases, ms, with no run at all (needs --model, "
                        "--batch-size and --link)")
    parser.add_argument("--model", metavar="NAME", help="with --compute-ms: the model whose DDP "
                        "buckets to build, on the meta device (a zoo model, or hf:CONFIG for a "
                        "Hugging Face architecture)")
    parser.add_argument("--model-option", "--model_option", dest="model_options", action=KeyValue,
                        default={}, metavar="KEY=VALUE",
                        help="with --model: an option of the model, as a run takes it")
    parser.add_argument("--batch-size", type=int, metavar="B", help="with --compute-ms: the batch "
                        "per trainer")
    parser.add_argument("--grad-accum", type=int, default=1, metavar="N",
                        help="micro-batches of the batch size an optimizer step, as a run's "
                        "--grad-accum: each computed, the gradients synchronised as each strategy "
                        "does (DDP's hooks once, on the last; ZeRO-2 and 3 every micro-batch); "
                        "calibrate from runs of one (default: 1)")
    parser.add_argument("--ds-config", metavar="FILE",
                        help="your ds_config.json: the deepspeed_zero hook of its stage (each, "
                        "where it names none) predicted at its ZeRO settings, precision and "
                        "communication_data_type (\"auto\": as a run takes them); a run's "
                        "recorded config wins for its strategy")
    parser.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="what the strategies whose engine has one (fsdp, hsdp, DeepSpeed) "
                        "communicate in, as a run's --reduce-dtype; fsdp and hsdp gather in it "
                        "too (default: their runs', else float32 for fsdp and hsdp and "
                        "--precision's for DeepSpeed, which gathers in --precision's whatever "
                        "this says)")
    parser.add_argument("--hook-option", "--hook_option", dest="hook_options",
                        action=HookKeyValue, default={}, metavar="HOOK:KEY=VALUE",
                        help="predict HOOK at this option (several: KEY=VALUE,KEY=VALUE, or the "
                        "flag again), as a run's --hook-option; its runs at other options then "
                        "give its own compute (each modelled at its own options), not its payload "
                        "nor its measured column (default: the options its runs had, else its "
                        "defaults)")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, metavar="X",
                        help="with --compute-ms: DDP's bucket cap, the first bucket's "
                        "too, as a trainer gives it to DDP (default: 25)")
    memory.add_arguments(parser)
    goodput.add_arguments(parser)
    parser.add_argument("--out", metavar="FILE.json", help="write the calibration and every "
                        "prediction as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="draw batch time against trainers, one "
                        "line per strategy (needs matplotlib)")


PLACES = ("dedicated", "colocated")
DEFAULT_TRAINERS = "8,64,256,1024"


def kinds(names: tuple[str, ...]) -> str:
    """Each kind of link with its defaults, for --help."""
    return "; ".join(f"{name} {LINK_KINDS[name].efficiency:g} of the line, "
                     f"{LINK_KINDS[name].latency_us:g} us" for name in names)


@dataclass
class Target:
    """What to predict for, from the command line alone."""

    trainers: list[int]
    link: TargetLink | None
    latency_s: float | None
    per_node: int
    intra: TargetLink | None
    servers_on: list[str]
    compute_ms: dict[str, float] | None
    options: dict[str, dict]  # --hook-option: strategy -> the options to predict it at
    # --ds-config: (the config, the stage it names, the precision it trains in), or None
    ds_config: tuple[dict, int | None, str | None] | None = None


def check(args: argparse.Namespace, bench_argv: list[str]) -> Target:
    """The scale, links, servers and compute asked for, before any results file is read."""
    if args.grad_accum < 1:
        raise ConfigError(f"--grad-accum must be at least 1 (micro-batches a step); got "
                          f"{args.grad_accum}")
    if args.per_node < 1:
        raise ConfigError(f"--per-node must be at least 1 (trainers per node); got {args.per_node}")
    if args.hooks is not None:
        strategies(args.hooks)
    if args.nodes is not None and args.trainers is not None:
        raise ConfigError("give --trainers or --nodes (trainers = nodes x --per-node), not both")
    if args.nodes is not None:
        trainers = sorted({nodes * args.per_node for nodes in count_list(args.nodes, "nodes")})
    else:
        given = DEFAULT_TRAINERS if args.trainers is None else args.trainers
        trainers = sorted(set(count_list(given, "trainers")))
        uneven = [n for n in trainers if n % args.per_node]
        if uneven:
            raise ConfigError(f"--per-node {args.per_node} does not divide --trainers {uneven[0]} "
                              f"into whole nodes; give --nodes N,... instead")
    link, intra = target_links(args)
    latency_s = parse_delay(args.latency, "--latency") if args.latency is not None else None
    if not 0 < args.bucket_cap_mb < math.inf:
        raise ConfigError(f"--bucket-cap-mb must be positive; got {args.bucket_cap_mb}")
    check_apart({"--out": args.out, "--plot": args.plot},
                files_read([*args.results, *args.compare,
                            *filter(None, [args.compute, args.ds_config])]))
    if args.out is not None:
        check_output_file(args.out, "--out")
    if args.plot is not None:
        check_plot_file(args.plot, "predict")
    if args.servers is not None:
        count_list(args.servers, "servers", allow_auto=True)
    places = [place.strip() for place in args.servers_on.split(",")]
    unknown = [place for place in places if place not in PLACES]
    if unknown:
        raise ConfigError(f"--servers-on: {unknown[0]!r} is not one of {', '.join(PLACES)}")
    compute_ms = None
    if args.compute_ms is not None:
        compute_ms = parse_phases(args.compute_ms)
        missing = [name for name, value in (("--model", args.model),
                                            ("--batch-size", args.batch_size),
                                            ("--link", args.link)) if value is None]
        if missing:
            raise ConfigError(f"--compute-ms predicts with no run: give {', '.join(missing)} too")
        if args.batch_size < 1:
            raise ConfigError(f"--batch-size must be at least 1; got {args.batch_size}")
        if args.compute is not None:
            raise ConfigError("give --compute RUN.json or --compute-ms, not both")
    elif not args.results:
        raise ConfigError("predict needs results files to calibrate on, or --compute-ms with "
                          "--model, --batch-size and --link")
    goodput.check_arguments(args)
    ds_config = args.ds_config and predicted_config(args.ds_config, args.precision)
    return Target(trainers, link, latency_s, args.per_node, intra,
                  list(dict.fromkeys(places)), compute_ms, checked_options(args.hook_options),
                  ds_config)


def checked_options(given: dict[str, dict]) -> dict[str, dict]:
    """``--hook-option``, each strategy by its registered name and its options checked as a
    run checks them."""
    checked = {}
    for name, options in given.items():
        hook = strategy(name, "--hook-option")
        try:
            checked[hook] = {**checked.get(hook, {}), **check_hook_options(hook, options)}
        except ValueError as error:
            raise ConfigError(f"--hook-option {name}: {error}") from None
    return checked


def no_run_calibration(args: argparse.Namespace,
                       target: Target) -> tuple[Calibration, memory.ModelFacts]:
    """``--compute-ms``: the phases given, DDP's buckets for the model built on the meta device,
    each ready when backward has done the FLOPs of the layers after its parameters'; and what
    the memory needs of the model."""
    mode = args.activation_checkpointing or "none"
    buckets, shares, shares_from, facts = model_buckets(
        args.model, args.bucket_cap_mb, args.model_options, args.batch_size,
        args.sequence_length, args.precision or "fp32", checkpointing=mode)
    given = target.compute_ms
    again = given["forward"] * facts.recomputed  # the recomputed units' forward, inside backward
    phases = pipelines.Phases(**{**given, "backward": given["backward"] + again})
    calibration = from_compute_ms(args.model, args.batch_size, phases, buckets,
                                  target.link.link(), target.link.describe(), shares, shares_from)
    if mode != "none":
        calibration.notes.append(
            f"activation checkpointing {mode}: backward recomputes "
            f"{facts.recomputed:.0%} of the forward's FLOPs, {again:.1f} ms a micro-batch added "
            f"to --compute-ms's backward ({phases.backward:.1f} ms)")
    give_options(calibration, target.options)
    if target.intra is not None:
        calibration.intra_link = target.intra.link()
        calibration.intra_from = target.intra.describe()
    add_payloads(calibration, facts.bucket_shapes)
    return calibration, facts


def main(args: argparse.Namespace, bench_argv: list[str]) -> int:
    target = check(args, bench_argv)
    if target.ds_config:  # the precision it trains in: --precision's, or its own
        args.precision = target.ds_config[2]
    trainers = target.trainers
    link_bps = target.link.line_bps if target.link is not None else None
    gpu_memory = memory.check_arguments(args)
    runs = runs_of(args.results)
    facts = None
    if target.compute_ms is not None:
        calibration, facts = no_run_calibration(args, target)
    else:
        if args.sequence_length is not None:
            raise ConfigError("--sequence-length goes with --compute-ms: a run's data is its own")
        if gpu_memory is not None:
            facts = runs_model(runs[0], args)
        compute = Run.load(args.compute) if args.compute is not None else None
        accumulating(runs + ([compute] if compute else []), 1, "calibrate from runs of one "
                     "micro-batch a step, and give predict --grad-accum")
        calibration = calibrate(runs, target.link, target.latency_s, target.intra, compute,
                                target.options)
    calibration.micro_batches, calibration.reduce_dtype = args.grad_accum, args.reduce_dtype
    if target.ds_config:
        calibration.ds_config, calibration.ds_stage, _ = target.ds_config
        calibration.ds_config_from = f"--ds-config {args.ds_config}"
    calibration.precision = args.precision or next(
        (run.precision for run in runs), None) or "fp32"
    if target.per_node > 1 and calibration.intra_link is None:
        raise ConfigError(f"--per-node {target.per_node}: no local link between a node's trainers: "
                          f"give --intra-link RATE, or a run made with --limits whose trainers all "
                          f"shared one emulated host")
    if target.intra is not None and target.per_node == 1 and not any(r.per_host > 1 for r in runs):
        calibration.notes.append("--intra-link is the link between a node's trainers: with one "
                                 "trainer a node (--per-node 1, the default) and no run of several "
                                 "trainers a host, nothing crosses it; give --per-node G")
    compared = accumulating(runs_of(args.compare), args.grad_accum,
                            f"give --compare runs of the --grad-accum predicted, {args.grad_accum}")
    hooks = choose_hooks(args.hooks, runs + compared, calibration, target.per_node)
    engines = [hook for hook in hooks if (cost := HOOKS.record(hook).cost).regathered
               or cost.bucket_elements or cost.overlaps]
    if engines:
        facts = facts or runs_model(runs[0], args)
        add_engine_terms(calibration, engines, facts)
    calibration.notes += borrowed(calibration, hooks) + other_precision(calibration)
    servers = (count_list(args.servers, "servers", allow_auto=True) if args.servers is not None
               else sorted({run.servers for run in runs + compared if run.servers} or {1}))
    if args.trainers is None and args.nodes is None:  # by default, beside the runs to compare
        trainers = sorted({*trainers, *(run.trainers for run in compared
                                        if run.trainers % target.per_node == 0)})
    rows = prediction_rows(calibration, hooks, trainers, servers, args.mapping, link_bps, compared,
                           target.per_node, target.servers_on)
    held = None
    if facts is not None:
        held = memory.target(args, facts, [run.training or {} for run in runs], gpu_memory,
                             calibration.options, calibration.gathered)
        for row in rows:
            row.update(held.row(row["strategy"], row["trainers"], row["per_node"]))
        if gpu_memory is not None and facts.checkpointing != "none" and runs == []:
            keeping = memory.target(args, model_buckets(  # every activation kept, as without it
                args.model, args.bucket_cap_mb, args.model_options, args.batch_size,
                args.sequence_length, args.precision or "fp32")[3], [], gpu_memory,
                calibration.options, calibration.gathered)
            for row in rows:
                row["fits_only_recomputing"] = row["fits"] and not keeping.row(
                    row["strategy"], row["trainers"], row["per_node"])["fits"]
    for row in rows if args.peak_tflops and facts and facts.model_flops else []:
        row["mfu"] = (facts.model_flops * (args.batch_size or runs[0].batch_size)
                      * calibration.micro_batches / (row["batch_ms"] / 1e3)
                      / (args.peak_tflops * 1e12))
    failures = goodput.target(args, runs, args.optimizer)
    for row in rows if failures is not None else []:
        row.update(failures.row(row, calibration.gradient_bytes, calibration.link.bytes_per_ms))
    described = (describe_calibration(calibration, hooks) + (held.describe() if held else "")
                 + (failures.describe() if failures else ""))
    note = (unplaced(servers, trainers, target.per_node)
            if args.servers is not None and "colocated" in target.servers_on else None)
    print(described.rstrip("\n") + f"\n  {note}\n" if note else described)
    print(render(rows))
    synchronising = [hook for hook in hooks if HOOKS.record(hook).transport is not None]
    print(render_winners(winners(rows), "no strategy fits --gpu-memory" if synchronising else
                         f"{', '.join(hooks)} synchronises nothing (never a winner)"))
    if failures is not None:
        print(goodput.render_goodput_winners(rows))
    caveat = ethernet_note(target.link.kind if target.link is not None else None, rows)
    if caveat:
        print(caveat)
    if args.out:
        text = json.dumps({"schema": PREDICTION_SCHEMA, "calibration": calibration.to_dict(),
                           "predictions": rows, "winners": winners(rows),
                           **({"goodput_winners": goodput.goodput_winners(rows)}
                              if failures else {})}, indent=2) + "\n"
        write_output(args.out, "--out", lambda path: Path(path).write_text(text))
        print(f"predictions: {args.out}")
    if args.plot:
        write_output(args.plot, "--plot", lambda path: plot(path, rows, calibration))
        print(f"plot: {args.plot}")
    return 0
