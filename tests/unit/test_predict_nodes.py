"""``bench.py predict`` on nodes of several trainers: each node model against values computed by
hand (G = 1 is today's flat model, N = 1 the node's local link alone), ``--compute-ms`` on a
made-up model, ``--compute`` from another run, and bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from ps_bench.cli import main
from ps_bench.metrics import costs
from ps_bench.predict import pipelines
from ps_bench.metrics.costs import Link, Nodes
from ps_bench.predict.buckets import engine_buckets
from ps_bench.predict.pipelines import Phases
from ps_bench.predict.inputs import meta_buckets, model_buckets
from ps_bench.predict.calibration import from_compute_ms
from ps_bench.predict.predictor import calibrate, predict
from ps_bench.predict.rows import colocated_counts, unplaced
from ps_bench.predict.runs import Run
from ps_bench.strategies import HOOKS
from ps_bench.strategies.deepspeed_config import wire_dtypes
from tests.unit.test_predict import results_file

NETWORK = Link(latency_ms=0.01, bytes_per_ms=1e6)  # 1 MB per ms, 10 µs
LOCAL = Link(latency_ms=0.001, bytes_per_ms=10e6)  # ten times faster, 1 µs
MB = 1e6


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_one_trainer_per_node_is_the_flat_ring_and_one_node_is_its_local_link(n):
    flat = Nodes(n, 1, NETWORK)
    assert costs.flat_ring_ms(flat, 8 * MB) == costs.ring_allreduce_ms(n, 8 * MB, NETWORK)
    assert costs.hierarchical_ms(flat, 8 * MB) == costs.ring_allreduce_ms(n, 8 * MB, NETWORK)
    assert costs.hsdp_reduce_ms(flat, 8 * MB) == costs.ring_allreduce_ms(n, 8 * MB, NETWORK)
    node = Nodes(1, n, NETWORK, LOCAL)
    assert costs.flat_ring_ms(node, 8 * MB) == costs.ring_allreduce_ms(n, 8 * MB, LOCAL)
    assert costs.hierarchical_ms(node, 8 * MB) == pytest.approx(costs.ring_allreduce_ms(n, 8 * MB, LOCAL))
    pieces = pipelines.server_pieces([(0.0, 4 * MB)], 1)
    assert pipelines.ps_pipeline(pieces, n, 1, NETWORK, per_node=1) == pipelines.ps_pipeline(pieces, n, 1, NETWORK)


def test_the_flat_ring_on_nodes_moves_at_the_network_link_and_pays_its_latency_where_it_crosses_it():
    # 2 nodes x 4: n = 8, 2(n-1)/n = 1.75 of the bytes at the slower link; of the 14 steps, 2(N-1) = 2
    # cross the network (its latency), 12 stay inside a node (the local link's), as NCCL's tuning
    # model counts a ring's latency (every step at the network's had counted it 14 times)
    assert costs.flat_ring_ms(Nodes(2, 4, NETWORK, LOCAL), 8 * MB) == pytest.approx(2 * 0.01 + 12 * 0.001 + 1.75 * 8.0)
    # PowerSGD's three collectives a bucket: every latency three times
    assert costs.flat_ring_ms(Nodes(2, 4, NETWORK, LOCAL), 8 * MB, steps_per_message=3) == pytest.approx(
        3 * (2 * 0.01 + 12 * 0.001) + 1.75 * 8.0)


def test_hierarchical_is_a_reduce_scatter_and_all_gather_inside_and_a_ring_across():
    # 4 nodes x 2: inside 2 x (1 latency + 1/2 x 8 MB at 10 MB/ms) = 2 x (0.001 + 0.4);
    # across 2(4-1) latencies + 2(3)/4 x 8 MB at 1 MB/ms = 0.06 + 12
    assert costs.hierarchical_ms(Nodes(4, 2, NETWORK, LOCAL), 8 * MB) == pytest.approx(2 * 0.401 + 0.06 + 12.0)
    # fewer bytes on the network link than the flat ring's 2(8-1)/8 = 1.75
    assert costs.hierarchical_ms(Nodes(4, 2, NETWORK, LOCAL), 8 * MB) < costs.flat_ring_ms(
        Nodes(4, 2, NETWORK, LOCAL), 8 * MB)


def test_on_gloo_the_first_step_inside_is_an_all_reduce():
    nodes = Nodes(4, 2, NETWORK, LOCAL)
    assert costs.hierarchical_ms(nodes, 8 * MB, gloo=True) == pytest.approx(3 * 0.401 + 0.06 + 12.0)
    assert costs.hsdp_reduce_ms(nodes, 8 * MB, gloo=True) - costs.hsdp_reduce_ms(nodes, 8 * MB) == pytest.approx(0.401)


def test_hsdp_reduces_once_inside_and_gathers_twice():
    nodes = Nodes(2, 4, NETWORK, LOCAL)
    inside = 3 * 0.001 + 0.75 * 0.8  # (G-1) latencies, (G-1)/G x 8 MB at 10 MB/ms
    assert costs.hsdp_reduce_ms(nodes, 8 * MB) == pytest.approx(inside + 2 * 0.01 + 8.0)
    assert costs.hsdp_gather_ms(nodes, 8 * MB) == pytest.approx(2 * inside)


def test_dedicated_servers_see_every_trainer_of_a_node_on_its_link():
    # one 1 MB bucket, 2 nodes x 2, one server: the node sends 2 copies (2 ms), the server
    # receives 4 (4 ms after the first starts) and answers 4 (4 ms), the node receives 2
    assert pipelines.ps_pipeline(pipelines.server_pieces([(0.0, MB)], 1), 4, 1, NETWORK,
                                 per_node=2) == pytest.approx(4.0 + 0.01 + 4.0 + 0.01)
    # 4 servers of 4 one-MB buckets: each server hears 4 copies; each node's link, outbound,
    # carries 2 copies of each of 4 buckets: 8 ms, the bound
    four = pipelines.server_pieces([(0.0, MB)] * 4, 4)
    assert pipelines.ps_pipeline(four, 4, 4, NETWORK, per_node=2) >= 8.0


def test_colocated_servers_carry_each_nodes_gradient_once_each_way_on_two_nodes():
    # one bucket of S = 1 MB owned by node 0's server, 2 nodes x 2: node 1 pushes 2 S (2 ms, then
    # 10 µs), node 0's own copies cross its local link meanwhile; the answers, 2 S out of node 0
    nodes = Nodes(2, 2, NETWORK, LOCAL)
    one = pipelines.server_pieces([(0.0, MB)], 2)
    assert pipelines.colocated_ps_pipeline(one, nodes) == pytest.approx(2.0 + 0.01 + 2.0 + 0.01)
    # one node: the local link alone, G copies each way
    assert pipelines.colocated_ps_pipeline(pipelines.server_pieces([(0.0, MB)], 1),
                                           Nodes(1, 4, NETWORK, LOCAL)) == pytest.approx(
        2 * (4 * 0.1 + 0.001))


def test_colocated_servers_spread_evenly_move_a_rings_bytes():
    # 4 MB cut into four 1 MB pieces over 2 nodes x 2: each node's servers hold half; a node's
    # link pushes 2 x 2 MB out while 2 x 2 MB come in, then the answers the other way, the first
    # wave's answers (two pieces to each server: two waves) behind the second wave's pushes:
    # each direction busy throughout, 2G(N-1)/N x M / B = 8 ms, then the last answer's latency
    nodes = Nodes(2, 2, NETWORK, LOCAL)
    pieces = pipelines.server_pieces([(0.0, 4 * MB)], 2, piece=MB)
    assert pipelines.colocated_ps_pipeline(pieces, nodes) == pytest.approx(8.0 + 0.01)


def test_a_later_bucket_pushes_while_the_earlier_ones_answers_come_back():
    # dedicated, one server a node, pieces of half a bucket over both: bucket 1's pushes (1 ms
    # out of each node) cross while bucket 0's answers come in, so two buckets cost 3
    # crossings, not 4
    nodes = Nodes(2, 1, NETWORK, None)
    one = pipelines.node_ps_pipeline([(0.0, MB)], nodes, 2, piece=MB / 2)
    two = pipelines.node_ps_pipeline([(0.0, MB), (0.0, MB)], nodes, 2, piece=MB / 2)
    assert one == pytest.approx(2.0 + 2 * 0.01)
    assert two == pytest.approx(3.0 + 2 * 0.01)


def test_node_aggregated_servers_carry_each_nodes_gradient_once_each_way():
    # one 1 MB bucket, 2 nodes x 2, 2 dedicated servers (a slice of 0.5 MB each): gloo's sum inside
    # the node, a ring all-reduce of 1 MB over the local link (2 x 0.05 ms + 2 µs); the node sends
    # its 2 slices (1 ms), each server hears 2 nodes' 0.5 MB (1 ms), then answers its last slice's
    # 2 copies (1 ms), 10 µs each way; the slices gathered inside the node (0.05 ms + 1 µs)
    nodes = Nodes(2, 2, NETWORK, LOCAL)
    inside, across = 2 * (0.05 + 0.001), 2 * (1.0 + 0.01)
    assert pipelines.node_ps_pipeline([(0.0, MB)], nodes, 2, gloo=True) == pytest.approx(inside + across + 0.051)
    # against ps's per-trainer pushes: the node's link carries 2 copies each way
    assert pipelines.node_ps_pipeline([(0.0, MB)] * 4, nodes, 2) < pipelines.ps_pipeline(
        pipelines.server_pieces([(0.0, MB)] * 4, 2), 4, 2, NETWORK, per_node=2)
    # never below the BytePS bound over the nodes, with the servers it has
    assert pipelines.node_ps_pipeline([(0.0, MB)], Nodes(8, 8, NETWORK, LOCAL), 8) >= costs.byteps_bound_ms(
        8, 8, MB, NETWORK)


def test_node_aggregated_pieces_leave_once_their_own_sum_is_done():
    # a 4 MB bucket, 2 nodes x 2, 2 dedicated servers; the local link made ten times slower
    # (the sum inside a node, a ring all-reduce of 4 MB on gloo, from 0.4 to 4 ms). Summed whole,
    # the pushes wait for all of it: the iteration grows by the whole 3.6 ms (and the gather's
    # share); a piece at a time (pieces of 0.5 MB, 4 a slice), they start after the first
    # piece's sum, and it grows by a quarter of the 3.6 ms (and the same gather's share)
    fast, slow = Nodes(2, 2, NETWORK, LOCAL), Nodes(2, 2, NETWORK, Link(0.001, NETWORK.bytes_per_ms))
    grown = {piece: pipelines.node_ps_pipeline([(0.0, 4 * MB)], slow, 2, gloo=True, piece=piece)
             - pipelines.node_ps_pipeline([(0.0, 4 * MB)], fast, 2, gloo=True, piece=piece)
             for piece in (None, MB / 2)}
    summing = costs.within_node_ms(slow, 4 * MB, 2) - costs.within_node_ms(fast, 4 * MB, 2)
    assert summing == pytest.approx(3.6, rel=0.01)
    assert grown[None] - grown[MB / 2] == pytest.approx(summing * 3 / 4, rel=0.01)


def test_predict_puts_node_aggregated_servers_beside_ps_on_nodes_and_respects_the_bounds(tmp_path, capsys):
    """ResNet-50 on nodes of 8 GPUs at 10 Gbit/s: ps_node beside ps, never below the compute, nor
    below forward plus the BytePS bound."""
    out = tmp_path / "predict.json"
    assert main(["predict", "--model", "resnet50", "--batch-size", "64", "--compute-ms",
                 "forward=30,backward=60,optimizer=5", "--link", "10gbit", "--intra-link", "2400gbit",
                 "--per-node", "8", "--nodes", "1,2,4,8", "--servers", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    rows = json.loads(out.read_text())["predictions"]
    node_rows = [row for row in rows if row["strategy"] == "ps_node"]
    assert len(node_rows) == 4 and "ps_node" in printed and {row["strategy"] for row in rows} >= {"ps", "allreduce"}
    for row in node_rows:
        assert row["batch_ms"] >= 30 + 60 + 5
        if row.get("byteps_bound_ms") is not None:
            assert row["batch_ms"] >= 30 + row["byteps_bound_ms"]
        ps = next(other for other in rows if other["strategy"] == "ps" and other["trainers"] == row["trainers"])
        assert row["batch_ms"] <= ps["batch_ms"]


def test_predict_builds_vgg16_on_the_meta_device_and_its_classifier_is_ready_first(tmp_path, capsys):
    """VGG-16's classifier holds 89 % of its gradient bytes and under 1 % of its FLOPs, and runs
    last in forward: with --compute-ms, the buckets holding half the bytes are ready within the
    first 10 % of backward, not spread over it by their bytes."""
    out = tmp_path / "predict.json"
    assert main(["predict", "--model", "vgg16", "--batch-size", "32", "--compute-ms", "forward=10,backward=20,"
                 "optimizer=2", "--link", "10gbit", "--out", str(out)]) == 0
    calibration = json.loads(out.read_text())["calibration"]
    buckets = calibration["buckets"]
    assert sum(bucket["bytes"] for bucket in buckets) == 4 * 138_357_544
    early = sum(bucket["bytes"] for bucket in buckets if bucket["ready_ms"] <= 0.1 * 20)
    assert early >= 0.5 * 4 * 138_357_544, buckets
    assert "FLOPs" in calibration["overlap_from"]
    capsys.readouterr()


def test_a_transformers_blocks_are_ready_in_turn_over_backward():
    """gpt2_small's blocks are torch.nn.TransformerEncoderLayer, whose attention uses its
    out_proj's weight itself, never calling out_proj: each block's bucket is ready when backward
    has undone that block, in turn, not at the end of backward with the token embedding."""
    buckets, shares, how, _ = model_buckets("gpt2_small", 25.0, batch_size=2)
    assert "FLOPs" in how and len(buckets) == 13
    # the last bucket holds the token embedding (tied to the output): ready at the end
    assert shares[-1] == 1.0
    blocks = shares[1:-2]  # the buckets of blocks 10 to 1; block 0 shares the last but one
    assert all(earlier < later < 1.0 for earlier, later in zip(blocks, blocks[1:])), shares
    assert blocks[-1] < 0.95, shares


def test_predicted_ps_node_on_8_nodes_of_4_is_within_a_fifth_of_its_bounds(tmp_path, capsys):
    """ResNet-50 on nodes of 4 GPUs at 10 Gbit/s, servers on the nodes: ps_node at 8 nodes
    within 1.2 times the larger of its compute and forward plus the BytePS bound; 8 dedicated
    servers no slower than 4."""
    out = tmp_path / "predict.json"
    common = ["predict", "--model", "resnet50", "--batch-size", "64", "--compute-ms",
              "forward=84.2,backward=168.5,optimizer=2.5", "--per-node", "4", "--intra-link", "10000gbit",
              "--link", "10gbit", "--latency", "50us", "--hooks", "allreduce,ps_node", "--out", str(out)]
    assert main([*common, "--nodes", "1,2,4,8", "--servers-on", "colocated"]) == 0
    row = next(r for r in json.loads(out.read_text())["predictions"]
               if r["strategy"] == "ps_node" and r["nodes"] == 8)
    assert row["batch_ms"] <= 1.2 * max(84.2 + 168.5 + 2.5, 84.2 + row["byteps_bound_ms"])
    assert main([*common, "--nodes", "8", "--servers", "4,8"]) == 0
    dedicated = {r["servers"]: r["batch_ms"] for r in json.loads(out.read_text())["predictions"]
                 if r["strategy"] == "ps_node"}
    assert dedicated[8] <= dedicated[4]
    capsys.readouterr()


def test_rows_from_4_nodes_over_ethernet_are_read_as_what_the_links_allow(tmp_path, capsys):
    """Every published cluster of 4 nodes or more over Ethernet ran slower than predicted
    (benchmarks/published_check.py): predict says so under such rows, and only there."""
    common = ["predict", "--model", "resnet18", "--batch-size", "32", "--compute-ms",
              "forward=30,backward=60,optimizer=5", "--per-node", "4", "--intra-link", "2400gbit",
              "--link", "25gbit", "--hooks", "allreduce"]
    assert main([*common, "--nodes", "1,2,4,8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "note: every published cluster of 4 nodes or more over Ethernet (TCP) that predict was checked against "
        "ran slower than predicted (benchmarks/published_check.py, docs/predict.md): read the rows of 4, 8 nodes "
        "as what the links allow, not as a forecast (--link-kind ethernet, the default: give infiniband or roce "
        "for an RDMA network)")
    for others in (["--nodes", "1,2"], ["--nodes", "8", "--link-kind", "infiniband"]):
        assert main([*common, *others]) == 0
        assert "note: every published cluster" not in capsys.readouterr().out


class MadeUp(nn.Module):
    """Three layers of known sizes: 2.5 MB, 0.5 MB and 1 MB of float32 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(625, 1000, bias=False)  # 625,000 x 4 B = 2.5 MB
        self.second = nn.Linear(125, 1000, bias=False)  # 0.5 MB
        self.third = nn.Linear(250, 1000, bias=False)  # 1 MB


