"""The stale-synchronous server's bound, its options and the straggler option, in one process:
the server's futures are torch's own, answered when the bound allows."""

from __future__ import annotations

import math

import pytest
import torch

from ps_bench.runfiles import build_config, load_run_file
from ps_bench.runtime.faults import Straggler, Straggling
from ps_bench.servers.ssp import GO, ROUND_OVER, STOPPED, StaleSynchronousServer
from ps_bench.strategies.stale import parse_staleness


def server(bound: float, trainers: int = 2, budget: int = 100) -> StaleSynchronousServer:
    ps = StaleSynchronousServer(0, 1, trainers, trainers, "shard")
    ps.parameters, ps.lr, ps.bound, ps.budget = [torch.zeros(3)], 1.0, bound, budget
    return ps


def push(ps: StaleSynchronousServer, trainer: int, clock: int, value: float = 1.0):
    return ps.apply(trainer, clock, [torch.full((3,), value)])


def test_a_trainer_waits_once_it_is_more_than_s_clocks_ahead_of_the_slowest():
    ps = server(bound=1)
    first = push(ps, 0, 0)  # trainer 0 asks for clock 1: the slowest (trainer 1) is at 0, 1 - 1 <= 0
    assert first.done() and first.value()[2] == GO
    second = push(ps, 0, 1)  # clock 2 needs the slowest at 1
    assert not second.done()
    push(ps, 1, 0)
    assert second.done() and second.value()[2] == GO
    assert ps.take_metrics()["staleness"] == [0, 1, 0]  # trainer 0's second update missed trainer 1's clock 0


def test_bulk_synchronous_applies_every_update_of_a_clock_before_anyone_reads():
    ps = server(bound=0)
    early = push(ps, 0, 0, value=2.0)
    assert not early.done()
    late = push(ps, 1, 0, value=4.0)
    parameters, updates, status = early.value()
    assert status == GO and updates == 2 and late.value()[2] == GO
    assert torch.equal(parameters[0], torch.full((3,), -3.0))  # -lr/n (2 + 4): one step on the mean


def test_without_a_bound_nobody_waits_and_staleness_grows():
    ps = server(bound=math.inf)
    for clock in range(5):
        assert push(ps, 0, clock).done()
    push(ps, 1, 0)
    assert ps.take_metrics()["staleness"] == [0, 1, 2, 3, 4, 0]


def test_the_end_of_a_round_and_a_stop_release_every_waiting_trainer():
    ps = server(bound=0, budget=4)
    push(ps, 0, 0)
    push(ps, 1, 0)
    blocked = push(ps, 0, 1)
    assert not blocked.done()
    ending = push(ps, 1, 1)  # the fourth update spends the round's budget
    assert blocked.value() == (None, 4, ROUND_OVER) and ending.value() == (None, 4, ROUND_OVER)
    ps.reset_state()
    assert ps.read(0, 2).value()[2] == GO  # a new round begins with a pull, within the bound
    waiting = ps.read(1, 3)  # one clock ahead of trainer 0 with S = 0: waits
    assert not waiting.done()
    ps.stop_training()
    assert waiting.value() == (None, 4, STOPPED)
    assert push(ps, 0, 2).value() == (None, 4, STOPPED)  # nothing more is applied
    assert torch.equal(ps.parameters[0], torch.full((3,), -2.0))


@pytest.mark.parametrize("text, value", [("0", 0.0), ("4", 4.0), ("inf", math.inf), ("INF", math.inf)])
def test_staleness_values(text, value):
    assert parse_staleness(text) == value


@pytest.mark.parametrize("text", ["-1", "1.5", "x", ""])
def test_bad_staleness_is_a_sentence(text):
    with pytest.raises(ValueError, match="integer of 0 or more, or inf"):
        parse_staleness(text)


def test_stragglers_add_up_per_trainer():
    assert Straggler.parse("trainer:1:30ms") == Straggler(1, 0.03)
    assert Straggler.parse("trainer:0:250us").delay_s == pytest.approx(250e-6)
    assert Straggling(["trainer:1:30ms", "trainer:1:1s", "trainer:2:5ms"], 1, seed=0).delay_s(7) == pytest.approx(1.03)
    assert Straggling([], 0, seed=0).delay_s(1) == 0 and not Straggling([], 0, seed=0)


def test_a_transient_straggler_delays_a_seeded_share_of_iterations():
    """any:DELAY:P: each trainer, each iteration, with probability P; the same draws for the same
    seed, other draws for another seed or trainer."""
    assert Straggler.parse("any:20ms:0.2") == Straggler(None, 0.02, 0.2)
    straggling = Straggling(["any:20ms:0.2", "trainer:0:1ms"], 0, seed=3)
    delays = [straggling.delay_s(iteration) for iteration in range(1, 2001)]
    assert sorted({round(d, 6) for d in delays}) == [0.001, 0.021]
    share = sum(d > 0.01 for d in delays) / len(delays)
    assert 0.17 < share < 0.23
    assert delays == [Straggling(["any:20ms:0.2", "trainer:0:1ms"], 0, seed=3).delay_s(i) for i in range(1, 2001)]
    other = [Straggling(["any:20ms:0.2"], 1, seed=3).delay_s(i) for i in range(1, 2001)]
    assert [d > 0.01 for d in delays] != [d > 0 for d in other]


@pytest.mark.parametrize("text, message", [("server:1:3ms", "expected trainer:INDEX:DELAY"),
                                           ("any:3ms:0", "P must be a probability in"),
                                           ("any:3ms:1.5", "P must be a probability in"),
                                           ("any:3ms:x", "P must be a probability in"),
                                           ("trainer:x:3ms", "INDEX must be an integer"),
                                           ("trainer:1:-3ms", "DELAY must be 0 or more"),
                                           ("trainer:1:3", "a unit of us, ms or s")])
def test_bad_stragglers_are_sentences(text, message):
    with pytest.raises(ValueError, match=message):
        Straggler.parse(text)


def test_a_run_file_takes_staleness_as_a_number_or_inf_and_stragglers_as_a_list(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"staleness": 2, "straggler": ["trainer:1:30ms"]}')
    assert load_run_file(str(path)) == {"staleness": "2", "straggler": ["trainer:1:30ms"]}
    path.write_text('{"staleness": "inf"}')
    assert build_config({}, str(path)).staleness == "inf"
    path.write_text('{"straggler": "trainer:1:30ms"}')
    with pytest.raises(ValueError, match="'straggler' must be a list of strings"):
        load_run_file(str(path))
