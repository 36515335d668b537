"""Rolling restart end to end: a real server (3 ranks, tiny model, admin key) under streaming
greedy load; `elastic-ep rollout` replaces every worker process one at a time (drain, stop, start
on its node, rejoin) with new options (the checkpoint copied to another directory, another KV
pool size). No request fails, every output equals the fault-free run, every pid changed (each
process really restarted, and runs the new options), the group never held fewer ranks than hold
every expert, and /cluster showed the progress while it ran. Then impossible or malformed
requests are refused, and a second rollout is aborted from the command line: the rank in flight
finishes, no other moves. (A standby taking each rank's place is covered by the driver's tests
with stand-ins and measured for real by benchmarks/rolling_restart.py.)
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading

import httpx
import psutil

from elastic_ep.model.tiny import resolve_model

from .conftest import Server, reference_load

MODEL = "tiny-deepseek-v3"
ADMIN = "admin-key"
# 16 experts + 8 redundant over 3 ranks: 8 slots per rank, so 2 ranks hold every expert. No
# readiness gate: each rank's drain and return forms 3 epochs, each of which would run its warm-up
# forwards first (the gate is proven in test_cold_start.py and test_serve.py).
# --worker-start exec: the test reads each new process's WorkerArgs from its command line, which a
# worker forked from the zygote does not have (its title names only its rank and node)
SERVE_ARGS = ["--model", MODEL, "--ep-size", "3", "--redundant-experts", "8", "--scale-drain-timeout-s", "1.0",
              "--no-warmup-gate", "--worker-start", "exec"]


def rollout(server: Server, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elastic_ep.cli", "rollout", server.url, "--poll-s", "0.1",
                           "--admin-api-key", ADMIN, *args], capture_output=True, text=True, timeout=300)


def whole(cluster: dict) -> bool:
    """3 members serving, nothing moving."""
    return (cluster["ready"] and len(cluster["members"]) == 3 and all(r["state"] == "serving" for r in cluster["ranks"])
            and not cluster["scale"]["is_scaling_elastic_ep"] and not cluster["rollout"]["active"])


class Watch:
    """Polls /cluster in a thread while the rollout runs: the progress it showed, the fewest members."""

    def __init__(self, server: Server):
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.seen: list[tuple[int | None, str | None, int]] = []  # (rank in flight, phase, replaced so far)
        self.fewest_members = 99
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            cluster = self.http.get("/cluster", params={"events": 1}).json()
            self.fewest_members = min(self.fewest_members, len(cluster["members"]))
            view = cluster["rollout"]
            if view["active"]:
                self.seen.append((view["rank_in_flight"], view["phase"], view["replaced_count"]))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.http.close()


def test_rolling_restart_of_every_rank_under_load(tmp_path):
    moved = tmp_path / "moved-checkpoint"
    shutil.copytree(resolve_model(MODEL), moved)
    server = Server(SERVE_ARGS, tmp_path / "serve.log", admin_api_key=ADMIN)
    try:
        before = server.wait_for(whole, timeout_s=90, what="3 ranks serving")
        old = {r["rank_id"]: r["pid"] for r in before["ranks"]}
        assert len(old) == 3
        blocks = {r: p["blocks"] for r, p in before["kv_cache"]["ranks"].items()}
        new_blocks = max(blocks.values()) + 8
        assert httpx.post(f"{server.url}/rolling_restart", json={}).status_code == 401  # the admin key guards it

        with reference_load(server, MODEL, threads=3) as load:
            load.wait_done(1)
            server.wait_for(whole, timeout_s=60, what="3 ranks serving under load")
            watch = Watch(server)
            try:
                done = rollout(server, "--model", str(moved), "--num-gpu-blocks-override", str(new_blocks))
            finally:
                watch.stop()
            assert done.returncode == 0, done.stdout + done.stderr
            assert "rolling restart done" in done.stdout and "[3/3 replaced] done" in done.stdout, done.stdout
            load.wait_done(load.done + 2)
        assert not load.failures, load.failures[:3]
        assert load.done > 0

        after = server.wait_for(whole, timeout_s=60, what="the group whole again")
        view = after["rollout"]
        assert view["state"] == "done" and view["replaced_count"] == 3 and view["pending"] == []
        assert {r["rank_id"]: r["old_pid"] for r in view["replaced"]} == old
        assert [(r["plan"], r["new_rank_id"]) for r in view["replaced"]] == [("restart", r) for r in (0, 1, 2)]
        new = {r["rank_id"]: r["pid"] for r in after["ranks"]}
        assert not set(new.values()) & set(old.values())  # every process was replaced
        for pid in old.values():
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        for r in after["ranks"]:  # the new processes run the new options, and say which elastic-ep they run
            launch = json.loads(psutil.Process(r["pid"]).cmdline()[-1])  # the WorkerArgs it started with
            assert launch["model_dir"] == str(moved) and launch["num_gpu_blocks_override"] == new_blocks
            assert r["version"] == server.http.get("/version").json()["version"]
        assert {p["blocks"] for p in after["kv_cache"]["ranks"].values()} == {new_blocks}

        assert watch.fewest_members >= 2  # never fewer than the ranks that hold every expert
        # every rank went through each phase (the events say so: a 0.1 s poll can miss a short one),
        # and the poll saw nothing else
        events = server.http.get("/cluster", params={"events": 0}).json()["events"]
        entered = [(e["rank_id"], e["phase"]) for e in events if e["kind"] == "rollout" and "phase" in e]
        assert entered == [(r, p) for r in (0, 1, 2) for p in ("draining", "stopping", "starting")], entered
        polled = {phase for _, phase, _ in watch.seen if phase is not None}  # None: between two ranks
        assert polled and polled <= {"draining", "stopping", "starting"}, polled
        assert len({rank for rank, _, _ in watch.seen if rank is not None}) >= 3  # one rank after another
        assert [n for _, _, n in watch.seen] == sorted(n for _, _, n in watch.seen)  # progress only grows

        torn = tmp_path / "torn-checkpoint"
        shutil.copytree(moved, torn)
        for shard in torn.glob("*.safetensors"):
            shard.write_bytes(shard.read_bytes()[:100])
        for body, needle in [({"model": str(tmp_path / "nowhere")}, "cannot be read"),
                             ({"model": str(torn)}, "cannot be read"),
                             ({"gpu_memory_utilization": 2}, "gpu_memory_utilization"),
                             ({"max_num_seqs": 4}, "max_num_seqs")]:
            reply = server.http.post("/rolling_restart", json=body)
            assert reply.status_code == 400 and needle in reply.text, (body, reply.text)
        nothing = rollout(server, "--abort")
        assert nothing.returncode == 2 and "no rolling restart is in flight" in nothing.stderr, nothing.stderr

        started = rollout(server, "--no-wait")
        assert started.returncode == 0, started.stderr
        busy = server.http.post("/scale_elastic_ep", json={"new_ep_size": 2})
        assert busy.status_code == 409 and "rolling restart is in flight" in busy.text, busy.text
        again = server.http.post("/rolling_restart", json={})
        assert again.status_code == 409 and "rolling restart is in flight" in again.text, again.text
        aborted = rollout(server, "--abort")
        assert aborted.returncode == 0 and "rolling restart aborted" in aborted.stdout, aborted.stdout + aborted.stderr
        at_abort = re.search(r"aborting: (?:rank (\d+) \(\w+\) finishes|no rank in flight); ranks replaced: \[(.*)\]",
                             aborted.stdout)
        assert at_abort, aborted.stdout
        view = server.cluster()["rollout"]
        # the rank in flight when the abort came finished; no other was touched
        finished = [int(r) for r in at_abort[2].split(", ") if r] + ([int(at_abort[1])] if at_abort[1] else [])
        assert view["state"] == "aborted" and [r["rank_id"] for r in view["replaced"]] == finished, view
        assert view["pending"]  # the ranks after it kept their processes
    finally:
        server.stop()
