"""The GPU checks (`make gpu-check`): what the CPU suite cannot show, on a machine with CUDA.

1. parity on the device: greedy tokens of `elastic-ep generate --device cuda` equal to
   `--device cpu` (float32), and the tiny model's logits on the GPU within 1e-3 of the CPU's;
2. `serve --device cuda --backend gloo` with 2 ranks sharing one GPU (collectives staged through
   the host) survives `kill -9` and SIGSTOP of a rank with outputs equal to the fault-free run;
3. where there are two or more GPUs: an epoch's NCCL group with a dead peer and with a stopped
   one (the survivor's collective raises, or is freed by the abort, and how long after the abort),
   then the `serve` checks with `--backend nccl` (one GPU per rank; the survivors' communicator is
   aborted on the controller's order);
4. decode tokens/s of the offline engine on the GPU against the CPU, batch 16.

Without a CUDA device it prints why and exits 0 (nothing is claimed). Results go to stdout as
JSON lines and, with --out, to a file.

    .venv/bin/python scripts/gpu_check.py [--out gpu_check.json] [--device cpu: a dry run of the script]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

from elastic_ep.harness.group_faults import aborted_while_waiting, peer_dies
from elastic_ep.harness.load import PROMPTS, streams_with_fault
from elastic_ep.harness.ranks import run_ranks
from elastic_ep.harness.server_process import ServerProcess
from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.model import SeqChunk
from elastic_ep.model.tiny import resolve_model
from elastic_ep.model.tokenizer import encode, load_tokenizer

MODEL = "tiny-deepseek-v3"
TOKENS = 32  # of each greedy text: parity and the serve checks compare texts of one length (one run each)


@cache
def generate(device: str, tokens: int = TOKENS) -> tuple[str, ...]:
    """Greedy texts of PROMPTS from `elastic-ep generate` (one process per device and length: the
    dry run's parity and its two serve checks ask for the same CPU run)."""
    cmd = [sys.executable, "-m", "elastic_ep.cli", "generate", "--json", "--model", MODEL, "--max-tokens",
           str(tokens), "--device", device, "--dtype", "float32"]
    for p in PROMPTS:
        cmd += ["--prompt", p]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600).stdout
    return tuple(json.loads(line)["text"] for line in out.splitlines() if line.strip())


def prefill_logits(device: str, ids: list[int]) -> torch.Tensor:
    engine = OfflineEngine.from_pretrained(resolve_model(MODEL), device=device)
    cache = engine.model.new_kv_cache(-(-len(ids) // 16))
    cache.set_blocks(0, list(range(cache.num_blocks)))
    return engine.model.forward([SeqChunk(0, ids, 0)], cache, engine.moe_fn).cpu()


def parity(device: str) -> dict:
    on_gpu, on_cpu = generate(device), generate("cpu")
    ids = encode(load_tokenizer(resolve_model(MODEL)), PROMPTS[0])
    diff = float((prefill_logits(device, ids) - prefill_logits("cpu", ids)).abs().max())
    return {"check": "parity", "tokens_equal": on_gpu == on_cpu, "max_logit_diff": diff, "ok": on_gpu == on_cpu
            and diff < 1e-3}


def serve_survives(device: str, backend: str, fault: signal.Signals) -> dict:
    """`serve` with 2 ranks on the GPU(s); `fault` (SIGKILL: dead, SIGSTOP: stopped) lands on rank
    1 mid-stream; every stream must finish with the fault-free run's text."""
    log = Path(tempfile.mkdtemp()) / "serve.log"
    server = ServerProcess(["--model", MODEL, "--ep-size", "2", "--device", device, "--backend", backend,
                            "--restart-delay-s", "-1"], log)
    try:
        server.wait_full_group(2)
        expected = generate(device)
        pid = server.pids()[1]
        results = streams_with_fault(server.url, lambda: os.kill(pid, fault), PROMPTS, TOKENS, temperature=0)
        texts = tuple(r.text for r in results)
        state = server.wait_for(lambda c: any(e["kind"] == "recovered" for e in c["events"]), 60, "the recovery")
        recovered = next(e for e in state["events"] if e["kind"] == "recovered")
        # A GPU's kernels may round differently with the batch's shape (a stream is batched
        # differently once a rank is gone): where texts differ, how far they agree says whether it
        # is a near-tie late in the text or a wrong recovery.
        agree = [len(os.path.commonprefix([t, e])) for t, e in zip(texts, expected, strict=True) if t != e]
        return {"check": f"serve {fault.name} of a rank ({backend})", "outputs_equal": texts == expected,
                "differing_streams_agree_chars": agree,
                "pause_s": round(max(r.largest_gap for r in results), 3), "recovery_s": recovered["total_s"],
                "ok": texts == expected}
    finally:
        server.stop()


def nccl_group_faults() -> dict:
    """An epoch's NCCL group on two GPUs (harness/group_faults.py, as the CPU suite runs them with
    gloo): a dead peer makes the survivor's all-to-all raise (NCCL's error, or the deadline), and
    an abort frees an all-to-all waiting on a stopped peer, measured from the abort."""
    (dead,) = run_ranks(peer_dies, 2, "nccl", answering=[0])
    (stopped,) = run_ranks(aborted_while_waiting, 2, "nccl", answering=[0])
    return {"check": "nccl group faults", "dead_peer": dead, "stopped_peer": stopped,
            "ok": dead["raised"] is not None and stopped["raised"] is not None and stopped["next_epoch"] == [7.0]}


def decode_speed(device: str, batch: int = 16, tokens: int = 64) -> dict:
    rates = {}
    tokenizer = load_tokenizer(resolve_model(MODEL))
    prompts = [encode(tokenizer, p) for p in (PROMPTS * batch)[:batch]]
    for where in dict.fromkeys((device, "cpu")):  # the dry run (device cpu) measures the CPU once
        engine = OfflineEngine.from_pretrained(resolve_model(MODEL), device=where)
        engine.generate(prompts, greedy(4, ignore_eos=True))
        t0 = time.perf_counter()
        engine.generate(prompts, greedy(tokens, ignore_eos=True))
        rates[where] = round(batch * tokens / (time.perf_counter() - t0), 1)
    return {"check": "decode tokens/s", **rates, "ok": True}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="also write the results here (JSON lines)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: a dry run of this script on a machine without a GPU (checks nothing GPU-side)")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device on this machine; nothing was checked (the CPU suite runs the same code "
              "with --device cpu)")
        return 0
    checks = [("parity", lambda: parity(device)),
              ("serve kill -9 (gloo)", lambda: serve_survives(device, "gloo", signal.SIGKILL)),
              ("serve SIGSTOP (gloo)", lambda: serve_survives(device, "gloo", signal.SIGSTOP))]
    if device == "cuda" and torch.cuda.device_count() >= 2:
        checks += [("nccl group faults", nccl_group_faults),
                   ("serve kill -9 (nccl)", lambda: serve_survives(device, "nccl", signal.SIGKILL)),
                   ("serve SIGSTOP (nccl)", lambda: serve_survives(device, "nccl", signal.SIGSTOP))]
    # the dry run's figure is of the CPU, which benchmarks/ measures: a short decode runs the same code
    checks.append(("decode tokens/s", lambda: decode_speed(device, tokens=64 if device == "cuda" else 16)))
    results = []
    for name, check in checks:
        try:
            result = check()
        except Exception as e:  # a check that cannot run is reported, the others still run
            result = {"check": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        results.append(result)
        print(json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
