"""Server arithmetic, called in-process (no RPC): answers must be averages, not sums."""

import pytest
import torch

from ps_bench.servers import AVERAGING, SERVERS

SERVER_NAMES = AVERAGING


def make(name: str, contributors: int, num_trainers: int | None = None, mapping: str = "shard", num_servers: int = 1):
    return SERVERS.get(name)(
        server_index=0, num_servers=num_servers, contributors=contributors,
        num_trainers=num_trainers or contributors, mapping=mapping,
    )


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_every_trainer_gets_the_average(name):
    server = make(name, contributors=3)
    grads = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0]), torch.tensor([5.0, 1.0])]
    futures = [server.contribute(bucket_index=0, tensor=g) for g in grads]
    for future in futures:
        assert future.done()
        torch.testing.assert_close(future.value(), torch.tensor([3.0, 3.0]))
    assert grads[0].tolist() == [1.0, 2.0]  # inputs untouched


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_answers_wait_for_the_last_contributor(name):
    server = make(name, contributors=2)
    first = server.contribute(0, torch.ones(4))
    assert not first.done()
    server.contribute(0, torch.ones(4) * 3)
    torch.testing.assert_close(first.value(), torch.full((4,), 2.0))


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_buckets_are_independent_and_state_resets_each_iteration(name):
    server = make(name, contributors=2)
    a0 = server.contribute(0, torch.tensor([2.0]))
    b0 = server.contribute(1, torch.tensor([10.0, 10.0]))
    server.contribute(1, torch.tensor([20.0, 30.0]))
    assert b0.done() and not a0.done()
    torch.testing.assert_close(b0.value(), torch.tensor([15.0, 20.0]))
    server.contribute(0, torch.tensor([4.0]))
    torch.testing.assert_close(a0.value(), torch.tensor([3.0]))
    again = [server.contribute(0, torch.tensor([x])) for x in (1.0, 5.0)]  # next iteration
    torch.testing.assert_close(again[0].value(), torch.tensor([3.0]))


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_sparse_gradients_average(name):
    server = make(name, contributors=2)
    one = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([2.0, 4.0]), (4,), check_invariants=True)
    two = torch.sparse_coo_tensor(torch.tensor([[2, 3]]), torch.tensor([6.0, 8.0]), (4,), check_invariants=True)
    futures = [server.contribute(0, one), server.contribute(0, two)]
    result = futures[0].value()
    assert result.is_sparse
    torch.testing.assert_close(result.to_dense(), torch.tensor([1.0, 0.0, 5.0, 4.0]))


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_shape_mismatch_fails_every_waiting_trainer(name):
    server = make(name, contributors=3)
    first = server.contribute(0, torch.ones(2))
    second = server.contribute(0, torch.ones(3))
    for future in (first, second):
        with pytest.raises(ValueError, match="differs"):
            future.wait()


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_group_root_divides_partials_by_all_trainers(name):
    # 5 trainers in 2 groups: partial sums from both groups meet at the root
    root = make(name, contributors=3, num_trainers=5, mapping="group", num_servers=2)
    remote = root.combine(0, torch.tensor([6.0, 3.0]), remote=True)
    assert not remote.done()
    local = root.combine(0, torch.tensor([4.0, 2.0]), remote=False)
    for future in (remote, local):
        torch.testing.assert_close(future.value(), torch.tensor([2.0, 1.0]))


def test_group_mapping_with_one_server_is_the_global_average():
    server = make("average", contributors=2, num_trainers=2, mapping="group")
    futures = [server.contribute(0, torch.tensor([x])) for x in (1.0, 3.0)]
    assert futures[1].value().item() == 2.0


def test_metrics_and_reset():
    server = make("average", contributors=2)
    server.contribute(0, torch.zeros(8))
    with pytest.raises(RuntimeError, match="incomplete"):
        server.reset_state()
    server.contribute(0, torch.zeros(8))  # the reset dropped the first one: a fresh iteration
    server.contribute(0, torch.zeros(8))
    metrics = server.take_metrics()
    assert set(metrics["samples"]) == {"straggler", "aggregate", "round"}
    assert len(metrics["samples"]["round"]) == 1
    assert metrics["bytes"] == {"recv": 3 * 32, "sent": 2 * 32}
    assert server.take_metrics()["bytes"] == {"recv": 0, "sent": 0}
    server.reset_state()


def test_upstream_names_are_aliases():
    assert SERVERS.canonical("AverageParameterServer") == "average"
    assert SERVERS.canonical("AverageBatchParameterServer") == "average_batch"


@pytest.mark.parametrize("name", SERVER_NAMES)
def test_sums_go_into_two_buffers_kept_across_iterations(name):
    """No allocation per iteration; an answer is never overwritten by the very next iteration."""
    server = make(name, contributors=3)
    answers = []
    for iteration in range(4):
        futures = [server.contribute(0, torch.full((1024,), float(i + iteration))) for i in range(3)]
        answers.append(futures[0].value())
        torch.testing.assert_close(answers[-1], torch.full((1024,), 1.0 + iteration))
    pointers = [a.data_ptr() for a in answers]
    assert pointers[0] == pointers[2] and pointers[1] == pointers[3] and pointers[0] != pointers[1]
    server.reset_state()  # between rounds: contributions go, buffers stay
    again = [server.contribute(0, torch.ones(1024)) for _ in range(3)]
    assert again[0].value().data_ptr() in pointers


def test_a_bucket_no_longer_sent_is_forgotten_with_its_buffers_between_rounds():
    """DDP rebuilds its buckets after the first iteration: the first layout's keys are never
    sent again, and their sums' buffers go at the next reset, while the keys still sent keep
    theirs (the same tensors)."""
    server = make("average", contributors=2)
    for key in (0, 1):  # iteration 1, the first layout
        [server.contribute(key, torch.ones(8), iteration=1) for _ in range(2)]
    for iteration in (2, 3):  # the rebuilt layout: key 1 and a new key 2
        for key in (1, 2):
            [server.contribute(key, torch.ones(4), iteration=iteration) for _ in range(2)]
    def held() -> int:
        return server.take_metrics()["memory"]["model_states"]["gradients_bytes"]

    assert held() == 2 * 8 * 4 + 2 * (2 * 4 * 4)  # two buffers a key: key 0's of 8 float32s, then 4
    server.reset_state()
    assert held() == 2 * (2 * 4 * 4)
    answers = [server.contribute(key, torch.full((4,), 3.0), iteration=4) for key in (1, 2, 1, 2)]
    assert all(torch.equal(answer.value(), torch.full((4,), 3.0)) for answer in answers)
    assert held() == 2 * (2 * 4 * 4)  # the kept keys' buffers, reused
