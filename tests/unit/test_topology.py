import pytest

from ps_bench.runtime.topology import (MASTER, PIECES, SERVER, TRAINER, Topology, balance_buckets, piece_owners,
                                      piece_root, split_evenly)


def test_rank_order_roles_and_names():
    topology = Topology(ntrainer=2, ncudatrainer=1, nserver=1, ncudaserver=1)
    assert [(r.rank, r.role, r.name, r.cuda_rpc) for r in topology.ranks] == [
        (0, TRAINER, "trainer0", False),
        (1, TRAINER, "trainer1", False),
        (2, TRAINER, "trainer2", True),
        (3, SERVER, "server3", False),
        (4, SERVER, "server4", True),
        (5, MASTER, "master", False),
    ]
    assert topology.world_size == 6
    assert [s.index for s in topology.servers] == [0, 1]


@pytest.mark.parametrize(
    "count, parts, sizes",
    [(4, 2, [2, 2]), (5, 3, [2, 2, 1]), (3, 2, [2, 1]), (7, 7, [1] * 7), (1, 1, [1])],
)
def test_split_evenly_has_no_divisibility_rule(count, parts, sizes):
    groups = split_evenly(count, parts)
    assert [len(g) for g in groups] == sizes
    assert [i for g in groups for i in g] == list(range(count))


def test_group_mapping_with_uneven_counts():
    topology = Topology(ntrainer=5, ncudatrainer=0, nserver=3, ncudaserver=0, mapping="group")
    assert [topology.group_of(t) for t in range(5)] == [0, 0, 1, 1, 2]
    assert [topology.contributors(s) for s in range(3)] == [2, 2, 1]


def test_shard_mapping_every_server_hears_every_trainer():
    topology = Topology(ntrainer=3, ncudatrainer=0, nserver=2, ncudaserver=0, mapping="shard")
    assert [topology.contributors(s) for s in range(2)] == [3, 3]


def test_node_aggregated_servers_hear_once_from_each_host():
    """6 trainers, 2 per host (3 hosts): each slice reaches a server once per host; ``group``
    groups hosts, never splitting one."""
    shard = Topology(ntrainer=6, ncudatrainer=0, nserver=2, ncudaserver=0, mapping="shard", pushing_hosts=2)
    assert [shard.contributors(s) for s in range(2)] == [3, 3]
    group = Topology(ntrainer=6, ncudatrainer=0, nserver=2, ncudaserver=0, mapping="group", pushing_hosts=2)
    assert [group.group_of(t) for t in range(6)] == [0, 0, 0, 0, 1, 1]  # hosts 0 and 1, then host 2
    assert [group.contributors(s) for s in range(2)] == [2, 1]


def test_balance_buckets_balances_bytes_and_is_deterministic():
    sizes = {0: 100, 1: 60, 2: 50, 3: 40, 4: 10}
    owners = balance_buckets(sizes, 2)
    load = [sum(sizes[b] for b, s in owners.items() if s == server) for server in range(2)]
    assert sum(load) == 260
    assert max(load) - min(load) <= 20  # greedy largest-first: 140 vs 120
    assert balance_buckets(dict(reversed(list(sizes.items()))), 2) == owners
    assert set(balance_buckets({0: 5}, 3).values()) == {0}


def test_whole_slices_are_dealt_as_buckets():
    """Bucket 0 of 100 and bucket 1 of 60 in halves over 2 servers: 50, 50, 30, 30, largest first
    onto the least loaded server; in one part, the buckets as balance_buckets deals them (each
    key a slice's times PIECES: its first and only piece)."""
    assert piece_owners({0: 100, 1: 60}, 2, 2) == {0: 0, PIECES: 1, 2 * PIECES: 0, 3 * PIECES: 1}
    sizes = {0: 100, 1: 60, 2: 50, 3: 40, 4: 10}
    assert piece_owners(sizes, 1, 2) == {key * PIECES: server
                                         for key, server in balance_buckets(sizes, 2).items()}


def test_the_group_mappings_roots_go_round_the_servers():
    assert [piece_root(key * PIECES, 4) for key in range(5)] == [0, 1, 2, 3, 0]  # whole buckets
    assert [piece_root(PIECES + place, 4) for place in range(4)] == [1, 2, 3, 0]  # a bucket's pieces


def test_device_indices_are_node_local():
    topology = Topology(ntrainer=0, ncudatrainer=2, nserver=0, ncudaserver=1)
    # one node, 2 GPUs: the CUDA server shares GPU 0 with trainer 0; the master stays on the CPU
    assert [topology.device_index(r, local_world_size=4, gpus_per_node=2) for r in range(4)] == [0, 1, 0, None]
    # two nodes of 2 ranks: rank 2 is local rank 0 on the second node
    assert topology.device_index(2, local_world_size=2, gpus_per_node=8) == 0


def test_device_maps_pair_cuda_trainers_with_cuda_servers_only():
    topology = Topology(ntrainer=1, ncudatrainer=2, nserver=1, ncudaserver=1)
    world = topology.world_size
    assert topology.device_maps(0, world, 8) == {}  # CPU-RPC trainer
    assert topology.device_maps(1, world, 8) == {"server4": {1: 4}}
    assert topology.device_maps(4, world, 8) == {"trainer1": {4: 1}, "trainer2": {4: 2}}
    assert topology.device_maps(3, world, 8) == {}  # CPU server
    assert topology.device_maps(5, world, 8) == {}  # master


def test_cpu_trainers_compute_on_gpu_only_with_cuda_collectives():
    gloo = Topology(ntrainer=2, ncudatrainer=0, nserver=1, ncudaserver=0)
    nccl = Topology(ntrainer=2, ncudatrainer=0, nserver=1, ncudaserver=0, cuda_collectives=True)
    assert gloo.device_index(0, 4, 2) is None
    assert nccl.device_index(1, 4, 2) == 1
    assert nccl.device_index(2, 4, 2) is None  # CPU server


def test_rpc_is_on_the_gpu_only_where_every_trainer_and_server_sends_cuda_tensors():
    assert Topology(0, 2, 0, 1).rpc_on_gpu  # --ncudatrainer 2 --ncudaserver 1
    assert not Topology(1, 1, 0, 1).rpc_on_gpu  # one trainer on the CPU
    assert not Topology(0, 2, 1, 1).rpc_on_gpu  # one server on the CPU
    assert not Topology(2, 0, 1, 0, cuda_collectives=True).rpc_on_gpu  # NCCL trainers, RPC on the CPU
