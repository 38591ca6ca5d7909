"""Learnable synthetic data: teacher labels are a fixed, seeded function of the inputs, the
random labels stay what they were, and held-out samples come from the same task."""

from __future__ import annotations

import math

import torch

from ps_bench.models import DATA, build_data, build_held_out
from ps_bench.metrics.stats import SMOOTHING, smoothed_loss

BAGS = {"max_val": 64, "sample_count": 1024, "sample_length": 16, "sparsity_percentage": 20, "num_classes": 8}
IMAGES = {"sample_count": 64, "image_size": 8, "num_classes": 10}
TOKENS = {"sample_count": 48, "sequence_length": 20, "vocab_size": 97}
CLICKS = {"sample_count": 400, "dense_features": 5, "tables": 3, "rows_per_table": 50, "bag_size": 2}


def majority_labels(bags: torch.Tensor, seed: int) -> torch.Tensor:
    """The documented rule, computed here on its own: the rows in use are the first 80% of a
    seeded permutation, dealt to the classes round-robin; a bag's label is its majority class."""
    used = int(BAGS["max_val"] * 0.8)
    rows = torch.randperm(BAGS["max_val"], generator=torch.Generator().manual_seed(seed))[:used]
    class_of = torch.full((BAGS["max_val"],), -1)
    class_of[rows] = torch.arange(used) % BAGS["num_classes"]
    assert (class_of[bags] >= 0).all(), "a bag uses a row that is not in use"
    counts = torch.stack([(class_of[bags] == c).sum(dim=1) for c in range(BAGS["num_classes"])], dim=1)
    return counts.argmax(dim=1)


def test_random_labels_are_the_data_they_always_were():
    generator = torch.Generator().manual_seed(3)
    rows = torch.randperm(64, generator=generator)[:51]
    picks = torch.randint(0, 51, (1024, 16), generator=generator)
    targets = torch.randint(0, 8, (1024,), generator=generator)
    data = build_data("DummyData", BAGS, 3)
    assert torch.equal(data.inputs[0], rows[picks]) and torch.equal(data.targets, targets)


def test_teacher_labels_are_the_majority_class_of_each_bag():
    data = build_data("DummyData", BAGS, 5, "teacher")
    assert torch.equal(data.targets, majority_labels(data.inputs[0], 5))
    counts = torch.bincount(data.targets, minlength=8)
    assert counts.min() > 1024 / 8 / 2, f"classes far from balanced: {counts.tolist()}"


def test_same_seed_same_data_other_seed_other_data():
    first, again = build_data("DummyData", BAGS, 0, "teacher"), build_data("DummyData", BAGS, 0, "teacher")
    other = build_data("DummyData", BAGS, 1, "teacher")
    assert torch.equal(first.inputs[0], again.inputs[0]) and torch.equal(first.targets, again.targets)
    assert not torch.equal(first.inputs[0], other.inputs[0])


def test_held_out_bags_are_new_and_labelled_by_the_same_teacher():
    train, held_out = build_data("DummyData", BAGS, 2, "teacher"), build_held_out("DummyData", BAGS, 2, 256)
    assert len(held_out) == 256
    assert torch.equal(held_out.targets, majority_labels(held_out.inputs[0], 2))
    seen = {tuple(bag) for bag in train.inputs[0].tolist()}
    assert sum(tuple(bag) in seen for bag in held_out.inputs[0].tolist()) == 0
    assert set(held_out.inputs[0].unique().tolist()) <= set(train.inputs[0].unique().tolist())


def test_image_teacher_is_a_seeded_function_of_the_image():
    data = DATA.get("SyntheticImages")(**IMAGES)
    train, held_out = data.build(4, "teacher"), data.held_out(4, 32)
    assert torch.equal(train.targets, data.teach(train.inputs[0], 4))
    assert torch.equal(held_out.targets, data.teach(held_out.inputs[0], 4))
    assert not torch.equal(train.inputs[0][:32], held_out.inputs[0])
    assert torch.equal(build_data("SyntheticImages", IMAGES, 4, "teacher").targets, train.targets)
    assert len(train.targets.unique()) > 3


