"""The compressors' codecs (``ps_bench.strategies.codecs``), each on an example worked by hand: the
message's bytes as its record's formula gives them, what it decodes to, and error feedback."""

from __future__ import annotations

import pytest
import torch

from ps_bench.cli import main
from ps_bench.strategies import HOOKS
from ps_bench.strategies.codecs import (QSGD, ErrorFeedback, Int8, RandomK, Signs, TopK,
                                        averaged, pack_signs, unpack_signs)

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


# every compressor at settings that give messages of every alignment: signs' ceil(n / 8) + 4 bytes,
# and n + 4 (int8, QSGD up to 127 levels) or 2n + 4 (QSGD above) for odd n
CODEC_CASES = [TopK(0.1), RandomK(0.1), Signs(False), Signs(True), QSGD(127), QSGD(255), Int8()]


@pytest.mark.parametrize("codec", CODEC_CASES, ids=lambda codec: type(codec).__name__ + str(
    getattr(codec, "levels", getattr(codec, "per_tensor", ""))))
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n, sizes", [(945, [585, 81, 9, 270]), (1001, [1001]), (13, [7, 6])])
def test_every_trainers_row_of_an_all_gather_decodes_whatever_the_bucket(codec, world, n, sizes):
    """An all-gather lays the trainers' messages end to end, trainer r's at ``r x message
    bytes``: a row that starts off a multiple of its scale's 4 bytes decodes as the message alone
    does, to the byte count the formula gives, and their average is the mean of each."""
    generator = torch.Generator().manual_seed(n * world)
    grads = [torch.randn(n, generator=generator) for _ in range(world)]
    messages = [codec.encode(grad, 11, rank, sizes) for rank, grad in enumerate(grads)]
    assert all(message.numel() == codec.message_bytes(n, len(sizes)) for message in messages)
    gathered = torch.cat(messages)
    assert any(row.storage_offset() % 4 for row in gathered.view(world, -1)) or \
        codec.message_bytes(n, len(sizes)) % 4 == 0  # the cases include misaligned rows
    alone = [codec.decode(message, n, 11, sizes) for message in messages]
    for rank, row in enumerate(gathered.view(world, -1)):
        assert torch.equal(codec.decode(row, n, 11, sizes), alone[rank])
    assert torch.allclose(averaged(codec, gathered, world, n, 11, sizes),
                          sum(alone) / world, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("codec", [TopK(0.05), Signs(False), QSGD(7)],
                         ids=["topk", "signsgd", "qsgd"])
def test_error_feedback_sends_every_gradient_in_the_end(codec):
    """What error feedback sent over the steps (decoded) and the residual it holds add up to the
    gradients it was given: what compression left out of one step is added to the next, not
    dropped. Without it, top-k's sends miss most of the gradients."""
    n, sizes, feedback = 501, [501], ErrorFeedback()
    generator = torch.Generator().manual_seed(3)
    given = sent = torch.zeros(n)
    plain = torch.zeros(n)
    for step in range(20):
        grad = torch.randn(n, generator=generator)
        message = feedback.encode(codec, 0, grad, step, 0, sizes)
        sent = sent + codec.decode(message, n, step, sizes)
        plain = plain + codec.decode(codec.encode(grad, step, 0, sizes), n, step, sizes)
        given = given + grad
    assert torch.allclose(sent + feedback.residuals[0], given, atol=1e-4)
    assert feedback.kept_bytes() == 4 * n
    if isinstance(codec, TopK):
        assert (plain - given).norm() > 0.5 * given.norm()
        assert (sent - given).norm() < (plain - given).norm()


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


def test_predict_costs_per_tensor_scales_and_dense_answers_as_sent():
    """A bucket's message as it is sent: ``per_tensor`` signs carry a scale for each of the
    bucket's tensors, and ``ps_compressed`` with ``answer=dense`` is answered with the float32
    average, so its answers cross the links at the gradient's size, not the message's."""
    from ps_bench.metrics.costs import Link, allgather_ms
    from ps_bench.predict.calibration import from_compute_ms
    from ps_bench.predict.pipelines import Phases
    from ps_bench.predict.predictor import predict

    link = Link(0.05, 100e6 / 8 / 1e3)  # 100 Mbit/s, 50 us
    n = 2 ** 20  # float32 elements of the one bucket, in 3 tensors, ready when backward ends
    calibration = from_compute_ms("m", 8, Phases(1.0, 2.0, 0.5), [(4 * n, False, 3)], link, "test")
    calibration.options = {"signsgd": {"per_tensor": True},
                           "ps_compressed": {"compressor": "signsgd", "per_tensor": True,
                                             "answer": "dense"}}
    message = n // 8 + 3 * 4
    assert predict(calibration, "signsgd", 4, 0)["communication_end_ms"] == pytest.approx(
        2.0 + allgather_ms(4, message, link), rel=1e-9)
    # one server hears 4 messages, adds them, and answers each trainer with 4n bytes
    expected = 2.0 + 4 * message / link.bytes_per_ms + 4 * 4 * n / link.bytes_per_ms + 2 * 0.05
    assert predict(calibration, "ps_compressed", 4, 1)["communication_end_ms"] == pytest.approx(
        expected, rel=1e-9)
    calibration.options["ps_compressed"]["answer"] = "compressed"
    assert predict(calibration, "ps_compressed", 4, 1)["communication_end_ms"] == pytest.approx(
        2.0 + 8 * message / link.bytes_per_ms + 2 * 0.05, rel=1e-9)


def test_the_floor_of_a_dense_answer_sends_the_message_and_gets_the_gradient_back():
    """``--limits``' messages through the servers are the compressor's bytes as sent (``uint8``)
    and, answered dense, the float32 elements that come back."""
    from ps_bench.metrics.messages import answered_bytes, floor_messages, message_bytes
    from ps_bench.strategies import hook_options

    buckets = [{"index": 0, "bytes": 4 * 945, "sparse": False, "shapes": [[585], [81], [279]]}]
    record = HOOKS.record("ps_compressed")
    signs = hook_options("ps_compressed", {"compressor": "signsgd", "per_tensor": True})
    dense = {**signs, "answer": "dense"}
    assert floor_messages(record, buckets, signs) == {0: [(119 + 12, "uint8")]}
    assert floor_messages(record, buckets, dense) == {0: [(119 + 12, "uint8", 945)]}
    assert message_bytes(floor_messages(record, buckets, dense)) == 131
    assert answered_bytes(floor_messages(record, buckets, dense)) == 4 * 945
    assert answered_bytes(floor_messages(record, buckets, signs)) == 131


@pytest.fixture
def one_trainer_group():
    """A real gloo group of one process, this one (in memory: no process is started)."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_limits_all_gather_each_message_as_its_buckets_tensors_make_it(one_trainer_group):
    """``--limits``' all-gathers move each bucket's message as sent: ``per_tensor`` signs with a
    scale for each of the bucket's tensors (the last iteration's buckets, as the trainer saw
    them); a sparse bucket's rows as they are."""
    from ps_bench.strategies.base import HookContext
    from ps_bench.strategies.compressors import SignHook

    ctx = HookContext(one_trainer_group, [], "shard", None, False, 10.0)
    ctx.buckets = {0: (4 * 945, False, [[585], [81], [279]]), 1: (4 * 13, False, [[13]]),
                   2: (4 * 40, True, [[10, 4]])}
    per_tensor, one_scale = SignHook(ctx, per_tensor=True), SignHook(ctx)
    assert [elements for _, _, elements in per_tensor.floor_steps([945, 13, 40])] == [
        -(-(119 + 12) // 4), -(-(2 + 4) // 4), 40]
    assert [elements for _, _, elements in one_scale.floor_steps([945, 13, 40])] == [
        -(-(119 + 4) // 4), -(-(2 + 4) // 4), 40]
