"""benchmarks/published_check.py: the published cases, read as a reader would check them, and
one case predicted for real (``bench.py predict`` as a user runs it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.benchrun import ROOT


def load_check():
    spec = importlib.util.spec_from_file_location("published_check", ROOT / "benchmarks" / "published_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_case_names_its_source_setup_and_a_baseline():
    check = load_check()
    assert len({case.table_name for case in check.CASES}) >= 6  # six published tables at least
    points = sum(1 for case in check.CASES for gpus in case.measured if gpus > 1)
    assert points >= 25
    # tables, not columns: two systems of one table are one table
    transformers = {case.table_name for case in check.CASES if case.model.startswith("hf:") and case.link_gbit <= 100}
    assert len(transformers) >= 2
    assert any(case.model_options and case.model.startswith("hf:gpt") for case in check.CASES)  # a GPT-class one
    compared = {case.cluster: set() for case in check.CASES if case.cluster}
    for case in check.CASES:
        if case.cluster:
            compared[case.cluster].add(case.hook)
    assert any({"allreduce", "ps_node"} <= hooks for hooks in compared.values())  # BytePS beside all-reduce
    assert any(case.link_gbit <= 25 and max(case.measured) > case.per_node for case in check.CASES)
    assert any(case.servers_on for case in check.CASES)  # a parameter-server system
    for case in check.CASES:  # a baseline: one GPU, or one whole node with no network
        assert case.source and case.setup and (1 in case.measured or case.node) and len(case.measured) >= 2
        assert all(gpus % case.per_node == 0 for gpus in case.measured if gpus > 1)


def test_a_communication_bound_case_is_predicted_within_a_fifth():
    """BERT-Base on 2 nodes of 8 V100s over 100 Gb/s InfiniBand scaled to 81.4 % (NVIDIA's BERT in
    PyTorch all-reduces every gradient once backward is over): its prediction is within 20 % of
    the published throughput, and communication is a large share of the predicted batch."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "published_check.py"), "--case",
                           "dlperf-pytorch-bert"], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines()
               if line.startswith("| dlperf-pytorch-bert") and line.split("|")[2].strip() == "16")
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    measured, predicted, share = float(cells[3]), float(cells[4]), float(cells[8].rstrip("%")) / 100
    assert cells[5] == "sentences/s"  # each table's throughput in its own unit
    assert measured == 1499.4
    assert predicted == pytest.approx(measured, rel=0.2)
    assert share > 0.15
    assert "median |error|" in done.stdout and "points on more than one node: median |error|" in done.stdout


def test_a_case_whose_source_measured_a_full_node_is_given_that_nodes_compute_per_gpu():
    """The K80 cases' compute is the single-node table's 8-GPU row per GPU (ResNet-50: 384 img/s
    on 8 GPUs at batch 64, 1333.3 ms); a case without such a table keeps its 1-GPU batch time."""
    check = load_check()
    cases = {case.name: case for case in check.CASES}
    assert cases["tf-k80-resnet50"].t1_ms() == pytest.approx(64 / (384 / 8) * 1000.0)
    vgg = cases["horovod-25g-vgg16"]
    assert vgg.node is None and vgg.t1_ms() == pytest.approx(64 / 130.9 * 1000.0)
    for case in check.CASES:
        if case.node:  # cited, and no faster than its GPUs apart
            assert case.node_source and case.node <= case.per_node * case.measured.get(1, case.node)


def test_the_winner_of_each_point_two_systems_ran_is_compared():
    check = load_check()
    rows = [{"cluster": "c", "gpus": 16, "strategy": "allreduce", "measured": 100.0, "predicted": 90.0},
            {"cluster": "c", "gpus": 16, "strategy": "ps_node", "measured": 130.0, "predicted": 120.0},
            {"cluster": "", "gpus": 16, "strategy": "allreduce", "measured": 1.0, "predicted": 1.0}]
    assert check.winners(rows) == [{"cluster": "c", "gpus": 16, "measured_winner": "ps_node",
                                     "predicted_winner": "ps_node", "gap_pct": pytest.approx(30.0)}]


def test_the_line_share_a_measurement_allows_is_its_least_transfer_over_the_time_beyond_compute():
    """BytePS's cloud, VGG-16 (553,430,176 B of gradients) at 64 GPUs on 20 Gbit/s: Horovod's ring
    moves 2·63/64 of them over each node's link, BytePS with a server machine a node moves them
    once each way; over the measured batch beyond the 8-GPU node's compute, that allows 0.46 and
    0.69 of the line, both under Ethernet's 0.8 in predict. One node crosses no network."""
    check = load_check()
    cases = {case.name: case for case in check.CASES}
    line_bytes_per_ms = 20e9 / 8 / 1000
    for name, moved, expected in (("byteps-20g-vgg16-horovod", 2 * 63 / 64, 0.463),
                                  ("byteps-20g-vgg16-byteps", 1.0, 0.690)):
        case = cases[name]
        beyond_ms = 64 * 64 / case.measured[64] * 1000 - case.t1_ms()
        allowed = check.line_share_allowed(case, 64, 8, 553430176)
        assert allowed == pytest.approx(moved * 553430176 / line_bytes_per_ms / beyond_ms)
        assert allowed == pytest.approx(expected, abs=0.005)
        assert check.out_of_reach({"line_share_allowed": allowed, "link_kind": case.link_kind})
    assert check.line_share_allowed(cases["byteps-20g-vgg16-byteps"], 8, 1, 553430176) is None
    assert not check.out_of_reach({"line_share_allowed": None, "link_kind": "ethernet"})
    assert not check.out_of_reach({"line_share_allowed": 0.85, "link_kind": "ethernet"})


