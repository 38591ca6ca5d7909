"""predict's memory (``ps_bench.predict.memory``): the model states each strategy's record says a
GPU holds, checked against DeepSpeed's own estimators on the shipped Hugging Face configs; the
activations a forward saves, counted by hand; ``--gpu-memory`` and what does not fit."""

from __future__ import annotations

import json

import pytest
import torch

from ps_bench.cli import main
from ps_bench.metrics.memory import SavedActivations, held_bytes
from ps_bench.predict.inputs import model_buckets
from ps_bench.predict.memory import (ModelFacts, kept_bytes, model_states, parse_memory,
                                     saved_activations)
from ps_bench.strategies import HOOKS
from ps_bench.strategies.stale import STALE_SYNCHRONOUS

# a model of a million parameters in 10 tensors, its largest layer 200,000; as FSDP2 wraps it,
# 50,000 in the root unit and 100,000 in the largest other
P = 1_000_000
FACTS = ModelFacts(P, 200_000, None, "by hand", tensors=10, root_unit=50_000, largest_unit=100_000)


def states(hook: str, n: int = 8, per_node: int = 1, precision: str = "fp32",
           optimizer: str = "adamw", momentum: float = 0.0, gathered: str = "float32") -> dict:
    return model_states(HOOKS.record(hook), FACTS, n, per_node, precision, optimizer, momentum, gathered)


