"""The printed report of a run: the one place that prints a run's results (the master calls
``print_report`` once, after the last round), its tables and lines."""

from __future__ import annotations


from tabulate import tabulate

from ps_bench.metrics.stats import TABLE_HEADERS, SummaryRow
from ps_bench.options import plural
from ps_bench.results.load import diverged

MIB = 1024 * 1024
IMBALANCE = 1.1  # the busiest server's bytes over the mean at which the line names them


def format_bytes(nbytes: float) -> str:
    """Binary units, as DDP's bucket_cap_mb counts them."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def render_table(rows: list[SummaryRow]) -> str:
    return tabulate([r.table_row() for r in rows], headers=TABLE_HEADERS, floatfmt=".3f")


def print_report(results: dict, rows: list[SummaryRow]) -> None:
    """The one place that prints a run's results."""
    for role, title in (("trainer", "Trainers"), ("server", "Parameter servers")):
        role_rows = [r for r in rows if r.role == role]
        if role_rows:
            print(f"\n{title} (timed rounds)")
            print(render_table(role_rows))
    throughput, moved, replicas = results["throughput"], results["bytes"], results["replicas"]
    rate, config = throughput["samples_per_s"], results["config"]
    steps = (f" (optimizer steps of {config['grad_accum']} micro-batches of "
             f"{config['batch_size']})" if config.get("grad_accum", 1) > 1 else "")
    untimed_s = throughput.get("untimed_s", 0.0)
    untimed = " or ".join(word for flag, word in (("verify", "--verify checked"),
                                                  ("profile", "--profile traced"))
                          if config.get(flag))
    left_out = (f", less the iterations {untimed} ({untimed_s:.2f} s)" if untimed_s > 0 and untimed
                else "")
    print(f"\nthroughput: {rate:.1f} samples/s ({1000.0 / rate if rate else 0.0:.3f} ms a "
          f"sample) over {plural(throughput['iterations'], 'iteration')}{steps} per trainer"
          f"{left_out}")
    if "tokens_per_s" in throughput:  # a model of sequences (metrics.flops)
        print(tokens_line(throughput))
    if "compile" in results:
        print(compile_line(results["compile"]))
    busiest = moved.get("server_recv_busiest_per_iter", 0.0)
    uneven = (f" (the busiest server {busiest:.0f})"
              if busiest > IMBALANCE * moved["server_recv_per_iter"] else "")
    servers = (f"; server recv {moved['server_recv_per_iter']:.0f}{uneven}, "
               f"sent {moved['server_sent_per_iter']:.0f}"
               if config.get("nserver", 0) + config.get("ncudaserver", 0) else "")
    print(f"bytes per iteration: trainer sent {moved['trainer_sent_per_iter']:.0f}, "
          f"recv {moved['trainer_recv_per_iter']:.0f}{servers}")
    if replicas["identical"] is None:
        print(f"replicas: do not apply (--staleness: the servers hold the one model) "
              f"param_norm={replicas['param_norm']:.6f}")
    else:
        why = (" (parameters not finite: the training diverged; a smaller --lr?)"
               if diverged(results) else "")
        print(
            f"replicas: identical={str(replicas['identical']).lower()} "
            f"param_norm={replicas['param_norm']:.6f} max_abs_diff={replicas['max_abs_diff']:.3g}"
            f"{why}"
        )
    held = held_line(results.get("timeline"))
    if held:
        print(held)
    per_trainer = throughput.get("per_trainer", [])
    if len({entry["iterations"] for entry in per_trainer}) > 1 or results.get("staleness"):
        print("per trainer: " + ", ".join(f"trainer {entry['index']} {entry['iterations']} "
                                          f"iterations {entry['samples_per_s']:.1f} samples/s"
                                          for entry in per_trainer))
    if results.get("staleness"):
        stale = results["staleness"]
        rates = ", ".join(f"{entry['updates_per_s']:.1f}" for entry in stale["servers"])
        print(f"staleness (bound {stale['bound']}): p50 {stale['p50']} p99 {stale['p99']} "
              f"max {stale['max']} over {stale['updates']} updates; updates/s per server: {rates}")
    if results.get("loss"):
        print(f"loss: first timed round {results['loss']['first']:.4f}, "
              f"last {results['loss']['last']:.4f}")
    if results.get("convergence"):
        print("\nConvergence (the averaged model; seconds: forward + backward + optimizer, "
              "every iteration)")
        print(render_convergence(results["convergence"]))
    if "verify" in results:
        check = results["verify"]
        if not any(row.role == "trainer" and row.metric == "batch" for row in rows):
            print("no batch times: --verify checked every iteration, and checked iterations are "
                  "left out of the timings (rounds of one iteration); give a round more")
        if check["buckets_checked"]:
            print(f"gradient error vs exact mean: p50 {check['grad_rel_error_p50']:.3g}, max "
                  f"{check['grad_rel_error_max']:.3g} over "
                  f"{plural(check['iterations'], 'iteration')} "
                  f"({plural(check['buckets_checked'], 'bucket')}, every trainer)")
        if "engine_sent_per_iter" in check:
            ours, theirs = results["bytes"]["trainer_sent_per_iter"], check["engine_sent_per_iter"]
            print(f"bytes per iteration against the engine's own comms logger: counted {ours:.0f}, "
                  f"logged {theirs:.0f} ({100 * (ours - theirs) / theirs:+.2f} %): "
                  + ", ".join(f"{name} {entry['calls_per_iter']:.2f} calls"
                              for name, entry in check["engine"].items()))
    if results.get("memory"):
        print("\nMemory (peak per process, largest of the role)")
        print(render_memory(results["memory"]))
    if results.get("limits"):
        print(render_limits(results["limits"], results.get("efficiency")))


