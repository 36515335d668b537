"""`make gpu-check`'s script, dry-run on the CPU (`--device cpu`) so that it still runs when a
GPU finally is there: its parity, `serve` kill -9 and SIGSTOP checks and decode figure all
complete and pass, and without a GPU the plain command checks nothing and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"


def test_the_gpu_check_script_runs_its_checks_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["check"] for r in results] == ["parity", "serve SIGKILL of a rank (gloo)",
                                             "serve SIGSTOP of a rank (gloo)", "decode tokens/s"]
    assert all(r["ok"] for r in results)
    assert all(r["outputs_equal"] for r in results[1:3])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: make gpu-check runs for real")
def test_without_a_gpu_the_check_claims_nothing():
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "nothing was checked" in done.stdout
