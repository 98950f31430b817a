"""A role's ranks on its nodes (`trainer/nodes.py`), the config keys that place them, and the
node rank a node process takes: pure, no process starts."""

from __future__ import annotations

import pytest

from rolefleet.common.config import ConfigError
from rolefleet.rpc.server import StartupError
from rolefleet.serve import node_rank_of, rendezvous_of
from rolefleet.trainer.node import node_problem
from rolefleet.trainer.nodes import NodeLayout, layout_for
from rolefleet.trainer.rendezvous import Rendezvous

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


def test_a_group_beyond_loopback_needs_the_runs_token(make_config):
    from rolefleet.rpc.security import OPEN, Security

    cfg = make_config("actor.workers=4", "actor.nodes=2", "actor.rendezvous.host=actor-0.actor-nodes")
    with pytest.raises(StartupError, match="actor.rendezvous.host=actor-0.actor-nodes: a worker group over several"):
        rendezvous_of("actor", cfg, OPEN)
    layout, rdzv = rendezvous_of("actor", cfg, Security(token="s3cret"))
    assert layout.counts == (2, 2) and (rdzv.host, rdzv.port, rdzv.timeout_s) == ("actor-0.actor-nodes", 29500, 300)
    assert rdzv.authkey("n1") != rdzv.authkey("n2")  # a new formation, a new key
    assert rdzv.authkey("n1") != Rendezvous("actor", "h", 1, 1, b"other").authkey("n1")
    _, local = rendezvous_of("actor", make_config("actor.workers=4", "actor.nodes=2"), OPEN)
    assert local.loopback  # on loopback (`rolefleet up`) no token is needed
    one, _ = rendezvous_of("actor", make_config("actor.workers=2"), OPEN)
    assert not one.spans


@pytest.mark.timeout(60)
def test_the_command_channel_admits_only_the_formations_key_and_carries_plain_tensors():
    """In one process: rank 0's side of a two-node formation, a stranger with another token refused
    in the handshake, the real rank admitted, a tensor sent by value (no shared-memory handle)."""
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client

    import torch

    from rolefleet.trainer.rendezvous import FirstNode, Keys, RendezvousError, connect_commands, host_store, join_store

    layout = NodeLayout((1, 1))
    store = host_store(Rendezvous("actor", "127.0.0.1", 0, 5.0, b"token"))
    rdzv = Rendezvous("actor", "127.0.0.1", store.port, 5.0, b"token")
    first = FirstNode(rdzv, layout, store)
    with pytest.raises(RendezvousError, match=r"rendezvous timed out after 0 s .* for node 1 \(node1, rank 1\)"):
        FirstNode.wait_for_nodes(type("Late", (), {"rdzv": Rendezvous("actor", "127.0.0.1", store.port, 0.3),
                                                   "layout": layout, "store": store})())
    client = join_store(rdzv, "node 1")
    client.set(Keys.node(1, "joined"), "here")
    first.wait_for_nodes()
    accepted = {}
    acceptor = threading.Thread(target=lambda: accepted.update(first.accept_ranks()), daemon=True)
    acceptor.start()
    stranger = Rendezvous("actor", "127.0.0.1", store.port, 5.0, b"another run's token")
    nonce = client.get(Keys.NONCE).decode()
    with pytest.raises(AuthenticationError):
        Client(("127.0.0.1", int(client.get(Keys.COMMANDS))), authkey=stranger.authkey(nonce))
    channel = [connect_commands(rdzv, client, 1)]
    acceptor.join(5)
    assert list(accepted) == [1]
    accepted[1].send(("step", torch.arange(4.0)))
    what, tensor = channel[0].recv()
    assert what == "step" and torch.equal(tensor, torch.arange(4.0)) and not tensor.is_shared()
    channel[0].close()
    assert accepted[1].wait_closed(5)  # the rank's end closed: what rank 0 reads as a hang-up


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
