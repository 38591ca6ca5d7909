"""A prediction calibrated on measured runs: compute phases, the bucket timeline and the link
from results files, each strategy's own compute from its own run, then ``pipelines`` at any n, k.

Calibration (``calibrate``), from one or more results files of the same model and batch:

- forward and optimizer p50 (trainer summary), backward's own compute (the ``--limits``
  compute-only iteration minus forward and optimizer, at least the last bucket's ready time),
  of the runs whose strategies communicate in backward's hooks alone (``runs.compute_runs``);
- when each DDP bucket became ready (``timeline``, p50 over the runs), less what the hooks of the
  buckets before it held backward for (``held_ms``: their strategy's own compute, below):
  overlap is computed from it; without one (a GPU run) every bucket is taken as ready when
  backward's compute ends;
- the link: α and B fitted to the ``--limits`` link probe (median over the runs), unless the
  target network is given (``--link``, ``--latency``); the probe of a run whose trainers all
  shared one emulated host measured that host's local link instead (``--intra-link`` gives it);
- the server's aggregation throughput: the ``--limits`` memory-copy bandwidth;
- each strategy's own compute (casts, encodings, reductions, serialisation, PowerSGD's matrix
  products: whatever of its cost the transfers do not account for, what its hooks held
  backward for among it): its run's measured batch p50 minus the model's with that run's own
  compute phases and timeline, on the network the run had (the fitted link), a constant at
  every n, k and target network, at the speed of the device ``compute`` measured where one is
  given (``device_speed``: it runs beside the model's compute); for a strategy with no run
  given, that of the strategy it costs like (the one it compresses; ps_node, ps), else 0
  (``own_ms`` lists the measured ones).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from ps_bench.config import ConfigError
from ps_bench.metrics import costs
from ps_bench.metrics.costs import Link
from ps_bench.options import plural
from ps_bench.predict import pipelines
from ps_bench.predict.buckets import communication_end, float32_share
from ps_bench.predict.calibration import (Calibration, add_payloads, backward_compute,
                                          bucket_sizes, compute_ready, give_options, own_terms,
                                          ready_buckets, run_options)
from ps_bench.predict.inputs import TargetLink, spread
from ps_bench.predict.pipelines import Phases
from ps_bench.predict.runs import Run, compute_runs
from ps_bench.strategies import HOOKS, LOW_RANK_BUCKETS, Strategy, hook_options
from ps_bench.strategies.record import calls_per_iteration


def calibrate(runs: list[Run], target: TargetLink | None = None, latency_s: float | None = None,
              intra: TargetLink | None = None, compute: Run | None = None,
              options: dict[str, dict] | None = None) -> Calibration:
    """The calibration of ``runs`` (see the module's docstring); ``target`` describes the network
    to predict for instead of the runs' own (``latency_s`` alone, the fitted link's latency),
    ``intra`` a node's local link; ``compute`` (a run of the same model and batch, on the device
    to predict for) gives the compute phases and bucket timeline instead of ``runs``;
    ``options`` (``--hook-option``) the hook options to predict strategies at (``give_options``)."""
    first = runs[0]
    for run in runs[1:]:
        if (run.model, run.batch_size) != (first.model, first.batch_size):
            raise ConfigError(f"{run.path} is of model {run.model} at batch {run.batch_size}, "
                              f"{first.path} of {first.model} at batch {first.batch_size}: predict "
                              f"one workload at a time")
    if compute is not None and ((compute.model, compute.batch_size) !=
                                (first.model, first.batch_size)):
        raise ConfigError(f"--compute {compute.path} is of model {compute.model} at batch "
                          f"{compute.batch_size}, the runs of {first.model} at batch "
                          f"{first.batch_size}: give a run of the same model and batch size")
    if compute is not None and not (compute.computes_alone or compute.communicates_nothing):
        raise ConfigError(f"--compute {compute.path} is a run of {compute.hook}, whose forward or "
                          f"step holds its own communication: its phases are not the model's "
                          f"compute; give a run of allreduce or noop, or of one trainer")
    fitted = [run.link for run in runs if run.link and not run.on_one_host]
    fitted_intra = [run.link for run in runs if run.link and run.on_one_host]
    if target is None and not fitted:
        raise ConfigError("no link to predict with: give runs made with --limits (their link is "
                          "fitted) or the target network with --link RATE")
    measured_link = (Link.of(statistics.median(f["latency_us"] for f in fitted),
                             statistics.median(f["bandwidth_gbit_s"] for f in fitted))
                     if fitted else None)
    if target is not None:
        link, link_from = target.link(), target.describe()
    else:
        link = measured_link
        if latency_s is not None:
            link = Link(latency_s * 1000.0, link.bytes_per_ms)
        link_from = f"fitted to the --limits link probe of {plural(len(fitted), 'run')}"
    intra_link, intra_from = None, ("none: give --intra-link RATE, or a run whose trainers "
                                    "shared one host")
    if intra is not None:
        intra_link, intra_from = intra.link(), intra.describe()
    elif fitted_intra:
        intra_link = Link.of(statistics.median(f["latency_us"] for f in fitted_intra),
                             statistics.median(f["bandwidth_gbit_s"] for f in fitted_intra))
        intra_from = (f"fitted to the --limits link probe of {plural(len(fitted_intra), 'run')} "
                      f"on one host")
    timed = [compute] if compute is not None else compute_runs(runs)
    forward = statistics.median(run.forward_ms for run in timed)
    optimizer = statistics.median(run.optimizer_ms for run in timed)
    timelines = [run.timeline for run in timed if run.timeline]
    sized = next((run for run in [*timed, *runs] if run.buckets), None)
    if sized is None:
        raise ConfigError(f"no gradient buckets to predict with: the runs given "
                          f"({', '.join(sorted({run.hook for run in timed}))}) built no DDP "
                          f"buckets (strategies that wrap the model in an engine of their own): "
                          f"give a run of allreduce beside them")
    dense = bucket_sizes(sized.buckets)
    computes = [run.compute_ms for run in timed if run.compute_ms is not None]
    if compute is not None and not timelines and not computes and compute.communicates_nothing:
        backward = compute.backward_ms  # nothing to wait for: backward's own compute
        buckets = spread(backward, [dense[index] for index in sorted(dense)])
        overlap_from = (f"--compute {compute.path}: no bucket timeline (a GPU run), bucket-ready "
                        "times spread over backward in proportion to their bytes")
    elif timelines:
        ready: dict[int, list[float]] = {}
        for timeline in timelines:
            for index, made in compute_ready(timeline).items():
                ready.setdefault(index, []).append(made)
        buckets = ready_buckets({index: statistics.median(times) for index, times in ready.items()},
                                dense)
        backward = backward_compute(buckets, statistics.median(computes) if computes else None,
                                    forward, optimizer)
        overlap_from = ("the phases and bucket timeline of --compute " + compute.path
                        if compute is not None else
                        f"the bucket timeline of {plural(len(timelines), 'run')}")
    elif computes:
        backward = backward_compute([], statistics.median(computes), forward, optimizer)
        buckets = [(backward, *dense[index]) for index in sorted(dense)]
        overlap_from = ("none: no run has a bucket timeline (GPU runs), every bucket ready when "
                        "backward's compute ends")
    else:
        kinds = ", ".join(sorted({run.hook for run in timed}))
        raise ConfigError(f"no backward compute to predict with: the runs given ({kinds}) have no "
                          f"bucket timeline (a GPU run, or a strategy without DDP's buckets) and "
                          f"no compute-only time: give a run of allreduce on the CPU beside them, "
                          f"or runs made with --limits")
    memcpy = [run.memcpy_gbps for run in runs if run.memcpy_gbps]
    calibration = Calibration(first.model, first.batch_size, Phases(forward, backward, optimizer),
                              buckets, link, link_from,
                              statistics.median(memcpy) * 1e9 / 1000.0 if memcpy else None,
                              overlap_from, runs, intra_link=intra_link, intra_from=intra_from,
                              gloo=all(run.backend == "gloo" for run in runs))
    calibration.options, notes = run_options(runs)
    calibration.notes.extend(notes)
    apart = sorted({run.hook for run in runs if run not in timed})
    if apart and compute is None:
        calibration.notes.append(
            f"the model's compute is that of the runs of "
            f"{', '.join(sorted({run.hook for run in timed}))}: the forward or step of "
            f"{', '.join(apart)} {'holds its' if len(apart) == 1 else 'hold their'} own "
            f"communication")
    give_options(calibration, options or {})
    # payloads first: a low-rank strategy's own compute is fitted with its payload known (from
    # its runs at the options it is predicted at)
    for run in at_options(runs, calibration):
        payload = measured_payload(run, calibration)
        if payload is not None:
            calibration.payload_ratio.setdefault(run.hook, payload)
            calibration.payload_from[run.hook] = "measured by its run"
    # the others from the layers in the runs' buckets (a results file older than their shapes:
    # none, and a low-rank strategy needs its run)
    if all("shapes" in bucket for bucket in sized.buckets):
        add_payloads(calibration, [bucket["shapes"] for bucket in sized.buckets
                                   if not bucket["sparse"]])
    # each strategy's own compute: its run against the model with the run's own compute phases and
    # timeline, on the network the run had (the fitted link; the target one for a run on an
    # emulated link of the target's rate)
    own: dict[str, list[float]] = {}
    fitting = at_options(runs, calibration)
    # --hook-option: a strategy none of whose runs had the options given takes its own compute
    # from its runs at theirs, each modelled at its own (an encoding costs about the same at
    # another ratio)
    calibrated = {run.hook for run in fitting}
    fitting += [run for run in runs if run.hook in (options or {}) and run.hook not in calibrated]
    for run in fitting:
        if measured_link is not None:
            network = measured_link
        elif run.link_rate_bps is not None and target and run.link_rate_bps == target.line_bps:
            network = link
        else:
            continue
        if run.per_host > 1 and calibration.intra_link is None:
            continue
        terms = own_terms(run, calibration)
        as_it_ran = replace(as_run_had(calibration, run), link=network, **terms)
        modelled = predict(as_it_ran, run.hook, run.trainers, run.servers, run.mapping, own=False,
                           per_node=run.per_host, servers_on=run.servers_on)
        speed = device_speed(calibration, terms["phases"]) if compute is not None else 1.0
        if modelled is not None:
            own.setdefault(run.hook, []).append((run.batch_ms - modelled["batch_ms"]) * speed)
    for hook, values in own.items():
        fitted = statistics.median(values)
        if fitted < 0:  # its run was faster than its own compute and link allow
            calibration.notes.append(
                f"{hook}'s run took {-fitted:.1f} ms less than the model gives it with the run's "
                "own compute and link: its compute-only iteration or link probe (--limits) ran "
                "slower than its rounds (a machine whose speed changed during the run?); its own "
                "compute is taken as 0 (a run on a quiet machine fits it)")
        calibration.own_ms[hook] = max(0.0, fitted)
    return calibration


def at_its_options(run: Run, calibration: Calibration) -> bool:
    """Whether ``run`` was made at the hook options its strategy is predicted at."""
    return hook_options(run.hook, run.hook_options) == calibration.options_of(run.hook)


def at_options(runs: list[Run], calibration: Calibration) -> list[Run]:
    """The runs made at the hook options their strategy is predicted at (``run_options``): those
    its payload, its own compute and its measured column come from."""
    return [run for run in runs if at_its_options(run, calibration)]


def measured_payload(run: Run, calibration: Calibration) -> float | None:
    """A low-rank strategy's payload over the float32 gradient's bytes, as its run of more than
    one trainer measured it (its ring all-reduces' bytes); None for any other run."""
    if HOOKS.record(run.hook).cost.pipeline != LOW_RANK_BUCKETS or run.trainers < 2:
        return None
    ring = 2 * (run.trainers - 1) / run.trainers
    return run.trainer_sent_per_iter / ring / calibration.gradient_bytes


def device_speed(calibration: Calibration, ran: Phases) -> float:
    """How much longer the device ``--compute`` measured takes than a run's did: the ratio of
    their forward passes (``ran``, the run's own phases; forward, which no DDP hook's
    communication overlaps). A strategy's own compute runs on the trainer's device beside the
    model's, and scales with it."""
    return calibration.phases.forward / ran.forward


def as_run_had(calibration: Calibration, run: Run) -> Calibration:
    """The calibration at the hook options ``run`` had where its strategy is predicted at others
    (``--hook-option``), a low-rank strategy's payload as the run measured it."""
    if at_its_options(run, calibration):
        return calibration
    fields: dict = {"options": {**calibration.options, run.hook: run.hook_options or {}}}
    payload = measured_payload(run, calibration)
    if payload is not None:
        fields["payload_ratio"] = {**calibration.payload_ratio, run.hook: payload}
    return replace(calibration, **fields)


def own_compute(calibration: Calibration, hook: str) -> float:
    """The strategy's own compute from its run; without one, that of the strategy its record says
    it costs like (``cost.like``: the lossless one it compresses, ps_fp16 that of ps; ps_node that
    of ps, the same servers answering the same round trip per bucket), else 0."""
    like = HOOKS.record(hook).cost.like
    return calibration.own_ms.get(hook, calibration.own_ms.get(like, 0.0) if like else 0.0)


def sends_ms(calibration: Calibration, strategy: Strategy, hook: str, n: int,
             per_node: int = 1, gathered_in: str | None = None) -> float:
    """What a strategy's collectives over the whole model (its record's ``sends``: FSDP2's and
    ZeRO's gathers and scatters, local SGD's and DiLoCo's all-reduce once a period) cost an
    iteration, amortised over the period (``Calibration.options_of``), taken as not hidden
    behind compute (FSDP2 prefetches some of its gathers: an upper bound); those its buckets
    carry through backward (``cost.overlapped``) are in ``communication_end`` instead, but for
    the micro-batches before the last; an engine that releases parameters after forward gathers
    again its share of them for each backward (``Calibration.regathered``)."""
    if not strategy.sends:
        return 0.0
    nodes = costs.Nodes(n // per_node, per_node, calibration.link, calibration.intra_link)
    period = calibration.options_of(hook).get("period", 1)
    sent = calibration.gradient_bytes * float32_share(strategy.payload)
    gathered = calibration.gradient_bytes * float32_share(gathered_in or strategy.payload)
    overlapped = (strategy.cost.overlapped
                  if calibration.reduces_with_backward(hook, strategy.cost) else ())
    total = sum(costs.collective_ms(collective, nodes,
                                    gathered if collective == "all_gather" else sent,
                                    calibration.gloo)
                * (calls_per_iteration(per, period, calibration.micro_batches)
                   - (collective in overlapped))
                for collective, per in strategy.sends)
    share = calibration.regathered.get(hook)
    if share:
        total += calibration.micro_batches * costs.collective_ms("all_gather", nodes,
                                                                 gathered * share)
    return total


def predict(calibration: Calibration, hook: str, n: int, k: int, mapping: str = "shard",
            own: bool = True, per_node: int = 1, servers_on: str = "dedicated") -> dict | None:
    """Predicted iteration of ``hook`` with ``n`` trainers, ``per_node`` to a node, and ``k``
    servers (dedicated, or colocated: one on each node) (None: not predictable): its hook's
    buckets overlapped with backward, then the collectives it issues besides (``sends_ms``)."""
    strategy = HOOKS.record(hook)
    gradients, parameters = calibration.wire(strategy, hook)
    strategy = replace(strategy, payload=gradients)
    end = communication_end(calibration, strategy, hook, n, k, mapping, per_node, servers_on)
    if end is None:
        return None
    own_ms = own_compute(calibration, hook) if own else 0.0
    sent_ms = sends_ms(calibration, strategy, hook, n, per_node, parameters)
    phases, micro = calibration.phases, calibration.micro_batches
    # --grad-accum: the micro-batches before the last compute alone (their gradients only
    # accumulate); the last one's backward hands the buckets over
    accumulating = (micro - 1) * (phases.forward + phases.backward)
    batch = pipelines.iteration_ms(phases, end, own_ms) + accumulating + sent_ms
    return {"batch_ms": batch, "communication_end_ms": end, "sends_ms": sent_ms, "own_ms": own_ms,
            "samples_per_s": (n * calibration.batch_size * micro / (batch / 1000.0)
                              if batch > 0 else None)}