def test_each_record_says_what_its_trainers_hold():
    """Bytes a parameter: float32 parameters and gradients, AdamW's two moments (and a step count
    a tensor), whole under DDP and the parameter servers, sharded as each strategy shards them."""
    whole = states("allreduce")
    assert (whole["parameters_bytes"], whole["gradients_bytes"], whole["optimizer_bytes"]) == (
        4 * P, 4 * P, 8 * P + 4 * 10)
    assert states("ps") == states("fp16") == whole
    assert states("allreduce", optimizer="sgd")["optimizer_bytes"] == 0
    assert states("allreduce", optimizer="sgd", momentum=0.9)["optimizer_bytes"] == 4 * P
    fsdp = states("fsdp")  # everything over the 8; the root unit and the largest twice whole
    assert (fsdp["parameters_bytes"], fsdp["gradients_bytes"], fsdp["gathered_bytes"]) == (
        P // 2, P // 2, 4 * (50_000 + 2 * 100_000))
    assert states("deepspeed_zero3")["gathered_bytes"] == 4 * 2 * 200_000  # the largest layer
    assert states("hsdp", n=64, per_node=8)["parameters_bytes"] == P // 2  # over a host's 8
    assert states("zero1")["optimizer_bytes"] == P + 4 * 2 and states("zero1")["gradients_bytes"] == 4 * P
    assert states("diloco")["parameters_bytes"] == 3 * 4 * P  # its start point and outer momentum
    stale = model_states(STALE_SYNCHRONOUS, FACTS, 8, 1, "fp32", "adamw")  # --staleness
    assert stale["optimizer_bytes"] == 0 and stale["parameters_bytes"] == 4 * P  # servers step
    assert states("fsdp", precision="bf16")["parameters_bytes"] == P // 2  # autocast: float32 kept
    assert states("fsdp", gathered="bfloat16")["gathered_bytes"] == 2 * (50_000 + 2 * 100_000)


def test_gathered_layers_are_counted_in_the_dtype_predict_sends_them_in(tmp_path):
    """One rule for the gathered parameters' dtype, the one their bytes are sent in
    (``Calibration.gathered``): autocast gathers FSDP2's float32 parameters, its mixed-precision
    policy (--reduce-dtype) that dtype; DeepSpeed the dtype it casts the model to."""
    def gathered(*flags: str) -> dict:
        out = tmp_path / f"{len(list(tmp_path.iterdir()))}.json"
        assert main(["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms",
                     "forward=10,backward=20,optimizer=1", "--link", "1gbit", "--trainers", "8",
                     "--hooks", "fsdp,deepspeed_zero3", "--out", str(out), *flags]) == 0
        return {row["strategy"]: row["gathered_bytes"] for row in json.loads(out.read_text())["predictions"]}

    fp32, bf16 = gathered(), gathered("--precision", "bf16")
    policy = gathered("--precision", "bf16", "--reduce-dtype", "bf16")
    assert bf16["fsdp"] == fp32["fsdp"] == 2 * policy["fsdp"] > 0
    assert fp32["deepspeed_zero3"] == 2 * bf16["deepspeed_zero3"] == 2 * policy["deepspeed_zero3"] > 0


@pytest.mark.parametrize("config", ["llama3-8b", "llama3-70b", "mistral-7b", "qwen2.5-7b"])
def test_deepspeed_model_states_are_its_own_estimators(config):
    """Mixed-precision AdamW without offload, 8 to 1024 GPUs: ZeRO-2's and ZeRO-3's model
    states per GPU as ``estimate_zero2_model_states_mem_needs`` and
    ``estimate_zero3_model_states_mem_needs`` give them (ZeRO-3: 18 bytes a parameter over the
    GPUs, 4 a parameter of the largest layer)."""
    pytest.importorskip("transformers")
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    facts = model_buckets(f"hf:{config}", 25.0)[3]
    for nodes, per_node in ((1, 8), (16, 8), (128, 8)):
        n = nodes * per_node
        _, zero3 = estimate_zero3_model_states_mem_needs(
            facts.parameters, facts.largest_layer, per_node, nodes, cpu_offload=False,
            cpu_offload_params=False)[:2]
        _, zero2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(
            facts.parameters, per_node, nodes, cpu_offload=False)
        ours = {stage: model_states(HOOKS.record(f"deepspeed_zero{stage}"), facts, n, per_node,
                                    "bf16", "adamw", gathered="bfloat16")["model_states_bytes"]
                for stage in (2, 3)}
        assert ours[3] == pytest.approx(zero3, rel=1e-6), (config, n)
        assert ours[2] == pytest.approx(zero2, rel=1e-6), (config, n)


def test_activations_are_what_a_forward_saves_for_backward_counted_by_hand():
    """Linear(4, 8), ReLU, Linear(8, 2) at batch 3: the input (12 floats) and the ReLU's output
    (24, saved by the ReLU and by the second layer, once); no weight nor its transpose. Alike on
    the meta device, where nothing is allocated."""
    network = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with SavedActivations() as saved:
        network(torch.ones(3, 4))
    assert saved.nbytes == (12 + 24) * 4
    with torch.device("meta"):
        meta = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    assert saved_activations(meta, (torch.ones(3, 4, device="meta"),))[0] == (12 + 24) * 4
    assert saved_activations(meta, (torch.ones(3, 4, device="meta"),), "bf16")[0] == (12 + 24) * 2
    # the trainers' loss: its log-probabilities (3 x 2, float32 as autocast computes it), the
    # targets (3 int64) and the weight's total (a float); a language model's logits are most of it
    targets = torch.zeros(3, dtype=torch.long, device="meta")
    loss = 6 * 4 + 3 * 8 + 4
    assert saved_activations(meta, (torch.ones(3, 4, device="meta"),), targets=targets)[0] == (12 + 24) * 4 + loss
    assert saved_activations(meta, (torch.ones(3, 4, device="meta"),), "bf16", targets)[0] == (12 + 24) * 2 + loss


def test_autocast_copies_of_the_weights_are_counted_for_the_strategies_that_autocast(tmp_path):
    """Under autocast, a matrix product casts its weight and bias to 16 bits and saves the copy
    for backward: DummyModel's eight 1024 x 1024 layers in bf16 measured 16.56 MiB of
    activations against 0.56 predicted. Counted on the meta device: the weights that reach
    autocast's operators (not the embedding's, nor the norm's); 2 bytes each, under a strategy
    whose trainers autocast, not under one that casts the model or gathers in 16 bits."""
    with torch.device("meta"):
        network = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                      torch.nn.Linear(8, 2), torch.nn.LayerNorm(2))
    assert saved_activations(network, (torch.zeros(3, dtype=torch.long, device="meta"),), "bf16")[1] == \
        4 * 8 + 8 + 8 * 2 + 2
    out = tmp_path / "p.json"
    assert main(["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms", "forward=10,backward=20,optimizer=1",
                 "--link", "1gbit", "--trainers", "2", "--gpu-memory", "80GB", "--precision", "bf16", "--hooks",
                 "allreduce,fsdp,deepspeed_zero2", "--out", str(out)]) == 0
    rows = {row["strategy"]: row["activations_bytes"] for row in json.loads(out.read_text())["predictions"]}
    weights = 8 * (1024 * 1024 + 1024)
    assert rows["allreduce"] - rows["deepspeed_zero2"] == rows["fsdp"] - rows["deepspeed_zero2"] == 2 * weights
    assert main(["predict", "--model", "DummyModel", "--batch-size", "8", "--compute-ms", "forward=10,backward=20,optimizer=1",
                 "--link", "1gbit", "--trainers", "2", "--gpu-memory", "80GB", "--precision", "bf16", "--hooks",
                 "allreduce,fsdp,deepspeed_zero2", "--reduce-dtype", "bf16", "--out", str(tmp_path / "q.json")]) == 0
    rows = {row["strategy"]: row["activations_bytes"] for row in json.loads((tmp_path / "q.json").read_text())["predictions"]}
    assert rows["fsdp"] == rows["deepspeed_zero2"] == rows["allreduce"] - 2 * weights  # gathered in bf16: no copies