def test_compute_ms_builds_ddps_buckets_and_spreads_their_ready_times_over_backward():
    with torch.device("meta"):
        network = MadeUp()
    # reverse order, a bucket closed once it reaches its cap, the first bucket too (DDP's 1 MiB
    # first bucket is for a DDP given no cap; a trainer gives one): all three under 2 MiB
    assert meta_buckets(network, bucket_cap_mb=2.0) == [(4_000_000, False, 3)]  # bytes, sparse, tensors
    # third and second (1.5 MB), then first, under 1 MiB
    buckets = meta_buckets(network, bucket_cap_mb=1.0)
    assert buckets == [(1_500_000, False, 2), (2_500_000, False, 1)]
    calibration = from_compute_ms("MadeUp", 8, Phases(10.0, 40.0, 2.0), buckets, NETWORK, "given")
    assert [bucket.ready_ms for bucket in calibration.buckets] == pytest.approx([15.0, 40.0])
    # two trainers: each bucket a ring of 2 when ready: 1.5 + 0.02 ms after 15, 2.5 + 0.02 after
    # 40: backward ends at 42.52
    assert predict(calibration, "allreduce", 2, 0)["batch_ms"] == pytest.approx(10.0 + 42.52 + 2.0)


def test_compute_from_a_run_replaces_the_calibrations_phases(tmp_path):
    network_run = Run.load(results_file(tmp_path, "ar.json", batch_ms=80.0))
    device = json.loads(open(results_file(tmp_path, "gpu.json", hook="noop", trainers=1, limits=False)).read())
    device["summary"] = [{"role": "trainer", "metric": metric, "p50": value}
                         for metric, value in (("batch", 7.0), ("forward", 2.0), ("backward", 4.0),
                                               ("optimizer", 1.0))]
    del device["timeline"]
    (tmp_path / "gpu.json").write_text(json.dumps(device))
    calibration = calibrate([network_run], compute=Run.load(str(tmp_path / "gpu.json")))
    assert calibration.phases == Phases(2.0, 4.0, 1.0)
    # two 10 MB buckets: ready at half and all of backward
    assert [bucket.ready_ms for bucket in calibration.buckets] == pytest.approx([2.0, 4.0])