def held_line(timeline: list[dict] | None) -> str | None:
    """How long the strategy's hooks held backward's thread an iteration (the timeline's
    ``held_ms`` summed over the buckets; CPU runs), and the bucket that held it longest."""
    if not timeline or any("held_ms" not in bucket for bucket in timeline):
        return None
    held = sum(bucket["held_ms"] for bucket in timeline)
    if round(held, 1) == 0:  # backward waited for nothing worth a line
        return None
    longest = max(timeline, key=lambda bucket: bucket["held_ms"])
    return (f"hooks held backward: {held:.1f} ms an "
            f"iteration (bucket {longest['index']} {longest['held_ms']:.1f} ms) before their "
            f"collectives or RPCs went off: backward waited, predict counts it as the "
            f"strategy's own compute")


def render_convergence(convergence: dict) -> str:
    held_out = convergence["held_out"][-1][2] if convergence["held_out"] else None
    row = [convergence["target_loss"], "yes" if convergence["reached"] else "no",
           convergence["iterations"], convergence["seconds"], convergence["final_loss"], held_out,
           convergence["stopped_by"]]
    headers = ["target loss", "reached", "iterations", "seconds",
               f"loss (last {convergence['smoothing']})", "held-out loss", "stopped by"]
    return tabulate([row], headers=headers, floatfmt=".4g", missingval="-")


def render_memory(memory: dict) -> str:
    """Each role's peaks, and the model states, activations and kept buffers its processes
    counted (the largest over them): MiB."""
    rows = []
    for role, peaks in memory.items():
        if peaks:
            states = peaks.get("model_states")
            rows.append([role, *[None if peaks.get(key) is None else peaks[key] / MIB
                                 for key in ("peak_rss_bytes", "peak_cuda_bytes")],
                         *[None if states is None else states[f"{kind}_bytes"] / MIB
                           for kind in ("parameters", "gradients", "optimizer")],
                         *[None if peaks.get(key) is None else peaks[key] / MIB
                           for key in ("activations_bytes", "buffers_bytes")]])
    return tabulate(rows, headers=["role", "peak RSS MiB", "peak CUDA MiB", "parameters MiB",
                                   "gradients MiB", "optimizer MiB", "activations MiB",
                                   "kept buffers MiB"],
                    floatfmt=".3f", missingval="-")


