"""Parameter servers fed in pieces (``ps``, ``ps_node``): how the pieces are cut and dealt over
the servers, the window that sends them, and what predict makes of them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.futures import Future

from ps_bench.cli import main
from ps_bench.metrics import costs
from ps_bench.metrics.costs import Link, Nodes
from ps_bench.metrics.memory import trainer_memory
from ps_bench.metrics.messages import piece_elements
from ps_bench.predict import pipelines
from ps_bench.runtime.topology import PIECES, piece_owners, piece_ranges, piece_root, slice_size
from ps_bench.strategies.base import HookOnly
from ps_bench.strategies.hook_options import hook_options
from ps_bench.strategies.partitions import Partitioned, PieceWindow
from ps_bench.strategies.servers import HalfPrecisionServers

MB = 1e6
NETWORK, LOCAL = Link(latency_ms=0.01, bytes_per_ms=1e6), Link(latency_ms=0.001, bytes_per_ms=1e7)


def test_a_slice_is_cut_into_pieces_of_at_most_the_partition():
    assert piece_ranges(10, 4) == [(0, 4), (4, 3), (7, 3)]  # as few as it takes, of equal length
    assert piece_ranges(12, 4) == [(0, 4), (4, 4), (8, 4)]
    assert piece_ranges(10, None) == piece_ranges(10, 10) == [(0, 10)]
    assert slice_size(10, 4) == 3  # four slices of 3, the last padded


@pytest.mark.parametrize("servers", [1, 3, 4, 7])
def test_pieces_are_dealt_evenly_over_every_server(servers):
    """Two buckets of 25 and 11 MiB in 4 MiB pieces, and a host's 2 slices of each: every server
    gets within one piece of every other, and each piece has a key of its own."""
    buckets = {0: 25 << 20, 1: 11 << 20}
    for parts in (1, 2):
        owners = piece_owners(buckets, parts, servers, 4 << 20)
        load = [0] * servers
        for index, size in buckets.items():
            for part in range(parts):
                for place, (_, length) in enumerate(piece_ranges(slice_size(size, parts), 4 << 20)):
                    load[owners[(index * parts + part) * PIECES + place]] += length
        assert sum(load) == sum(slice_size(size, parts) * parts for size in buckets.values())
        assert max(load) - min(load) <= 4 << 20


def test_whole_buckets_are_dealt_largest_first():
    assert piece_owners({0: 6, 1: 2, 2: 3}, 1, 2) == {0: 0, 1 * PIECES: 1, 2 * PIECES: 1}


def test_the_window_sends_in_the_order_places_were_reserved_and_at_most_its_pieces_at_once():
    """Places are reserved as DDP hands the buckets over, the same on every trainer, so with a
    bound every host has the same pieces in flight: a piece submitted before an earlier place's
    waits for it, whatever order the host's sums finish in."""
    sent, pending = [], {}

    def send(name):
        def start():
            sent.append(name)
            pending[name] = Future()
            return pending[name]
        return start

    window = PieceWindow(window=1)
    first, second = window.reserve(2), window.reserve(1)
    cpu = torch.device("cpu")
    late = window.submit(second, send("c"), cpu)  # the next bucket's sum finished first
    assert sent == []
    answers = [window.submit(first, send("a"), cpu), window.submit(first + 1, send("b"), cpu)]
    assert sent == ["a"]  # one in flight
    pending["a"].set_result(1)
    assert sent == ["a", "b"]
    pending["b"].set_result(2)
    pending["c"].set_result(3)
    assert [answer.wait() for answer in answers + [late]] == [1, 2, 3]
    unbounded = PieceWindow(window=0)
    sent.clear()
    start = unbounded.reserve(3)
    for place, name in enumerate("xyz"):
        unbounded.submit(start + place, send(name), cpu)
    assert sent == ["x", "y", "z"]


def test_priority_sends_a_buckets_last_pieces_first():
    """DDP keeps a bucket's gradients in reverse order of the layers: its last pieces hold the
    earliest layers, which the next forward needs first."""
    pieces = [(key, key * 10, 10, 0) for key in range(3)]
    plain = Partitioned(on_cpu(), window=0, priority=False)
    first = Partitioned(on_cpu(), window=0, priority=True)
    assert plain.reserve(pieces)[1] == pieces and first.reserve(pieces)[1] == pieces[::-1]