def test_a_run_on_one_emulated_host_calibrates_the_local_link(tmp_path):
    one_host = results_file(tmp_path, "one.json", env={"emulated": {"placement": [[0, 1, 2]], "link_rate_bps": 1e9}})
    apart = results_file(tmp_path, "apart.json", env={"emulated": {"placement": [[0], [1, 2]], "link_rate_bps": 1e9}},
                         limits=True)
    data = json.loads(open(one_host).read())
    data["limits"]["link"] = {"latency_us": 1.0, "bandwidth_gbit_s": 80.0}
    (tmp_path / "one.json").write_text(json.dumps(data))
    calibration = calibrate([Run.load(one_host), Run.load(apart)])
    assert calibration.intra_link == Link.of(1.0, 80.0) and calibration.link == Link.of(10.0, 8.0)
    assert Run.load(one_host).per_host == 2 and Run.load(apart).per_host == 1


def ds_config(folder, config) -> str:
    path = folder / "ds_config.json"
    path.write_text(json.dumps(config))
    return str(path)


def other_model(folder) -> str:
    path = results_file(folder, "other.json", hook="noop", trainers=1)
    data = json.loads(open(path).read())
    data["config"]["model"] = "DummyModelSmall"
    open(path, "w").write(json.dumps(data))
    return path


