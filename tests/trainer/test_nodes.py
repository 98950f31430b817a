"""A role's ranks on its nodes (`trainer/nodes.py`), the config keys that place them, the node rank
a node agent takes, and rank 0's commands to another node's rank over the group."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch
import torch.distributed as dist

from rolefleet.common.config import ConfigError
from rolefleet.launch import own_address
from rolefleet.rpc.server import StartupError
from rolefleet.serve import node_rank_of
from rolefleet.trainer.nodes import NodeLayout, layout_for, node_problem
from rolefleet.trainer.workers import WorkerGroup, collective, free_port, join_group, worker_loop

pytestmark = pytest.mark.multinode


def test_ranks_are_numbered_node_by_node():
    layout = NodeLayout((4, 2, 2), ("gpu-a", "gpu-b", "gpu-c"))
    assert (layout.world, layout.nodes, layout.spans) == (8, 3, True)
    assert [layout.ranks_of(k) for k in range(3)] == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert [layout.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert [layout.local_index(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 0, 1]
    assert layout.same_node([4, 5]) and not layout.same_node([3, 4])
    assert layout.describe(1) == "node 1 (gpu-b, ranks 4-5)"
    with pytest.raises(ValueError, match="rank 8 is outside the group of 8"):
        layout.node_of(8)
    assert not NodeLayout((4,)).spans


def test_the_devices_map_gives_each_node_its_gpus_in_order(make_config):
    cfg = make_config("devices.actor=['gpu-a:0', 'gpu-a:1', 'gpu-b:0', 'gpu-b:1']", "devices.rollout=['gpu-b:0', 'gpu-b:1']")
    layout = layout_for("actor", cfg)
    assert (layout.counts, layout.names) == ((2, 2), ("gpu-a", "gpu-b"))
    assert cfg.devices.by_node("actor") == [("gpu-a", [0, 1]), ("gpu-b", [0, 1])]
    assert layout_for("actor", make_config("devices.actor=[0, 1, 2]")).counts == (3,)
    assert layout_for("reward", cfg) == NodeLayout()  # one process, whatever its GPUs


def test_cpu_workers_split_evenly_over_the_nodes(make_config):
    layout = layout_for("critic", make_config("critic.workers=6", "critic.nodes=3"))
    assert (layout.counts, [layout.name(k) for k in range(3)]) == ((2, 2, 2), ["node0", "node1", "node2"])
    assert layout_for("actor", make_config("actor.workers=2")).counts == (2,)


@pytest.mark.parametrize(("overrides", "message"), [
    (["actor.workers=3", "actor.nodes=2"],
     "actor.nodes: 3 workers (actor.workers) do not split evenly over 2 nodes; set actor.workers to a multiple"),
    (["devices.actor=['a:0', 'b:0']", "actor.nodes=3"],
     "actor.nodes: 3, but devices.actor names 2 node(s); on GPUs the nodes come from the devices map"),
    (["devices.actor=[0, 'b:1']"], "mixes local GPU indices with 'node:index' entries"),
    (["devices.critic=['a:0', 'b:0', 'a:1']"],
     "the GPUs of node 'a' are not listed together in ['a:0', 'b:0', 'a:1']: list each node's GPUs in one run"),
    (["devices.reward=['a:0', 'b:0']"], "devices.reward: entries on nodes a, b: the reward role is one process"),
    (["actor.nodes=0"], "actor.nodes"),
    (["actor.rendezvous.port=70000"], "actor.rendezvous.port"),
    (["actor.rendezvous.timeout_s=0"], "actor.rendezvous.timeout_s"),
])
def test_bad_placements_are_config_errors_naming_the_key(make_config, overrides, message):
    with pytest.raises(ConfigError) as raised:
        make_config(*overrides)
    assert message in str(raised.value)


def test_a_node_rank_outside_the_group_is_refused_with_the_range():
    two = NodeLayout((2, 2))
    assert node_problem(0, two, "actor") is None and node_problem(1, two, "actor") is None
    assert node_problem(2, two, "actor") == ("--node-rank 2: actor's worker group spans 2 nodes, so the node rank "
                                             "is 0 (the server process) to 1")
    assert "actor's worker group is on one node" in node_problem(1, NodeLayout((4,)), "actor")
    assert node_problem(0, NodeLayout((4,)), "actor") is None


def test_node_rank_from_the_flag_the_environment_or_the_pod_name():
    assert node_rank_of(None, {}) == 0
    assert node_rank_of(2, {"ROLEFLEET_NODE_RANK": "1"}) == 2
    assert node_rank_of(None, {"ROLEFLEET_NODE_RANK": " 3 ", "ROLEFLEET_POD_NAME": "x-1"}) == 3
    assert node_rank_of(None, {"ROLEFLEET_POD_NAME": "run1-rolefleet-actor-12"}) == 12
    with pytest.raises(StartupError, match=r"ROLEFLEET_POD_NAME='actor' is not a node rank"):
        node_rank_of(None, {"ROLEFLEET_POD_NAME": "actor"})
    with pytest.raises(StartupError, match=r"--node-rank='-1' is not a node rank"):
        node_rank_of(-1, {})


def test_a_node_finds_the_address_the_others_reach_it_at():
    assert own_address("127.0.0.1", 29500) == "127.0.0.1"  # a group on loopback (`rolefleet up`)
    assert own_address("localhost", 29500) == "127.0.0.1"


class Doubler:
    """A stand-in worker: what rank 0 drives over the control group."""

    @collective("all")
    def double(self, x):
        return x * 2 + dist.get_rank()

    def close(self):
        pass


def _rank(rank: int, port: int, results) -> None:
    """One rank of a two-node group as the elastic agent starts it (the environment it sets)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    layout = NodeLayout((1, 1))
    join_group("actor", rank, layout, {}, "127.0.0.1")
    if rank:
        worker_loop("actor", rank, Doubler())
        return
    group = WorkerGroup.formed("actor", layout)
    answers = [group.run(Doubler(), Doubler.double, (torch.arange(3.0),), ranks) for ranks in ([1], [0, 1])]
    group.stop()
    results.put([a.tolist() for a in answers])


