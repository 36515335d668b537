"""Cold start of a larger model, 4 ranks on one node, twice: with read once, copy many and the
readiness gate (the defaults), and without either.

Both: while the first epoch fills the ranks' expert slots, no healthy rank is declared lost (a
rank filling its slots is judged by --load-heartbeat-timeout-s), and the server answers.
Read once: the kernel (inotify) sees each checkpoint shard opened about once for the node (its
agent), not once per rank; /cluster and /metrics count the checkpoint's bytes read from storage
once and the rest copied from shared memory. The gate: /ready, polled from the server's start,
says "warming up" after the first epoch formed and opens only after the warm-up ran every shape
with a token on every expert slot of every rank.
Without: every rank opens every shard itself (the count sees them: it is no artefact of the code path).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_ep.harness.file_opens import FileOpens

from .conftest import Server

# 64 experts of 3 x 512 x 256 float32 in 3 MoE layers: about 300 MB of experts over 4 ranks.
SHAPE = ("--arch", "deepseek_v3", "--layers", "4", "--hidden", "512", "--experts", "64", "--top-k", "6",
         "--heads", "8", "--moe-intermediate", "256")
ARGS = ["--ep-size", "4", "--redundant-experts", "0", "--restart-delay-s", "-1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model")
    subprocess.run([sys.executable, "-m", "elastic_ep.cli", "make-tiny", *SHAPE, "--out", str(out)], check=True,
                   timeout=300)
    return out


class ReadyLog:
    """GET /ready every 20 ms from the server's start: (monotonic time, ready, reason)."""

    def __init__(self, url: str):
        self.samples: list[tuple[float, bool, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(url,), daemon=True)
        self._thread.start()

    def _poll(self, url: str) -> None:
        with httpx.Client(base_url=url, timeout=5) as http:
            while not self._stop.wait(0.02):
                try:
                    body = http.get("/ready").json()
                except (httpx.HTTPError, ValueError):
                    continue
                self.samples.append((time.monotonic(), body["ready"], body.get("reason", "")))

    def close(self) -> list[tuple[float, bool, str]]:
        self._stop.set()
        self._thread.join()
        return self.samples


def shard_opens(opens: dict[str, int]) -> dict[str, int]:
    return {name: n for name, n in opens.items() if name.endswith(".safetensors")}


def start(model_dir: Path, log: Path, *extra: str, watch_ready: bool = False) -> tuple[Server, dict, ReadyLog | None]:
    """A server of 4 ranks, ready, none of them faulted while loading, answering; with `watch_ready`
    /ready polled from the moment the server process starts."""
    server = Server(["--model", str(model_dir), *ARGS, *extra], log, ready_timeout_s=None)
    ready_log = ReadyLog(server.url) if watch_ready else None
    try:
        server.wait_ready(300)
        cluster = server.wait_full_group(4, timeout_s=120)
        faults = [e["message"] for e in cluster["events"] if e["kind"] in ("fault", "fencing", "degraded")]
        assert faults == [], faults
        assert cluster["deadlines"]["load_heartbeat_timeout_s"] == 30.0
        assert server.complete("hello", 4, temperature=0)
    except BaseException:
        if ready_log is not None:
            ready_log.close()
        server.stop()
        raise
    return server, cluster, ready_log


def load_bytes(metrics: str) -> dict[tuple[str, str], float]:
    """(node, source) -> elastic_ep_load_bytes_total in a /metrics text."""
    return {(s.labels["node"], s.labels["source"]): s.value for family in text_string_to_metric_families(metrics)
            if family.name == "elastic_ep_load_bytes" for s in family.samples if s.name.endswith("_total")}


@pytest.mark.e2e
def test_read_once_copy_many_and_the_readiness_gate(model_dir, tmp_path):
    checkpoint_bytes = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    opens = FileOpens(model_dir)
    server, cluster, ready_log = start(model_dir, tmp_path / "serve.log", watch_ready=True)
    assert ready_log is not None
    try:
        counted = shard_opens(opens.close())
        # about once for the node: its agent opens each shard; no rank opens any
        assert sorted(counted) == shards and all(n <= 2 for n in counted.values()), counted

        cold = cluster["cold_start"]
        assert cold["read_once"] is True
        node = cold["bytes"]["node0"]
        assert checkpoint_bytes * 0.95 <= node["storage"] <= checkpoint_bytes, (node, checkpoint_bytes)
        assert node["shared_memory"] > node["storage"]  # dense weights x 4 ranks and every slot, from /dev/shm
        assert load_bytes(server.http.get("/metrics").text)[("node0", "storage")] == node["storage"]
        parts = cold["parts"]
        assert set(parts) == {"ranks_registered_s", "backup_read_s", "first_epoch_s", "warmup_s"}, parts
        assert cold["time_to_ready_s"] >= sum(parts.values()) - 0.01

        warmup = cold["warmup"]
        assert warmup["complete"] and warmup["shapes"] == [1, 2, 4, 8, 16, 32, 64, 128, 256], warmup
        assert warmup["slots_warmed"] == {str(r): warmup["slots_per_rank"] for r in range(4)}, warmup
        samples = ready_log.close()
        warming = [t for t, ready, reason in samples if not ready and reason.startswith("warming up")]
        opened = [t for t, ready, _ in samples if ready]
        assert warming, f"/ready never said it was warming up: {samples[-5:]}"
        assert opened and min(opened) > max(warming)  # /ready opened after the warm-up, never before
    finally:
        ready_log.close()
        server.stop()


@pytest.mark.e2e
def test_without_read_once_every_rank_opens_every_shard(model_dir, tmp_path):
    opens = FileOpens(model_dir)
    server, cluster, _ = start(model_dir, tmp_path / "serve.log", "--no-read-once", "--no-warmup-gate")
    try:
        counted = shard_opens(opens.close())
        assert all(n >= 4 for n in counted.values()), counted
        node = cluster["cold_start"]["bytes"]["node0"]
        assert node["shared_memory"] == 0 and cluster["cold_start"]["warmup"] is None, cluster["cold_start"]
    finally:
        server.stop()