BAD_INPUTS = [
    (lambda p: [results_file(p), "--per-node", "0"], "--per-node must be at least 1"),
    (lambda p: [results_file(p), "--per-node", "4", "--trainers", "6"], "--per-node 4 does not divide --trainers 6"),
    (lambda p: [results_file(p), "--per-node", "2", "--intra-link", "-5gbit"], "--intra-link must be at least 1kbit; got '-5gbit'"),
    (lambda p: [results_file(p), "--per-node", "2", "--intra-link", "900"], "--intra-link: expected a rate"),
    (lambda p: [results_file(p), "--per-node", "2"], "--per-node 2: no local link between a node's trainers"),
    (lambda p: ["--compute-ms", "forward=1,backward=2", "--model", "resnet18", "--batch-size", "8", "--link",
                "10gbit"], "--compute-ms: missing optimizer"),
    (lambda p: ["--compute-ms", "forward=1,backward=2,optimizer=1"], "give --model, --batch-size, --link too"),
    (lambda p: [results_file(p), "--compute", other_model(p)], "give a run of the same model and batch size"),
    (lambda p: [], "predict needs results files to calibrate on"),
    (lambda p: [results_file(p), "--servers-on", "nearby"], "--servers-on: 'nearby' is not one of"),
    (lambda p: [results_file(p), "--nodes", "2", "--trainers", "4"], "give --trainers or --nodes"),
    (lambda p: [results_file(p), "--ds-config", str(p / "none.json")], "--ds-config"),
    (lambda p: [results_file(p), "--ds-config", ds_config(p, {"zero_optimization": {"stage": 0}})],
     "zero_optimization.stage must be 1, 2 or 3 (a deepspeed_zero hook's); got 0"),
    (lambda p: [results_file(p), "--ds-config", ds_config(p, {"bf16": {"enabled": True}, "fp16": {"enabled": True}})],
     "bf16 and fp16 are both enabled"),
    (lambda p: [results_file(p), "--precision", "fp16", "--ds-config", ds_config(p, {"bf16": {"enabled": True}})],
     "--precision fp16 and --ds-config"),
    (lambda p: [results_file(p), "--ds-config", ds_config(p, {"communication_data_type": "int8"})],
     "communication_data_type must be one of fp32, bf16, fp16; got 'int8'"),
    (lambda p: [results_file(p), "--ds-config", ds_config(p, [1])], "must hold a JSON object"),
    # a kind or an efficiency without its rate was passed over: the fitted link stood as measured
    (lambda p: [results_file(p), "--link-kind", "infiniband", "--link-efficiency", "0.9"],
     "--link-kind and --link-efficiency describe --link: give --link RATE too"),
    (lambda p: [results_file(p), "--intra-link-kind", "nvlink"], "--intra-link-kind describes --intra-link: give"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[message[:40] for _, message in BAD_INPUTS])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys):
    assert main(["predict", *argv(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_fsdp_and_hsdp_on_one_node_are_predicted_alike(tmp_path, capsys):
    """On one node HSDP's mesh is one row: it shards over the node's trainers as FSDP2 does, the
    same gathers and the same reduce-scatter, each unit's as backward finishes it (predict gave
    FSDP2's reduce-scatter after backward and HSDP's overlapped, and ranked HSDP first). Across
    nodes HSDP sends less over the network, and is faster."""
    out = tmp_path / "predict.json"
    for extra in ([], ["--grad-accum", "3", "--reduce-dtype", "bf16"]):  # gathers each micro-batch
        assert main(["predict", "--model", "resnet50", "--batch-size", "64", "--compute-ms",
                     "forward=80,backward=160,optimizer=5", "--nodes", "1,4", "--per-node", "8",
                     "--intra-link", "1200gbit", "--intra-link-kind", "nvlink", "--link", "100gbit",
                     "--link-kind", "infiniband", "--hooks", "fsdp,hsdp", "--out", str(out), *extra]) == 0
        batch = {(row["nodes"], row["strategy"]): row["batch_ms"]
                 for row in json.loads(out.read_text())["predictions"]}
        assert batch[1, "fsdp"] == pytest.approx(batch[1, "hsdp"]), extra
        assert batch[4, "hsdp"] < batch[4, "fsdp"]
    capsys.readouterr()


def test_predict_with_micro_batches_computes_each_and_sends_as_each_engine_does(tmp_path, capsys):
    """--grad-accum 4: all-reduce's buckets once a step, after 3 more micro-batches of forward and
    backward; FSDP2's parameters gathered for every micro-batch, its gradients reduced once;
    --reduce-dtype bf16 halves what FSDP2 sends and leaves all-reduce as it was."""
    def rows(*extra: str) -> dict:
        out = tmp_path / "predict.json"
        assert main(["predict", "--model", "resnet18", "--batch-size", "32", "--compute-ms",
                     "forward=30,backward=60,optimizer=5", "--link", "10gbit", "--trainers", "8",
                     "--hooks", "allreduce,fsdp", "--out", str(out), *extra]) == 0
        return {row["strategy"]: row for row in json.loads(out.read_text())["predictions"]}
    one, four, half = rows(), rows("--grad-accum", "4"), rows("--grad-accum", "4", "--reduce-dtype", "bf16")
    assert four["allreduce"]["batch_ms"] == pytest.approx(one["allreduce"]["batch_ms"] + 3 * (30 + 60))
    assert four["allreduce"]["samples_per_s"] > one["allreduce"]["samples_per_s"]
    # FSDP2's two gathers every micro-batch, after backward; its reduce-scatter once a step, bucket
    # by bucket as backward goes (as hsdp's), its end the same for one micro-batch or four
    assert four["fsdp"]["sends_ms"] == pytest.approx(4 * one["fsdp"]["sends_ms"])
    assert four["fsdp"]["communication_end_ms"] == pytest.approx(one["fsdp"]["communication_end_ms"])
    assert half["fsdp"]["sends_ms"] == pytest.approx(four["fsdp"]["sends_ms"] / 2, rel=0.05)
    assert half["allreduce"]["batch_ms"] == four["allreduce"]["batch_ms"]
    capsys.readouterr()
    assert main(["predict", "--model", "resnet18", "--batch-size", "32", "--compute-ms",
                 "forward=30,backward=60,optimizer=5", "--link", "10gbit", "--grad-accum", "0"]) == 2
    assert "--grad-accum must be at least 1" in capsys.readouterr().err


def test_only_runs_of_as_many_micro_batches_stand_beside_a_prediction(tmp_path, capsys):
    """predict --grad-accum 4: a run of one micro-batch a step (the calibration's) is no
    measurement of it (all-reduce on DummyModel at 1 Gbit/s read +48.7 % against its own
    calibration run); a --compare run of 4 is."""
    results_file(tmp_path, "ar.json")
    accumulated = json.loads((tmp_path / "ar.json").read_text())
    accumulated["config"]["grad_accum"] = 4
    (tmp_path / "ar-4.json").write_text(json.dumps(accumulated))
    out = tmp_path / "predict.json"
    measured = []
    for extra in ([], ["--grad-accum", "4"], ["--grad-accum", "4", "--compare", str(tmp_path / "ar-4.json")]):
        out.unlink(missing_ok=True)
        assert main(["predict", str(tmp_path / "ar.json"), "--trainers", "2", "--hooks", "allreduce",
                     "--out", str(out), *extra]) == 0
        [row] = json.loads(out.read_text())["predictions"]
        measured.append((row["measured_ms"], row.get("calibration")))
    capsys.readouterr()
    assert measured == [(100.0, True), (None, None), (100.0, False)]


def test_server_counts_the_nodes_cannot_hold_colocated_are_named(tmp_path, capsys):
    """Co-located servers sit as many on every node: a given count the nodes cannot share is
    said to be left out, with what was predicted in its place (one a node where none fits)."""
    assert colocated_counts([3, "auto", 4, 8], 4) == ([4, 8], [3])
    assert colocated_counts([1], 2) == ([], [1])
    assert unplaced([4, 8], [8, 16], 4) is None  # 2 and 4 nodes both hold 4 and 8
    out = tmp_path / "predict.json"
    assert main(["predict", "--model", "resnet18", "--batch-size", "8", "--compute-ms",
                 "forward=10,backward=20,optimizer=1", "--link", "10gbit", "--hooks", "ps",
                 "--servers", "3", "--servers-on", "colocated", "--nodes", "2,3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 nodes cannot hold 3 (predicted with 2)" in printed and "3 nodes cannot" not in printed
    assert [(r["trainers"], r["servers"]) for r in json.loads(out.read_text())["predictions"]] == [(2, 2), (3, 3)]


def test_auto_servers_on_the_nodes_are_the_best_of_1_2_4_a_node(tmp_path, capsys):
    """``--servers auto`` co-located tries 1, 2, 4, ... servers on every node, up to its trainers,
    and keeps the shortest, as the rows of those counts predict them."""
    out = tmp_path / "predict.json"
    common = ["predict", "--model", "resnet18", "--batch-size", "8", "--compute-ms", "forward=10,backward=20,optimizer=1",
              "--link", "10gbit", "--per-node", "4", "--intra-link", "1000gbit", "--nodes", "2", "--hooks", "ps",
              "--servers-on", "colocated", "--out", str(out)]
    assert main([*common, "--servers", "2,4,8"]) == 0
    each = {r["servers"]: r["batch_ms"] for r in json.loads(out.read_text())["predictions"]}
    assert main([*common, "--servers", "auto"]) == 0
    auto, = json.loads(out.read_text())["predictions"]
    assert auto["auto"] is True and auto["servers_on"] == "colocated"
    assert auto["servers"] == min(each, key=each.get) and auto["batch_ms"] == each[auto["servers"]]
    capsys.readouterr()


def test_an_intra_link_with_one_trainer_a_node_is_said_to_carry_nothing(capsys):
    """--intra-link without --per-node was taken and crossed by nothing, unsaid."""
    common = ["predict", "--compute-ms", "forward=10,backward=20,optimizer=1", "--model", "resnet18",
              "--batch-size", "32", "--link", "10gbit", "--intra-link", "100gbit", "--hooks", "allreduce"]
    assert main([*common, "--trainers", "8"]) == 0
    assert "note: --intra-link is the link between a node's trainers: with one trainer a node" in \
        capsys.readouterr().out
    assert main([*common, "--trainers", "8", "--per-node", "4"]) == 0
    assert "nothing crosses it" not in capsys.readouterr().out


def test_zero3_is_predicted_gathering_again_what_deepspeed_releases(tmp_path, capsys):
    """DeepSpeed's ZeRO-3 keeps a parameter gathered from forward to backward only within its
    reuse distance (1e9 elements) or its prefetch: on Llama 3 8B it gathers most of the parameters
    again for backward, as FSDP2 gathers all of them twice (predict counted it once, and ranked
    it first by that gather); on ResNet-50 it keeps them all. Both reduce-scatter in their
    engines' buckets, FSDP2 unit by unit, ZeRO-3 in 5e8 elements, as backward fills them."""
    out = tmp_path / "predict.json"
    common = ["--batch-size", "1", "--compute-ms", "forward=50,backward=100,optimizer=5", "--link",
              "100gbit", "--trainers", "16", "--hooks", "fsdp,deepspeed_zero3", "--out", str(out)]
    assert main(["predict", "--model", "hf:llama3-8b", *common]) == 0
    printed = capsys.readouterr().out
    saved = json.loads(out.read_text())
    share = saved["calibration"]["regathered"]["deepspeed_zero3"]
    assert 0.8 < share < 1.0
    assert f"parameters gathered again in a step: deepspeed_zero3 {share:.1%}" in printed
    units = model_buckets("hf:llama3-8b", 25.0)[3]
    assert saved["calibration"]["bucket_elements"] == {
        "fsdp": units.largest_unit, "deepspeed_zero3": 5 * 10 ** 8}
    rows = {row["strategy"]: row for row in saved["predictions"]}
    assert 0.9 * rows["fsdp"]["sends_ms"] < rows["deepspeed_zero3"]["sends_ms"] < rows["fsdp"]["sends_ms"]

    out.unlink()
    assert main(["predict", "--model", "resnet50", *common[:-3], "fsdp,deepspeed_zero2,deepspeed_zero3",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    saved = json.loads(out.read_text())
    assert saved["calibration"]["regathered"] == {"deepspeed_zero3": 0.0}
    # DeepSpeed's overlap_comm, on by default at stage 3 only: ZeRO-2 reduces after backward
    assert saved["calibration"]["overlaps"] == {"deepspeed_zero2": False, "deepspeed_zero3": True}
    rows = {row["strategy"]: row for row in saved["predictions"]}
    assert rows["deepspeed_zero2"]["communication_end_ms"] == 0 < rows["deepspeed_zero3"]["communication_end_ms"]


def test_an_engines_runs_neither_size_nor_time_the_models_compute(tmp_path, capsys):
    """An engine run (ZeRO-3) builds no DDP buckets and its forward holds its gathers: given
    first, predict took its buckets (none: every strategy predicted sending nothing) and pooled
    its forward with the others'. The model's compute and buckets come from the runs whose
    strategies communicate in backward's hooks alone, for the engine's own compute too; runs
    with no DDP buckets at all are one line and exit 2."""
    results_file(tmp_path, "ar.json")
    engine = json.loads((tmp_path / "ar.json").read_text())
    engine["config"].update(hook="deepspeed_zero3", model_size={"ddp_buckets": []})
    engine["summary"] = [{**row, "p50": 60.0} if row["metric"] == "forward" else row
                         for row in engine["summary"]]
    del engine["timeline"]
    (tmp_path / "z3.json").write_text(json.dumps(engine))
    predicted = {}
    for name, files in (("alone", ["ar.json"]), ("beside", ["z3.json", "ar.json"])):
        out = tmp_path / f"{name}.json"
        assert main(["predict", *(str(tmp_path / f) for f in files), "--trainers", "8",
                     "--hooks", "allreduce", "--out", str(out)]) == 0
        predicted[name] = json.loads(out.read_text())
    for key in ("buckets", "phases_ms"):
        assert predicted["beside"]["calibration"][key] == predicted["alone"]["calibration"][key]
    assert predicted["beside"]["predictions"] == predicted["alone"]["predictions"]
    assert ("the model's compute is that of the runs of allreduce: the forward or step of "
            "deepspeed_zero3 holds its own communication") in predicted["beside"]["calibration"]["notes"]
    # HSDP's forward gathers within the node though its record sends nothing besides its buckets
    assert not Run.load(results_file(tmp_path, "hsdp.json", hook="hsdp")).computes_alone
    assert predicted["alone"]["predictions"][0]["communication_end_ms"] > 0
    # its own compute: its run against the model's compute and its sends, its gathers not
    # counted twice (in its forward and in its sends: it fitted below 0, taken as 0)
    calibration = calibrate([Run.load(str(tmp_path / "z3.json")), Run.load(str(tmp_path / "ar.json"))])
    modelled = predict(calibration, "deepspeed_zero3", 2, 0, own=False)["batch_ms"]
    assert calibration.own_ms["deepspeed_zero3"] == pytest.approx(100.0 - modelled) and modelled < 100.0
    capsys.readouterr()
    assert main(["predict", str(tmp_path / "ar.json"), "--compute", str(tmp_path / "z3.json")]) == 2
    assert "--compute " + str(tmp_path / "z3.json") + " is a run of deepspeed_zero3, whose forward" in (
        capsys.readouterr().err)
    assert main(["predict", str(tmp_path / "z3.json"), "--trainers", "8"]) == 2
    assert capsys.readouterr().err == (
        "ps_bench: error: no gradient buckets to predict with: the runs given (deepspeed_zero3) "
        "built no DDP buckets (strategies that wrap the model in an engine of their own): give a "
        "run of allreduce beside them\n")


def test_deepspeed_is_predicted_moving_the_dtype_it_casts_the_model_to(tmp_path, capsys):
    """DeepSpeed with bf16 enabled casts the model: it gathers the parameters and reduces the
    gradients in bf16 (these in its communication_data_type where the config has one), as its
    runs count their bytes; torch's strategies under --precision bf16 run autocast over float32
    and send float32 unless --reduce-dtype, which FSDP2 gathers in too. predict sent float32 for
    DeepSpeed whatever it trained in."""
    assert wire_dtypes(None) == ("float32", "float32")
    assert wire_dtypes(None, "bf16") == ("bfloat16", "bfloat16")
    assert wire_dtypes({"bf16": {"enabled": True}, "communication_data_type": "fp32"}) == (
        "float32", "bfloat16")
    out = tmp_path / "predict.json"

    def sends(*extra: str) -> dict[str, float]:
        out.unlink(missing_ok=True)
        assert main(["predict", "--model", "resnet18", "--batch-size", "8", "--compute-ms",
                     "forward=50,backward=100,optimizer=5", "--link", "10gbit", "--trainers", "16",
                     "--hooks", "fsdp,deepspeed_zero3", "--out", str(out), *extra]) == 0
        capsys.readouterr()
        return {row["strategy"]: row["sends_ms"] for row in json.loads(out.read_text())["predictions"]}

    fp32, bf16 = sends(), sends("--precision", "bf16")
    reduced = sends("--precision", "bf16", "--reduce-dtype", "bf16")
    assert bf16["deepspeed_zero3"] == pytest.approx(fp32["deepspeed_zero3"] / 2, rel=0.02)
    assert bf16["fsdp"] == fp32["fsdp"]
    assert reduced["fsdp"] == pytest.approx(fp32["fsdp"] / 2, rel=0.02)
    assert reduced["deepspeed_zero3"] == bf16["deepspeed_zero3"]
    # a run's --reduce-dtype is what its strategy is predicted moving, unless predict's says
    fsdp = json.loads(open(results_file(tmp_path, "fsdp.json", hook="fsdp")).read())
    fsdp["config"]["reduce_dtype"] = "bf16"
    runs = [Run.of(fsdp, "fsdp.json"), Run.load(results_file(tmp_path, "ar.json"))]
    calibration = calibrate(runs)
    assert calibration.wire(HOOKS.record("fsdp"), "fsdp") == ("bfloat16", "bfloat16")
    calibration.reduce_dtype = "fp32"
    assert calibration.wire(HOOKS.record("fsdp"), "fsdp") == ("float32", "float32")


def test_deepspeed_is_predicted_at_your_ds_config(tmp_path, capsys):
    """predict --ds-config: the deepspeed_zero hook of the config's stage is costed at its ZeRO
    settings, the precision it enables and its communication_data_type, its "auto" values as a
    run takes them (DeepSpeed's defaults; bf16 "auto": --precision's); the other stages at
    DeepSpeed's defaults, and a run's recorded config over it."""
    out = tmp_path / "predict.json"

    def predicted(*extra: str) -> dict:
        out.unlink(missing_ok=True)
        assert main(["predict", "--model", "resnet18", "--batch-size", "8", "--compute-ms",
                     "forward=50,backward=100,optimizer=5", "--link", "10gbit", "--trainers", "16",
                     "--hooks", "deepspeed_zero2,deepspeed_zero3", "--out", str(out), *extra]) == 0
        capsys.readouterr()
        saved = json.loads(out.read_text())
        return {"rows": {row["strategy"]: row for row in saved["predictions"]}, **saved["calibration"]}

    config = ds_config(tmp_path, {"zero_optimization": {"stage": 3, "reduce_bucket_size": 10 ** 6,
                                                        "overlap_comm": "auto"},
                                  "bf16": {"enabled": "auto"}, "train_batch_size": "auto"})
    defaults, yours = predicted("--precision", "bf16"), predicted("--precision", "bf16", "--ds-config", config)
    assert yours["bucket_elements"] == {**defaults["bucket_elements"], "deepspeed_zero3": 10 ** 6}
    assert yours["overlaps"] == defaults["overlaps"] == {"deepspeed_zero2": False, "deepspeed_zero3": True}
    assert yours["rows"]["deepspeed_zero2"] == defaults["rows"]["deepspeed_zero2"]
    # smaller buckets, reduced sooner as backward goes on
    assert yours["rows"]["deepspeed_zero3"]["batch_ms"] < defaults["rows"]["deepspeed_zero3"]["batch_ms"]
    # the precision it enables is the prediction's: DeepSpeed moves and the memory counts bf16
    enables = ds_config(tmp_path, {"bf16": {"enabled": True}})
    assert predicted("--ds-config", enables)["rows"] == predicted("--precision", "bf16")["rows"]
    reduces = ds_config(tmp_path, {"bf16": {"enabled": True}, "communication_data_type": "fp32"})
    sends = predicted("--ds-config", reduces)
    assert sends["rows"]["deepspeed_zero2"]["sends_ms"] > defaults["rows"]["deepspeed_zero2"]["sends_ms"]
    # what each is predicted sending, where not float32, in the calibration (and printed)
    assert sends["wires"] == {hook: ["float32", "bfloat16"] for hook in ("deepspeed_zero2", "deepspeed_zero3")}
    assert defaults["wires"] == {hook: ["bfloat16", "bfloat16"] for hook in ("deepspeed_zero2", "deepspeed_zero3")}
    assert predicted()["wires"] == {}


def test_an_engines_buckets_are_filled_as_backward_makes_the_gradients_ready():
    """DeepSpeed's rule: a bucket is reduced when the next gradient would take it past its size."""
    ready = [(1.0, 40.0, False, 1), (2.0, 40.0, False, 2), (3.0, 40.0, False, 1), (4.0, 100.0, False, 3)]
    # (ready ms, bytes, sparse, tensors)
    assert engine_buckets(ready, 20) == [(2.0, 80.0, False, 3), (3.0, 40.0, False, 1), (4.0, 100.0, False, 3)]
    assert engine_buckets(ready, 5) == ready  # no bucket smaller than DDP's
    assert engine_buckets(ready, 10 ** 9) == [(4.0, 220.0, False, 7)]


def test_daly_gives_the_published_checkpoint_intervals():
    """Daly (2006): for a checkpoint of 5 minutes, 117, 57 and 9.1 minutes at a mean time to
    failure of 24 h, 6 h and 15 minutes (his higher-order estimate); Young's first order, sqrt(2δM)."""
    from ps_bench.predict.goodput import daly_interval_s, young_interval_s

    minutes = [daly_interval_s(300.0, mtbf * 60.0) / 60.0 for mtbf in (24 * 60, 6 * 60, 15)]
    assert minutes == pytest.approx([117, 57, 9.1], abs=1.0)
    assert young_interval_s(300.0, 6 * 3600.0) == pytest.approx(3600.0)
    assert daly_interval_s(700.0, 300.0) == 300.0  # δ beyond 2M: checkpoint every M


def test_what_a_failure_costs_each_way_of_recovering():
    from ps_bench.predict.goodput import elastic_ettr, heal_ettr, restart_ettr

    # no failure to speak of: only the checkpoints' own cost, τ / (τ + δ)
    assert restart_ettr(600.0, 6.0, 0.0, 1e12) == pytest.approx(600 / 606, rel=1e-6)
    # Daly's eq. 13 at τ = 1 h, δ = 5 min, R = 10 min, M = 6 h
    expected = 3600 / (21600 * math.exp(600 / 21600) * math.expm1(3900 / 21600))
    assert restart_ettr(3600.0, 300.0, 600.0, 21600.0) == pytest.approx(expected) == pytest.approx(0.819, abs=0.001)
    # torchft: 30 groups, a failure a minute, steps of 10.9 s, a group back in 6 s
    assert heal_ettr(5.0, 1.0, 30, 10.9, 60.0) == pytest.approx(1 - (10.9 + 6 / 30) / 60)
    assert elastic_ettr(60.0, 10, 600.0) == pytest.approx(0.99)
    assert heal_ettr(600.0, 0.0, 1, 10.0, 60.0) == 0.0  # never back before the next failure


@pytest.mark.parametrize("argv, words", [
    (["--mtbf", "0"], "--mtbf must be a positive number with a unit of ms, s, min or h"),
    (["--mtbf", "abc"], "--mtbf must be a positive number with a unit"),
    (["--mtbf", "5000h", "--checkpoint-time", "30"], "--checkpoint-time must be a positive number with a unit"),
    (["--mtbf", "5000h", "--node-mtbf", "600h"], "give --mtbf (one GPU's) or --node-mtbf (one node's), not both"),
    (["--restart-time", "5min"], "--restart-time costs failures: give --mtbf"),
    (["--mtbf", "5000h", "--checkpoint-time", "30s"], "--mtbf: give --restart-time"),
])
def test_bad_goodput_input_is_one_line_and_exit_2(argv, words, capsys, tmp_path):
    from ps_bench.cli import main

    base = ["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms",
            "forward=10,backward=20,optimizer=1", "--link", "10gbit", "--trainers", "8"]
    assert main([*base, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and words in captured.err, captured.err


def run_with_recovery(tmp_path, recovery: dict) -> str:
    """A made-up run of DummyModel's 20 MB of gradients (its two buckets) with this recovery
    block."""
    from tests.unit.test_predict import MB, results_file

    run = results_file(tmp_path, recovery=recovery)
    data = json.loads(open(run).read())
    data["config"]["model_size"]["dense_gradient_bytes"] = 20 * MB
    Path(run).write_text(json.dumps(data))
    return run


def test_goodput_at_each_point_from_a_runs_own_checkpoint_and_recovery(tmp_path, capsys):
    """A run made with --checkpoint-every that torchrun restarted gives the checkpoint's cost
    (its trainers' write rate, scaled to each trainer's share) and the restart (its recovery);
    the cluster's mean time between failures is one GPU's over the GPUs."""
    from ps_bench.cli import main
    from ps_bench.predict.goodput import daly_interval_s, restart_ettr

    recovery = {"checkpoints": {"bytes": 40e6, "bytes_per_s_per_trainer": 1e6, "save_s_p50": 20.0},
                "failures": [{"recovery_s": 90.0}, {"recovery_s": 110.0}, {"recovery_s": 400.0}]}
    run = run_with_recovery(tmp_path, recovery)
    out = tmp_path / "p.json"
    assert main(["predict", run, "--trainers", "2,64", "--hooks", "allreduce", "--mtbf", "1000h",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "restart 110.0 s (the median recovery of 3 failures in the runs given)" in printed
    assert "most goodput at 64 trainers: allreduce" in printed
    rows = {row["trainers"]: row for row in json.loads(out.read_text())["predictions"]}
    for n, row in rows.items():
        mtbf = 1000 * 3600 / n
        delta = 40e6 / n / 1e6  # each trainer's share of the same model, at 1 MB/s
        assert row["mtbf_s"] == pytest.approx(mtbf) and row["checkpoint_s"] == pytest.approx(delta)
        assert row["checkpoint_interval_s"] == pytest.approx(daly_interval_s(delta, mtbf))
        assert row["ettr"] == pytest.approx(restart_ettr(row["checkpoint_interval_s"], delta, 110.0, mtbf))
        assert row["goodput_samples_per_s"] == pytest.approx(row["samples_per_s"] * row["ettr"])
    assert rows[64]["ettr"] < rows[2]["ettr"] < 1
    assert json.loads(out.read_text())["goodput_winners"][0]["strategy"] == "allreduce"


def test_a_checkpoint_written_by_an_earlier_attempt_costs_the_checkpoint(tmp_path, capsys):
    """The attempt that finished saved nothing (each failed before its interval came round):
    the write rate is an earlier attempt's, from the rounds it kept."""
    from ps_bench.cli import main

    earlier = {"recovery": {"checkpoints": {"bytes": 40e6, "bytes_per_s_per_trainer": 2e6}}}
    recovery = {"checkpoints": {"bytes": None, "bytes_per_s_per_trainer": None, "saves": 0},
                "failures": [{"recovery_s": 60.0}],
                "attempts": [{"attempt": 0, "results": earlier}, {"attempt": 1}]}
    run = run_with_recovery(tmp_path, recovery)
    out = tmp_path / "p.json"
    assert main(["predict", run, "--trainers", "4", "--hooks", "allreduce", "--mtbf", "1000h",
                 "--out", str(out)]) == 0
    assert "at 2.0 MB/s" in capsys.readouterr().out
    row, = json.loads(out.read_text())["predictions"]
    assert row["checkpoint_s"] == pytest.approx(40e6 / 4 / 2e6, rel=0.01)
