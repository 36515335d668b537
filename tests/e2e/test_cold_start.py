"""Cold start of a larger model: while the first epoch fills the ranks' expert slots, no healthy
rank is declared lost (a rank filling its slots is judged by --load-heartbeat-timeout-s)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import Server

# 64 experts of 3 x 512 x 256 float32 in 3 MoE layers: about 300 MB of experts over 4 ranks.
SHAPE = ("--arch", "deepseek_v3", "--layers", "4", "--hidden", "512", "--experts", "64", "--top-k", "6",
         "--heads", "8", "--moe-intermediate", "256")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, "-m", "elastic_ep.cli", "make-tiny", *SHAPE, "--out", str(out)], check=True,
                   timeout=300)
    return out


@pytest.mark.parametrize("start", [1, 2])
def test_no_rank_is_fenced_while_the_first_epoch_loads(model_dir, tmp_path, start):
    args = ["--model", str(model_dir), "--ep-size", "4", "--redundant-experts", "0", "--restart-delay-s", "-1"]
    server = Server(args, tmp_path / "serve.log", ready_timeout_s=300)
    try:
        cluster = server.wait_full_group(4, timeout_s=120)
        faults = [e["message"] for e in cluster["events"] if e["kind"] in ("fault", "fencing", "degraded")]
        assert faults == [], faults
        assert cluster["deadlines"]["load_heartbeat_timeout_s"] == 30.0
        assert server.complete("hello", 4, temperature=0)
    finally:
        server.stop()