def test_token_teacher_follows_one_seeded_cycle_through_the_vocabulary():
    train = build_data("SyntheticTokens", TOKENS, 6, "teacher")
    held_out = build_held_out("SyntheticTokens", TOKENS, 6, 32)
    successor = {}
    for data in (train, held_out):
        tokens, targets = data.inputs[0], data.targets
        assert torch.equal(tokens[:, 1:], targets[:, :-1])  # the target of each position is the next token
        for current, following in zip(tokens.flatten().tolist(), targets.flatten().tolist()):
            assert successor.setdefault(current, following) == following, "a token with two successors"
    assert len(successor) == TOKENS["vocab_size"]  # every token seen, each with one successor
    token, visited = 0, set()
    while token not in visited:  # one cycle: from any token, the successors reach all of them
        visited.add(token)
        token = successor[token]
    assert len(visited) == TOKENS["vocab_size"]
    assert not torch.equal(train.inputs[0][:32, 0], held_out.inputs[0][:, 0])
    other = build_data("SyntheticTokens", TOKENS, 7, "teacher")
    pairs = zip(other.inputs[0].flatten().tolist(), other.targets.flatten().tolist())
    assert any(successor[a] != b for a, b in pairs)  # another seed, another cycle


def test_a_fresh_gpt_guesses_uniformly_as_gpt2_does():
    """GPT-2's embeddings (N(0, 0.02), the token one tied to the output layer): a fresh model's
    loss on the teacher's tokens is a uniform guess's, ln(vocabulary), not several times it."""
    from ps_bench.models.transformer import GPT

    torch.manual_seed(0)
    network = GPT(vocab_size=TOKENS["vocab_size"], context_length=32, layers=2, heads=2, width=32)
    data = build_data("SyntheticTokens", TOKENS, 6, "teacher")
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(network(data.inputs[0]), data.targets).item()
    assert abs(loss - math.log(TOKENS["vocab_size"])) < 0.05 * math.log(TOKENS["vocab_size"]), loss


def test_click_teacher_is_a_seeded_score_decided_by_a_margin():
    data = DATA.get("SyntheticClicks")(**CLICKS)
    for dataset in (data.build(8, "teacher"), data.held_out(8, 100)):
        dense, ids = dataset.inputs
        teacher = torch.Generator().manual_seed(8 + 1_000_003)  # the seed's teacher stream
        direction = torch.randn(5, generator=teacher)
        direction = direction / direction.norm()
        values = torch.randint(0, 2, (3, 50), generator=teacher) * 2.0 - 1.0
        from_ids = torch.stack([sum(values[t, ids[:, t, b]] for b in range(2)) for t in range(3)]).sum(0) / 6 ** 0.5
        sign = dataset.targets * 2.0 - 1.0
        moved = dense - sign[:, None] * data.MARGIN * direction  # the dense features before the margin
        score = from_ids + moved @ direction
        assert torch.equal((score > 0).long(), dataset.targets)
        assert (sign * (from_ids + dense @ direction) >= data.MARGIN - 1e-5).all()  # every sample by a margin
    assert 0.3 < data.build(8, "teacher").targets.float().mean() < 0.7
    random = data.build(8)  # random labels: the inputs and labels they always were
    generator = torch.Generator().manual_seed(8)
    assert torch.equal(random.inputs[0], torch.randn(400, 5, generator=generator))
    assert torch.equal(random.inputs[1], torch.randint(0, 50, (400, 3, 2), generator=generator))
    assert torch.equal(random.targets, torch.randint(0, 2, (400,), generator=generator))


def test_every_data_class_has_a_teacher_that_says_what_it_is():
    for name in DATA:
        teacher = DATA.get(name).teacher
        assert isinstance(teacher, str) and teacher, name


def test_the_target_is_held_against_the_mean_of_the_last_losses():
    curve = [(i, 10.0 - i) for i in range(SMOOTHING - 1)]
    assert smoothed_loss(curve) is None
    curve.append((SMOOTHING - 1, 0.0))
    assert smoothed_loss(curve) == sum(loss for _, loss in curve) / SMOOTHING
    assert smoothed_loss(curve + [(SMOOTHING, 1.0)]) == sum(loss for _, loss in curve[1:] + [(SMOOTHING, 1.0)]) / SMOOTHING
