"""The compressors (``ps_bench.strategies.compressors``), each on an example worked by hand: the
message's bytes as its record's formula gives them, what it decodes to, and error feedback."""

from __future__ import annotations

import pytest
import torch

from ps_bench.cli import main
from ps_bench.strategies import HOOKS
from ps_bench.strategies.compressors import (QSGD, Int8, RandomK, Signs, TopK, pack_signs,
                                             unpack_signs)

X = torch.tensor([1.0, -3.0, 2.0, -0.5])


def roundtrip(codec, x: torch.Tensor, sizes=None, seed: int = 7):
    message = codec.encode(x, seed, 0, sizes or [x.numel()])
    assert message.dtype == torch.uint8
    return message, codec.decode(message, x.numel(), seed, sizes or [x.numel()])


def test_topk_keeps_the_largest_magnitudes_with_their_indices():
    message, decoded = roundtrip(TopK(0.5), X)  # k = 2: -3 at 1 and 2 at 2
    assert message.numel() == TopK(0.5).message_bytes(4) == 2 * (4 + 4)
    assert decoded.tolist() == [0.0, -3.0, 2.0, 0.0]
    assert roundtrip(TopK(1.0), X)[1].tolist() == X.tolist()
    assert TopK(0.01).k(800) == 8 and TopK(0.001).k(10) == 1  # at least one value


def test_randomk_sends_values_only_at_places_every_trainer_draws_alike():
    codec = RandomK(0.5)
    message, decoded = roundtrip(codec, X)
    places = codec.places(4, 7, X.device)
    assert message.numel() == codec.message_bytes(4) == 2 * 4
    assert torch.equal(places, codec.places(4, 7, X.device)) and places.numel() == 2
    kept = torch.zeros(4, dtype=torch.bool)
    kept[places] = True
    assert decoded[kept].tolist() == X[kept].tolist() and decoded[~kept].tolist() == [0.0, 0.0]


def test_signs_are_one_bit_a_value_and_a_scale():
    assert pack_signs(X).tolist() == [0b10100000]  # + - + -, padded with zeros
    assert unpack_signs(torch.tensor([0b10100000], dtype=torch.uint8), 4).tolist() == [1, -1, 1, -1]
    message, decoded = roundtrip(Signs(False), X)  # scale: mean |x| = 6.5 / 4
    assert message.numel() == Signs(False).message_bytes(4) == 1 + 4
    assert decoded.tolist() == [1.625, -1.625, 1.625, -1.625]
    message, decoded = roundtrip(Signs(True), X, sizes=[2, 2])  # a scale a tensor: 2 and 1.25
    assert message.numel() == Signs(True).message_bytes(4, tensors=2) == 1 + 2 * 4
    assert decoded.tolist() == [2.0, -2.0, 1.25, -1.25]
    assert Signs(False).message_bytes(800) == 100 + 4


def test_qsgd_levels_of_the_norm_unbiased():
    x = torch.tensor([3.0, -4.0])  # norm 5: on 5 levels exactly 3 and 4, nothing to round
    message, decoded = roundtrip(QSGD(5), x)
    assert message.numel() == QSGD(5).message_bytes(2) == 2 + 4
    assert decoded.tolist() == [3.0, -4.0]
    # on one level, 3 goes to 5 with chance 3/5 and to 0 otherwise: the mean is 3
    codec, y = QSGD(1), torch.tensor([3.0, -4.0])
    mean = sum(codec.decode(codec.encode(y, seed, 0, [2]), 2, seed, [2]) for seed in range(4000)) / 4000
    assert mean.tolist() == pytest.approx([3.0, -4.0], abs=0.15)
    assert QSGD(1000).message_bytes(10) == 2 * 10 + 4  # more than 127 levels: two bytes a value


def test_int8_rounds_to_255_levels_of_the_largest_magnitude():
    x = torch.tensor([1.27, -0.635, 0.0])  # scale 0.01: 127, -63.5 -> -64 (half to even), 0
    message, decoded = roundtrip(Int8(), x)
    assert message.numel() == Int8().message_bytes(3) == 3 + 4
    assert decoded.tolist() == pytest.approx([1.27, -0.64, 0.0])


def test_each_compressor_names_its_formula_in_its_record():
    for name, options, n, expected in (("topk", {"ratio": 0.01}, 800, 64),
                                       ("randomk", {"ratio": 0.01}, 800, 32),
                                       ("signsgd", {"per_tensor": False}, 800, 104),
                                       ("qsgd", {"levels": 127}, 800, 804), ("int8", {}, 800, 804)):
        record = HOOKS.record(name)
        assert record.payload == "compressed" and not record.lossless
        assert record.compressor(options).message_bytes(n) == expected
        through_servers = HOOKS.record("ps_compressed").compressor(
            {"compressor": name, "ratio": 0.01, "levels": 127, "per_tensor": False})
        assert through_servers.message_bytes(n) == expected


@pytest.mark.parametrize("hook, option, words", [
    ("topk", "ratio=0", "hook option 'ratio' must be above 0 and at most 1; got 0.0"),
    ("topk", "ratio=1.5", "hook option 'ratio' must be above 0 and at most 1; got 1.5"),
    ("randomk", "ratio=-0.1", "hook option 'ratio' must be above 0 and at most 1"),
    ("qsgd", "levels=0", "hook option 'levels' must be 1 to 32767; got 0"),
    ("ps_compressed", "compressor=zip", "hook option 'compressor' must be one of topk, randomk"),
    ("ps_compressed", "ratio=2", "hook option 'ratio' must be above 0 and at most 1; got 2.0"),
])
def test_bad_compressor_options_are_one_line_exit_2(hook, option, words, capsys):
    servers = "1" if hook.startswith("ps_") else "0"
    assert main(["--hook", hook, "--nserver", servers, "--hook-option", option, "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and words in captured.err, captured.err


def test_predict_costs_the_compressed_messages_both_routes():
    """All-gathered, a bucket costs the all-gather of its message; through the servers, its
    message each way: both far below their dense counterparts on a slow link, and the
    all-gather's cost grows with the trainers where the servers' per trainer does not."""
    from ps_bench.metrics.costs import Link, allgather_ms
    from ps_bench.predict.calibration import from_compute_ms
    from ps_bench.predict.pipelines import Phases
    from ps_bench.predict.predictor import predict

    link = Link(0.05, 100e6 / 8 / 1e3)  # 100 Mbit/s, 50 us
    mb = 2 ** 20
    calibration = from_compute_ms("m", 8, Phases(1.0, 2.0, 0.5), [(4 * mb, False)], link, "test")
    batch = {hook: predict(calibration, hook, 4, 1)["batch_ms"]
             for hook in ("allreduce", "topk", "ps", "ps_compressed")}
    assert batch["topk"] < batch["allreduce"] / 10 and batch["ps_compressed"] < batch["ps"] / 10
    message = TopK(0.01).message_bytes(mb)
    assert predict(calibration, "topk", 4, 1)["communication_end_ms"] == pytest.approx(
        2.0 + allgather_ms(4, message, link), rel=1e-6)
