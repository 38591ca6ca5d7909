"""Where a job's start-up went: from the command to the first round, phase by phase.

The launcher notes when its own imports and the validation ended; every rank notes when its
process started, joined the store, had its process group and had RPC up; the master notes when
the servers were created and every trainer had built its DDP replica (``ready after``). The
phases are the stretches between the last rank to reach each milestone, along the path to the
first round (phases of different ranks overlap; these are what the first round waited for).
"""

from __future__ import annotations

RANK_MILESTONES = (("ranks started", "started"), ("rendezvous", "joined"),
                   ("trainers' process group", "grouped"), ("RPC", "connected"))


def startup_phases(launcher: dict[str, float], ranks: list[dict[str, float]], servers_at: float,
                   ready_at: float) -> dict[str, float]:
    """Seconds per phase, and ``total`` (command to ready). ``launcher`` holds ``launched``
    and, where a launcher of ours ran, ``imported`` and ``validated`` (time.time())."""
    milestones = [("launcher imports", launcher.get("imported")),
                  ("validation", launcher.get("validated"))]
    milestones += [(phase, max(rank[key] for rank in ranks)) for phase, key in RANK_MILESTONES]
    milestones += [("servers created", servers_at), ("trainers built (DDP)", ready_at)]
    phases, previous = {}, launcher["launched"]
    for phase, at in milestones:
        if at is None:
            continue
        phases[phase] = round(max(0.0, at - previous), 3)
        previous = max(previous, at)
    phases["total"] = round(ready_at - launcher["launched"], 3)
    return phases


def render_startup(phases: dict[str, float]) -> str:
    steps = ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in phases.items()
                      if phase != "total")
    return f"start-up (s): {steps}; ready after {phases['total']:.2f}"