def test_a_16_bit_collective_moves_half_the_gradients_and_its_model_is_the_sources():
    """Megatron-LM's GPT (2,140,385,280 B of float32 gradients, sent in float16: ps_bench's fp16)
    at 16 GPUs on 100 Gb/s: its ring moves 2·15/16 of the half-size gradients over each node's
    link, which allows 0.87 of the line over the batch beyond the 8-GPU node's compute (its
    all-reduce starts once backward is over: nothing overlaps it); its predict command builds the
    source's GPT, not the zoo's."""
    check = load_check()
    case = {case.name: case for case in check.CASES}["dlperf-megatron-gpt"]
    beyond_ms = 2 * 16 / case.measured[16] * 1000 - case.t1_ms()
    allowed = check.line_share_allowed(case, 16, 2, 2140385280)
    assert allowed == pytest.approx(2 * 15 / 16 * 2140385280 / 2 / (100e9 / 8 / 1000) / beyond_ms)
    assert allowed == pytest.approx(0.875, abs=0.005)
    command = check.predict_command(case, [2], ROOT / "unused.json")
    assert command[command.index("--model-option") + 1] == case.model_options
    assert "n_embd=1536" in case.model_options
    assert command[command.index("--sequence-length") + 1] == "2048"
    assert command[command.index("--hooks") + 1] == "fp16"


def test_the_ethernet_what_if_moves_the_ethernet_cases_alone_and_refuses_bad_input(capsys):
    """``--ethernet SHARE,LATENCY`` passes that share and latency to predict for the cases whose
    network is Ethernet, and to no other; a share outside (0, 1] or a latency without its unit is
    refused by the parser (exit 2) before any case is predicted."""
    check = load_check()
    cases = {case.name: case for case in check.CASES}
    setting = check.ethernet_setting("0.5,1ms")
    assert setting == (0.5, "1ms")
    ethernet = check.predict_command(cases["byteps-20g-vgg16-horovod"], [2], ROOT / "unused.json", ethernet=setting)
    assert ethernet[ethernet.index("--link-efficiency") + 1] == "0.5" and ethernet[ethernet.index("--latency") + 1] == "1ms"
    default = check.predict_command(cases["byteps-20g-vgg16-horovod"], [2], ROOT / "unused.json")
    assert "--link-efficiency" not in default and "--latency" not in default
    infiniband = check.predict_command(cases["dlperf-pytorch-bert"], [2], ROOT / "unused.json", ethernet=setting)
    assert "--link-efficiency" not in infiniband and "--latency" not in infiniband
    for bad in ("0,1ms", "1.5,1ms", "0.5,1", "0.5", "half,1ms"):
        with pytest.raises(SystemExit) as stopped:
            check.main(["--ethernet", bad])
        out, err = capsys.readouterr()
        assert stopped.value.code == 2 and "argument --ethernet" in err.splitlines()[-1] and not out


def test_the_headline_gives_the_points_across_nodes_beside_every_point():
    """A point on one node crosses no network, and one given its own measurement as compute is
    off only by the modelled all-reduce within the node: the median over the points on more than
    one node is printed beside the median over all."""
    check = load_check()
    rows = [{"nodes": 1, "error_pct": 0.5, "own_compute": True},
            {"nodes": 1, "error_pct": -1.5, "own_compute": False},
            {"nodes": 2, "error_pct": 4.0, "own_compute": False},
            {"nodes": 4, "error_pct": -8.0, "own_compute": False},
            {"nodes": 8, "error_pct": 20.0, "own_compute": False}]
    summary = check.summarise(rows)
    assert summary["all"] == {"points": 5, "median_pct": 4.0, "largest_pct": 20.0}
    assert summary["nodes_over_one"] == {"points": 3, "median_pct": 8.0, "largest_pct": 20.0}
    assert summary["one_node"] == {"points": 2, "median_pct": 1.0, "largest_pct": 1.5, "own_compute": 1}
    assert check.headline(summary, 2) == (
        "5 points from 2 tables: median |error| 4.0 %, largest 20.0 %; over the 3 points on more than one "
        "node: median |error| 8.0 %, largest 20.0 % (the 2 on one node cross no network, median 1.0 %, 1 of "
        "them given its own measurement as compute)")