def test_pieces_are_copies_kept_from_one_iteration_to_the_next_and_answers_land_in_the_bucket():
    """Each piece travels as a tensor of its own (RPC sends a view's whole storage), the same
    tensor every iteration (a new one is new pages for the kernel to zero); the answers are
    written back into the bucket, in order, as DDP's own all-reduce writes its bucket."""
    ctx = on_cpu()
    hook = Partitioned(ctx, window=2)
    pieces = [(7, 0, 4, 0), (8, 4, 4, 1), (9, 8, 2, 0)]
    sent = []

    def send(ctx, piece, key, server, wire_dtype):
        sent.append((key, piece))
        answer = Future()
        answer.set_result(piece * 10)
        return answer

    pieces_of = []  # each iteration's pieces, held: a new tensor cannot take a held one's place
    for iteration in range(2):
        ctx.iteration = iteration + 1
        bucket = torch.arange(10, dtype=torch.float32) + iteration
        expected = bucket * 10
        done = hook.push(None, bucket, hook.reserve(pieces), send)
        assert torch.equal(done.wait(), expected) and torch.equal(bucket, expected)
        assert [key for key, _ in sent] == [7, 8, 9]
        assert all(piece.untyped_storage().nbytes() == piece.numel() * 4 for _, piece in sent)
        pieces_of.append([piece for _, piece in sent])
        sent.clear()
    assert [piece.data_ptr() for piece in pieces_of[0]] == [piece.data_ptr() for piece in pieces_of[1]]
    assert hook.scratch.nbytes() == 10 * 4
    # DDP rebuilds its buckets: the next iterations send other pieces (one key kept, resized), and
    # what the old layout's pieces kept is let go once an iteration has passed without them
    for iteration, kept in ((3, (4 + 4 + 3 + 3) * 4), (4, (3 + 3) * 4)):
        ctx.iteration = iteration
        hook.push(None, torch.ones(6), hook.reserve([(9, 0, 3, 0), (20, 3, 3, 1)]), send).wait()
        assert hook.scratch.nbytes() == kept, iteration


@pytest.mark.parametrize("pieces", [[(7, 0, 6, 0), (8, 6, 4, 1)], [(7, 0, 10, 0)]],
                         ids=["pieces", "whole bucket"])
def test_pieces_travel_in_their_wire_dtype_from_kept_tensors_and_answers_come_back_in_the_buckets(
        pieces):
    """``ps_fp16``: each piece is cast as it is copied, into a float16 tensor kept from one
    iteration to the next (no float32 copy, no new tensor of the cast), a whole bucket too; the
    float16 answers are written back into the float32 bucket."""
    hook = HalfPrecisionServers(on_cpu())
    sent = []

    def send(ctx, piece, key, server, wire_dtype):
        sent.append(piece)
        answer = Future()
        answer.set_result(piece.to(wire_dtype) / 4)  # what the server answers: its wire dtype
        return answer

    for iteration in range(2):
        bucket = torch.linspace(-1, 1, 10) / 3 + iteration
        expected = (bucket.half() / 4).float()
        assert torch.equal(hook.push(None, bucket, hook.reserve(pieces), send).wait(), expected)
        assert torch.equal(bucket, expected) and bucket.dtype == torch.float32
    assert all(piece.dtype == torch.float16 for piece in sent)
    first, second = sent[:len(pieces)], sent[len(pieces):]
    assert [piece.data_ptr() for piece in first] == [piece.data_ptr() for piece in second]
    # what the trainer reports as kept between iterations (``buffers_bytes``): the 16-bit copies
    assert HookOnly(hook).kept_bytes() == 10 * 2
    assert HookOnly(Partitioned(on_cpu())).kept_bytes() == 0 == HookOnly(len).kept_bytes()


def test_on_the_cpu_a_trainers_peak_counts_the_buffers_its_strategy_keeps():
    held = {"parameters_bytes": 40, "gradients_bytes": 40, "optimizer_bytes": 0, "total_bytes": 80}
    memory = trainer_memory(torch.device("cpu"), held, activations=7, buffers=20)
    assert memory["buffers_bytes"] == 20 and memory["peak_bytes"] == 80 + 7 + 20
    assert memory["peak_from"].endswith("kept buffers")


def on_cpu(cuda_trainer: bool = False, cuda_servers: tuple[bool, ...] = (False,)):
    """What ``Partitioned`` reads of a trainer's ``HookContext``: where its tensors cross RPC."""
    return SimpleNamespace(cuda_rpc=cuda_trainer, iteration=1,
                           servers=[SimpleNamespace(cuda_rpc=cuda) for cuda in cuda_servers])


