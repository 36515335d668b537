"""Whether a registering rank may join: every rank of a group computes on one device kind, so a
rank that comes up on the CPU of a node whose GPUs are gone (under --device auto) is refused,
with the node and the flag to pass."""

from elastic_ep.control.membership.nodes import device_kind, wrong_device
from elastic_ep.wire import WorkerHello


def hello(device: str) -> WorkerHello:
    return WorkerHello(3, "node1", 1234, "recover", device=device)


def test_ranks_on_the_groups_device_kind_join_whatever_their_gpu():
    assert device_kind("cuda:5") == "cuda"
    assert wrong_device("cuda", hello("cuda:1")) == ""
    assert wrong_device("cpu", hello("cpu")) == ""


def test_a_rank_on_another_device_kind_is_refused_with_the_node_and_the_flag():
    reason = wrong_device("cuda", hello("cpu"))
    assert "rank 3 on node1 came up on cpu, but the group runs on cuda" in reason
    assert "--device cuda" in reason
