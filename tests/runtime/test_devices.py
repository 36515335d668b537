"""A rank's devices from --device, --backend and its index on its node: each rank of a node
takes its own GPU, gloo lets ranks share one, and settings that cannot work are refused with
the flag to change, by `serve` before it starts any rank."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from elastic_ep.errors import ElasticEPError
from elastic_ep.runtime.devices import check_node_devices, rank_devices


@pytest.fixture
def two_gpus(monkeypatch):
    """This process sees two CUDA devices (only their count is asked for here)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_ranks_take_the_gpu_of_their_local_index(two_gpus):
    assert rank_devices("cuda", "nccl", 1) == (torch.device("cuda", 1), torch.device("cuda", 1))
    assert rank_devices("auto", "nccl", 0) == (torch.device("cuda", 0), torch.device("cuda", 0))
    # gloo stages collectives through the host, so a third rank shares the first GPU
    assert rank_devices("cuda", "gloo", 2) == (torch.device("cuda", 0), torch.device("cpu"))


def test_nccl_with_more_ranks_than_gpus_names_the_flags(two_gpus):
    with pytest.raises(ElasticEPError, match="number 3 on a node with 2 GPU.*--local-ranks.*--backend gloo"):
        check_node_devices("cuda", "nccl", 3)
    check_node_devices("cuda", "gloo", 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu():
    assert rank_devices("auto", "gloo", 0) == (torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ElasticEPError, match="sees 0 CUDA device"):
        rank_devices("cuda", "gloo", 0)
    with pytest.raises(ElasticEPError, match="--backend nccl needs --device cuda"):
        rank_devices("cpu", "nccl", 0)


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_serve_refuses_nccl_without_gpus_before_starting_ranks():
    done = subprocess.run([sys.executable, "-m", "elastic_ep.cli", "serve", "--model", "tiny-deepseek-v3",
                           "--backend", "nccl", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --backend nccl needs --device cuda (the GPUs of this node)"
    assert "started rank" not in done.stdout + done.stderr and "Traceback" not in done.stderr