def render_limits(limits: dict, efficiency: dict | None) -> str:
    """The floors and the strategy's efficiency, printed after the tables."""
    rows = []
    if limits.get("rpc"):
        floor = limits["rpc"]
        on = " (CUDA tensors)" if floor.get("tensors") == "cuda" else ""
        rows.append([f"raw RPC round trip{on}", floor["p50_ms"], floor["p90_ms"],
                     floor["algbw_gbps"], None])
    collective = limits["collective"]
    rows.append([f"raw all-reduce ({collective['backend']})", collective["p50_ms"],
                 collective["p90_ms"], collective["algbw_gbps"], collective["busbw_gbps"]])
    own = limits.get("own")
    if own:
        rows.append([f"the strategy's own messages ({own['transport']}, {own['bytes_per_iter']} B)",
                     own["p50_ms"], own["p90_ms"], own["algbw_gbps"], own.get("busbw_gbps")])
    steps = limits.get("steps")
    for kind, step in (steps or {}).get("collectives", {}).items():
        every = f", once every {step['iterations']} iterations" if step["iterations"] > 1 else ""
        rows.append([f"its own {kind.replace('_', '-')}s{every}", step["p50_ms"], None, None, None])
    memcpy = limits["memcpy"]
    rows.append(["memcpy, one process", memcpy["p50_ms"], None, memcpy["gbps"], None])
    if limits.get("compute"):
        rows.append(["compute only (no DDP, no hook)", limits["compute"]["p50_ms"], None, None,
                     None])
    lines = [
        f"\nFloors (--limits: {limits['bytes_per_iter']} B per trainer per iteration in "
        f"{plural(limits['buckets'], 'bucket')}, {plural(collective['count'], 'sample')} taken "
        f"after each timed round, pooled over trainers)",
        tabulate(rows, headers=["floor", "p50 ms", "p90 ms", "algbw GB/s", "busbw GB/s"],
                 floatfmt=".3f", missingval="-"),
    ]
    link = limits.get("link")
    if link:
        sizes = ", ".join(f"{point['bytes']} B {point['p50_ms']:.3f} ms"
                          for point in link["points"])
        probe = (f"all-reduces among {link['peers']} trainers" if link["method"] == "allreduce"
                 else "RPC round trips")
        lines.append(f"link: latency {link['latency_us']:.1f} us, "
                     f"{link['bandwidth_gbit_s']:.3f} Gbit/s, fitted to {probe} of one message "
                     f"({sizes})")
    if efficiency and efficiency["value"] is None:  # nothing timed to hold the floor to
        shorter = ("" if efficiency.get("timed_iterations", 1) >= efficiency.get("period", 1)
                   else f" over {efficiency['timed_iterations']} timed iterations a trainer, fewer "
                        f"than the period, {efficiency['period']:g}: run more rounds")
        lines.append(f"efficiency: - ({efficiency['cost']} {efficiency['cost_ms'] or 0:.3f} ms"
                     f"{shorter or ': no communication in the timed rounds'})")
    elif efficiency:
        lines.append(f"efficiency: {efficiency['value']:.3f} ({efficiency['floor']} floor of "
                     f"{efficiency.get('floor_of', 'its float32 buckets')}, "
                     f"p50 {efficiency['floor_ms']:.3f} ms / "
                     f"{efficiency['cost']} {efficiency['cost_ms']:.3f} ms)")
        if efficiency.get("exposed_value") is not None:
            lines.append(f"exposed: {efficiency['exposed_value']:.3f} ({efficiency['floor']} "
                         f"floor p50 / {efficiency['exposed_ms']:.3f} ms = trainer batch p50 - "
                         f"compute-only p50)")
        for kind, entry in (efficiency.get("collectives") or {}).items():
            if entry["value"] is not None:
                lines.append(f"  {kind.replace('_', '-')}: {entry['value']:.3f} "
                             f"(floor {entry['floor_ms']:.3f} ms / open "
                             f"{entry['measured_ms']:.3f} ms an iteration)")
        if (efficiency.get("floor_of") in ("its own messages", "its own steps") and
                efficiency.get("gain_over_float32") is not None):
            lines.append(f"gain over sending float32: {efficiency['gain_over_float32']:.3f} "
                         f"({efficiency['floor']} floor of the float32 buckets, "
                         f"p50 {efficiency['float32_floor_ms']:.3f} ms / "
                         f"{efficiency['cost']}; above 1, compression paid)")
    else:
        lines.append("efficiency: - (this strategy moves nothing)")
    return "\n".join(lines)


def tokens_line(throughput: dict) -> str:
    """Tokens a second, and the model FLOPs and MFU where known."""
    line = (f"tokens: {throughput['tokens_per_s']:.1f}/s "
            f"({throughput['tokens_per_s_per_trainer']:.1f} a trainer)")
    if "model_flops_per_token" in throughput:
        line += (f"; model FLOPs {throughput['model_flops_per_token'] / 1e9:.3g} G a token, "
                 f"{throughput['model_tflops_per_s_per_trainer']:.3g} TFLOP/s a trainer")
    if "mfu" in throughput:
        line += (f"; MFU {throughput['mfu']:.1%} of {throughput['peak_tflops']:g} TFLOP/s "
                 f"({throughput['peak_from']})")
    return line


def compile_line(compiled: dict) -> str:
    """--compile: what compiling took, apart from the timed rounds, and a warning where some of
    it fell within them."""
    line = (f"compiled: {compiled['units']} units with {compiled['backend']}, "
            f"{compiled['warmup_s']:.1f} s in the warmup (apart from the timed rounds)")
    if compiled["timed_rounds_s"] > 0:
        line += (f"; {compiled['timed_rounds_s']:.1f} s within the timed rounds (a unit compiled "
                 f"again, or a warmup too short to reach every unit: give more --warmup-rounds)")
    return line