def test_a_batch_sliced_from_the_data_counts_its_own_bytes_not_the_datas():
    """A trainer slices each batch from the data it holds: the saved input was counted as the
    whole data's storage (4 MiB of DummyData's indices where the batch is 128 KiB: 4.8 MiB of
    activations measured against 0.8 predicted). A tracked tensor's views still count their
    storage once (a ReLU's output saved by it and, transposed, by the next layer)."""
    network = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    data = torch.ones(1000, 4)
    with SavedActivations() as saved:
        network(data[6:9])
    assert saved.nbytes == (12 + 24) * 4
    with SavedActivations() as saved:
        hidden = torch.nn.functional.relu(torch.ones(3, 8, requires_grad=True))
        (hidden.t() @ hidden[:, :2]).sum()
    assert saved.nbytes == 24 * 4  # one storage, three views of it saved


def test_held_bytes_count_each_buffer_once():
    """Views of one buffer (DDP's gradients in their bucket) count once, in the first group."""
    bucket = torch.zeros(100)
    counted = held_bytes({"parameters": [torch.zeros(10)], "gradients": [bucket[:50], bucket[50:]],
                          "optimizer": [bucket]})
    assert counted == {"parameters_bytes": 40, "gradients_bytes": 400, "optimizer_bytes": 0,
                       "total_bytes": 440}


def test_parse_memory():
    assert parse_memory("80GB") == 80 * 10 ** 9
    assert parse_memory("80GiB") == 80 * 2 ** 30
    assert parse_memory("141 gb") == 141 * 10 ** 9
    assert parse_memory("0.5TB") == 5 * 10 ** 11


NO_RUN = ["predict", "--compute-ms", "forward=1,backward=2,optimizer=1", "--link", "10gbit",
          "--batch-size", "2", "--trainers", "4"]