def test_pieces_are_4_mib_over_several_cpu_servers_and_whole_where_they_spread_nothing():
    """Not given, ``partition_mb`` is 4 MiB where the pieces are dealt over several servers with
    tensors crossing RPC on the CPU, and whole buckets to one server (nothing to spread) or where
    a CUDA trainer sends to CUDA servers (each message a fixed cost there); given, it holds
    everywhere; a strategy without the option sends buckets whole."""
    assert piece_elements({"partition_mb": None}, servers=2) == 2 ** 20
    assert piece_elements({"partition_mb": None}, servers=1) is None
    assert piece_elements({"partition_mb": None}, servers=2, on_device=True) is None
    assert piece_elements({"partition_mb": 4.0}, servers=1) == 2 ** 20
    assert piece_elements({"partition_mb": 16.0}, servers=2, on_device=True) == 4 * 2 ** 20
    assert piece_elements({}, servers=2) is None
    assert Partitioned(on_cpu()).piece is None  # one server
    assert Partitioned(on_cpu(False, (False, False))).piece == 2 ** 20
    assert Partitioned(on_cpu(True, (True, True))).piece is None
    assert Partitioned(on_cpu(True, (True, False))).piece == 2 ** 20  # one server on the CPU
    assert Partitioned(on_cpu(True, (True,)), partition_mb=1.0).piece == 2 ** 18
    assert hook_options("ps", {})["partition_mb"] is None


def test_node_aggregated_pieces_reach_the_byteps_bound_with_a_server_a_node():
    """8 nodes of 8, one 200 MB bucket in 4 MiB pieces, 8 dedicated servers: each node's link
    sends and receives the bucket once, each server the same share. With one piece a trainer in
    flight (``window`` 1) the pieces arrive one wave after another and are answered while the
    next are pushed: ``M/B``, the BytePS bound with one server a node, and at most the last
    wave's answers later. With no window, every piece is in flight at once, so the answers wait
    for most of the pushes: up to ``2M/B``. 8 servers are not slower than 4."""
    nodes = Nodes(8, 8, NETWORK, LOCAL)
    bucket, piece = [(0.0, 200 * MB)], 4 * 2 ** 20
    inside = 2 * costs.within_node_ms(nodes, 200 * MB, 1)  # the sum and the gather within the node
    bound = costs.byteps_bound_ms(8, 8, 200 * MB, NETWORK)
    assert bound == pytest.approx(200.0)
    windowed = pipelines.node_ps_pipeline(bucket, nodes, 8, piece=piece, window=1)
    assert bound <= windowed - inside <= bound + 2 * 8 * NETWORK.time(piece) + 4 * NETWORK.latency_ms
    eight = pipelines.node_ps_pipeline(bucket, nodes, 8, piece=piece)
    assert windowed < eight and bound < eight - inside <= 2 * bound + 4 * NETWORK.latency_ms
    assert eight <= pipelines.node_ps_pipeline(bucket, nodes, 4, piece=piece)
    whole = pipelines.node_ps_pipeline(bucket, nodes, 8)  # one slice a trainer, each to one server
    assert eight < whole


def test_waves_count_a_senders_window_or_its_pieces_to_one_server():
    assert pipelines.pushed_in_waves([[0, 1, 2, 3, 0, 1]], window=0) == 2  # two to server 0
    assert pipelines.pushed_in_waves([[0, 1, 2, 3, 0, 1]], window=1) == 6
    assert pipelines.pushed_in_waves([[0, 1, 2, 3, 0, 1], [0]], window=4) == 2
    assert pipelines.pushed_in_waves([[]], window=0) == 1


def test_ps_pieces_spread_a_large_bucket_over_more_servers():
    pieces = lambda k: pipelines.server_pieces([(0.0, 64 * MB)], k, 4 * 2 ** 20)
    one_bucket_one_server = pipelines.ps_pipeline(pipelines.server_pieces([(0.0, 64 * MB)], 4), 4, 4, NETWORK)
    spread = pipelines.ps_pipeline(pieces(4), 4, 4, NETWORK)
    assert spread < 0.4 * one_bucket_one_server  # 4 servers share what one carried
    assert spread >= costs.ps_bound_ms(4, 4, 64 * MB, NETWORK)