@pytest.mark.procs
@pytest.mark.timeout(120)
def test_rank_0_drives_another_node_s_rank_over_the_group_and_stops_it_in_order():
    """Commands and replies travel on the process group's own gloo control group (tensors by value);
    STOP ends the rank, whose goodbye on the watch group tells rank 0 it stopped rather than died."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    ranks = [ctx.Process(target=_rank, args=(rank, port, results)) for rank in (0, 1)]
    for p in ranks:
        p.start()
    try:
        assert results.get(timeout=90) == [[1.0, 3.0, 5.0], [0.0, 2.0, 4.0]]  # rank 1's answer, then rank 0's
        for p in ranks:
            p.join(30)
        assert [p.exitcode for p in ranks] == [0, 0]
    finally:
        for p in ranks:
            if p.is_alive():
                p.kill()


def test_up_gives_each_node_process_its_gpus_and_the_parents_environment(make_config, monkeypatch):
    from rolefleet.up import role_env

    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("NCCL_IB_HCA", "mlx5_0")
    cfg = make_config("devices.actor=['a:0', 'a:1', 'b:2', 'b:3']", "devices.reward=['b:4']")
    first, second = role_env(cfg, "actor", 0), role_env(cfg, "actor", 1)
    assert (first["CUDA_VISIBLE_DEVICES"], second["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")
    assert second["NCCL_SOCKET_IFNAME"] == "eth0" and second["NCCL_IB_HCA"] == "mlx5_0"
    assert role_env(cfg, "reward")["CUDA_VISIBLE_DEVICES"] == "4"
    assert role_env(cfg, "coordinator")["CUDA_VISIBLE_DEVICES"] == ""