@pytest.mark.parametrize("value", ["0", "80", "abc", "0GB", "80XB", "-"])
def test_bad_gpu_memory_is_one_line_exit_2(value, capsys):
    assert main([*NO_RUN, "--model", "DummyModelSmall", "--gpu-memory", value]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "--gpu-memory" in captured.err


def test_llama3_70b_on_16_nodes_of_8(tmp_path, capsys):
    """The question as users ask it: Llama-3-70B on 16 nodes of 8 x 80 GB, bf16 AdamW. ZeRO-3's
    model states within 5 % of DeepSpeed's estimator; all-reduce's whole model states do not
    fit, and the table says so."""
    pytest.importorskip("transformers")
    out = tmp_path / "p.json"
    assert main(["predict", "--model", "hf:llama3-70b", "--nodes", "16", "--per-node", "8",
                 "--hooks", "allreduce,fsdp,deepspeed_zero3", "--optimizer", "adamw",
                 "--precision", "bf16", "--gpu-memory", "80GB", "--batch-size", "1",
                 "--compute-ms", "forward=900,backward=1800,optimizer=50", "--link", "400gbit",
                 "--link-kind", "infiniband", "--intra-link", "3600gbit",
                 "--intra-link-kind", "nvlink", "--out", str(out)]) == 0
    rows = {row["strategy"]: row for row in json.loads(out.read_text())["predictions"]}
    parameters, largest = 70_553_706_496, 128_256 * 8192
    estimate = 18 * parameters / 128 + 4 * largest
    assert rows["deepspeed_zero3"]["model_states_bytes"] == pytest.approx(estimate, rel=0.05)
    assert rows["allreduce"]["fits"] is False and rows["allreduce"]["model_states_bytes"] > 1e12
    assert rows["deepspeed_zero3"]["activations_bytes"] > 0
    printed = capsys.readouterr().out
    assert "NO" in printed and "70.55 B parameters, the largest layer 1.051 B" in printed


def test_fsdp_units_as_ps_bench_wraps_a_llama():
    """hf:llama-tiny (hidden 64, 2 layers, vocab 512, untied): the root unit holds the embedding,
    the head and the final norm (2 x 512 x 64 + 64); a decoder block is the largest other unit
    (attention 64 x 64 x 2 + 64 x 32 x 2, the MLP 3 x 64 x 128, two norms of 64)."""
    pytest.importorskip("transformers")
    facts = model_buckets("hf:llama-tiny", 25.0)[3]
    block = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    assert (facts.root_unit, facts.largest_unit) == (2 * 512 * 64 + 64, block)
    assert facts.parameters == facts.root_unit + 2 * block == 139_584


def test_what_a_strategy_keeps_between_iterations_is_in_its_memory(capsys):
    """Error feedback keeps a float32 residual of every bucket (topk by default; qsgd not), and
    PowerSGD each bucket's error and its factors: on Llama-3-8B in fp32 that is 32 GB more a
    GPU, which decides whether topk fits 80 GB where allreduce does."""
    facts = model_buckets("hf:llama3-8b", 25.0)[3]
    assert kept_bytes("topk", facts) == 4 * facts.parameters
    assert kept_bytes("qsgd", facts) == kept_bytes("allreduce", facts) == kept_bytes("ps_fp16", facts) == 0
    assert 4 * facts.parameters < kept_bytes("powersgd", facts) < 4.1 * facts.parameters
    # at the options a run had: no error feedback, nothing kept; PowerSGD without warm start, its error alone
    assert kept_bytes("topk", facts, {"error_feedback": False}) == 0
    assert kept_bytes("powersgd", facts, {"warm_start": False}) == 4 * facts.parameters
    buckets, _, _, dlrm = model_buckets("dlrm_small", 25.0)  # its embeddings' sparse buckets: none kept
    assert kept_bytes("topk", dlrm) == sum(nbytes for nbytes, sparse, _ in buckets if not sparse) == 7624
    assert main(["predict", "--model", "hf:llama3-8b", "--batch-size", "1", "--sequence-length", "1024",
                 "--compute-ms", "forward=100,backward=200,optimizer=5", "--hooks", "allreduce,topk",
                 "--trainers", "8", "--link", "100gbit", "--gpu-memory", "80GB"]) == 0
    printed = capsys.readouterr().out
    rows = {line.split()[1]: line.split() for line in printed.splitlines() if line.startswith("8 ")}
    assert rows["allreduce"][-1] == "yes" and rows["topk"][-1] == "NO"
    # its data has sequences of 64 tokens: the calibration says what length it counted
    assert "a forward of 1x1024 tokens64 at --sequence-length 1024 and its loss (fp32)" in printed
    assert float(rows["topk"][-2]) - float(rows["allreduce"][-2]) == pytest.approx(
        4 * facts.parameters / 2 ** 30, abs=0.1)


class Blocked(torch.nn.Module):
    """A block FSDP2 would wrap (``shard_units``) and a head outside it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8),
                                         torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 2)

    def shard_units(self) -> list[torch.nn.Module]:
        return [self.block]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_a_recomputed_unit_keeps_its_input_alone_and_changes_no_gradient():
    """--activation-checkpointing full: the block keeps its input (3 x 4) in place of what it
    saves (its two ReLUs' outputs, 3 x 8 each); the head still saves its input. bf16: autocast's
    copies of the block's weights are made again in backward, not kept. Backward redoes the
    block's share of the forward's FLOPs; on the CPU the gradients are bit for bit the same."""
    from ps_bench.predict.inputs import backward_shares
    from ps_bench.strategies import recompute

    x = torch.ones(3, 4, device="meta")
    for mode, kept, copies in (("none", (12 + 24 + 24) * 4, 4 * 8 + 8 + 8 * 8 + 8 + 8 * 2 + 2),
                               ("full", (12 + 24) * 4, 8 * 2 + 2)):
        with torch.device("meta"):
            network = Blocked()
        assert saved_activations(network, (x,), checkpointing=mode)[0] == kept, mode
        with torch.device("meta"):
            network = Blocked()
        assert saved_activations(network, (x,), "bf16", checkpointing=mode)[1] == copies, mode
    with torch.device("meta"):
        network = Blocked()
    _, share, forward = backward_shares(network, (x,), recompute.recomputed_units(network, "full"))
    assert share == pytest.approx((4 * 8 + 8 * 8) / (4 * 8 + 8 * 8 + 8 * 2))
    assert forward == 2 * 3 * (4 * 8 + 8 * 8 + 8 * 2)  # a multiply and an add a weight, 3 samples
    gradients = []
    for mode in ("none", "full"):
        torch.manual_seed(0)
        network = Blocked()
        assert recompute.apply(network, mode) == (mode == "full")
        network(torch.arange(12.0).reshape(3, 4)).square().sum().backward()
        gradients.append(torch.cat([p.grad.reshape(-1) for p in network.parameters()]))
    assert torch.equal(*gradients)