@pytest.mark.parametrize("hook, value, words", [
    ("ps", "0", "hook option 'partition_mb' must be a number of MiB above 0; got 0"),
    ("ps_node", "-2", "hook option 'partition_mb' must be a number of MiB above 0; got -2"),
    ("ps", "lots", "hook option 'partition_mb' must be a number; got 'lots'"),
    ("ps", "nan", "hook option 'partition_mb' must be"),
])
def test_a_bad_partition_is_one_line_and_exit_2_before_anything_starts(hook, value, words, capsys):
    argv = ["--hook", hook, "--hook-option", f"partition_mb={value}", "--dry-run"]
    if hook == "ps_node":
        argv += ["--ntrainer", "4", "--per-host", "2", "--nserver", "2"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and words in captured.err, captured.err


def test_the_dummy_models_pieces_spread_evenly_over_more_servers_than_a_host_has_trainers():
    """upstream's DummyModel (three buckets of 4.2, 29.4 and 4.2 MB) on hosts of 2 trainers and
    4 servers: each server receives its quarter of a host's sum to the byte's tenth."""
    sizes = {0: 1_049_600, 1: 7_347_200, 2: 1_048_576}  # float32 elements
    owners = piece_owners(sizes, 2, 4, (4 << 20) // 4)
    load = [0] * 4
    for index, size in sizes.items():
        for part in range(2):
            for place, (_, length) in enumerate(piece_ranges(slice_size(size, 2), (4 << 20) // 4)):
                load[owners[(index * 2 + part) * PIECES + place]] += length
    assert max(load) <= 1.1 * sum(load) / 4


def sparse_embedding_gradient(rows: int, touched: list[int]) -> torch.Tensor:
    """A sparse gradient of a ``rows`` x 4 embedding that touched ``touched`` rows."""
    return torch.sparse_coo_tensor([touched], torch.ones(len(touched), 4), (rows, 4), check_invariants=True)


def test_a_sparse_bucket_goes_whole_after_the_dense_pieces_whichever_bucket_closes_the_layout():
    """DDP's last bucket holds the first layers, often an embedding's sparse gradient: the dense
    pieces are dealt evenly over the servers as if it were not there, and it goes whole, once,
    to the least loaded, on every iteration after the first (which learns the layout), whatever
    the trainer touched; the same deal as ``piece_owners`` makes and predict takes."""
    from ps_bench.strategies.base import HookContext
    ctx = HookContext(process_group=None, servers=[None, None, None], mapping="shard",
                      group_server=None, cuda_rpc=False, rpc_timeout=60)
    dense = torch.zeros(10)
    buckets = [lambda touched: dense, lambda touched: sparse_embedding_gradient(64, touched)]

    def iteration(touched):
        return [ctx.pieces(SimpleNamespace(buffer=lambda make=make: make(touched), index=lambda i=i: i,
                                           is_last=lambda i=i: i == len(buckets) - 1), piece=None if i else 4)
                for i, make in enumerate(buckets)]

    iteration([1, 2])
    dense_pieces, sparse_pieces = iteration([5])
    assert [(key, first, length) for key, first, length, _ in dense_pieces] == [(0, 0, 4), (1, 4, 3), (2, 7, 3)]
    assert sorted(server for *_, server in dense_pieces) == [0, 1, 2]  # one piece each
    assert [(key, first, length) for key, first, length, _ in sparse_pieces] == [(PIECES, 0, 256)]  # its dense elements
    owners = piece_owners({0: 10, 1: 256}, 1, 3, 4, sparse=[1])
    assert sparse_pieces[0][3] == owners[PIECES] == 1  # least loaded: 3 elements, the first of two
    assert [server for *_, server in dense_pieces] == [owners[key] for key in (0, 1, 2)]
    assert iteration([7, 8, 9]) == [dense_pieces, sparse_pieces]  # other rows, the same deal


def test_where_only_sparse_buckets_pass_the_first_one_seen_again_closes_the_layout():
    """``sparse_ps`` pushes its sparse buckets and all-reduces the dense ones; where DDP's last
    bucket is dense, ``is_last`` never passes, and the sparse buckets are still dealt as
    ``piece_owners`` (and predict) deal them, from the second iteration on."""
    from ps_bench.strategies.base import HookContext
    ctx = HookContext(process_group=None, servers=[None, None, None], mapping="shard",
                      group_server=None, cuda_rpc=False, rpc_timeout=60)

    def iteration():  # buckets 1 and 2 sparse, pushed; 0 and 3 dense, all-reduced (3 the last)
        return [ctx.pieces(SimpleNamespace(buffer=lambda: sparse_embedding_gradient(rows, [0]),
                                           index=lambda i=i: i, is_last=lambda: False))[0][3]
                for i, rows in ((1, 64), (2, 32))]

    assert iteration() == [piece_root(PIECES, 3), piece_root(2 * PIECES, 3)] == [1, 2]  # learning the layout
    owners = piece_owners({1: 256, 2: 128}, 1, 3, None, sparse=[1, 2])
    assert iteration() == iteration() == [owners[PIECES], owners[2 * PIECES]] == [0, 1]
    predicted = pipelines.server_pieces([(1.0, 256.0), (2.0, 128.0)], 3, sparse=[0, 1])
    assert [server for *_, server in predicted] == [0, 1]


def test_sparse_buckets_take_turns_from_the_least_loaded_server_and_predict_sends_them_whole():
    owners = piece_owners({0: 9, 1: 100, 2: 100}, 1, 2, 5, sparse=[1, 2])
    assert owners == {0: 0, 1: 1, PIECES: 1, 2 * PIECES: 0}  # dense 5 + 4; the sparse ones one each
    pieces = pipelines.server_pieces([(1.0, 9.0), (2.0, 3.0), (3.0, 2.0)], 2, 5, sparse=[1, 2])
    assert pieces == [(1.0, 5, 0), (1.0, 4, 1), (2.0, 3, 1), (3.0, 2, 0)]
