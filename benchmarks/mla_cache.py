"""DeepSeek decode speed and KV bytes with the MLA latent cache against the per-head cache, side by side.

One random DeepSeek-V3 checkpoint (hidden 512, 8 layers, 64 routed experts top-6, 8 heads,
kv_lora_rank 256 by default), two models on it: `mla_cache="latent"` (latent + rope key per
token and layer, absorbed decode) and `mla_cache="per_head"` (per-head keys and values). Each
prefills `batch` random prompts (not timed), then runs `--tokens` decode steps of the whole
batch through `model.forward` with all experts local; decode tok/s = batch x steps / their wall
time. float32, 1 thread by default. The two caches alternate within each repeat; throughputs
are the best of `--repeats`, the ratio is the median of the per-repeat ratios (min-max).

    .venv/bin/python benchmarks/mla_cache.py [--prompt-lens 64 512] [--batches 1 16] [--tokens 32]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time

import torch

from elastic_ep.model.engine import OfflineEngine
from elastic_ep.model.model import SeqChunk
from generate import add_model_arguments, add_run_arguments, write_model

CACHES = ("latent", "per_head")


def decode_tok_s(engine: OfflineEngine, prompts: list[list[int]], steps: int) -> float:
    """Decode tokens/s of `steps` greedy steps of every prompt after an untimed prefill."""
    model, moe_fn = engine.model, engine.moe_fn
    per_seq = -(-(len(prompts[0]) + steps) // 16)
    cache = model.new_kv_cache(len(prompts) * per_seq)
    for seq in range(len(prompts)):
        cache.set_blocks(seq, list(range(seq * per_seq, (seq + 1) * per_seq)))
    logits = model.forward([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], cache, moe_fn)
    started = time.perf_counter()
    for step in range(steps):
        tokens = logits.argmax(dim=-1).tolist()
        pos = len(prompts[0]) + step
        logits = model.forward([SeqChunk(i, [t], pos) for i, t in enumerate(tokens)], cache, moe_fn)
    return len(prompts) * steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--kv-lora-rank", type=int, default=256)
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="qk_nope and v head dim, rope half of it (default hidden/heads)",
    )
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 512])
    add_run_arguments(parser, tokens=32)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as model_dir:
        head_dims = (
            {
                "qk_nope_head_dim": args.head_dim,
                "v_head_dim": args.head_dim,
                "qk_rope_head_dim": args.head_dim // 2,
            }
            if args.head_dim
            else {}
        )
        write_model("deepseek_v3", model_dir, args, kv_lora_rank=args.kv_lora_rank, **head_dims)
        engines = {cache: OfflineEngine.from_pretrained(model_dir, mla_cache=cache) for cache in CACHES}
        hf = engines["latent"].model.config.hf
        kv_bytes = {cache: e.model.new_kv_cache(1, block_size=1).bytes_per_token for cache, e in engines.items()}
        print(
            f"model: deepseek_v3 hidden {args.hidden}, {args.layers} layers, {args.experts} experts top-"
            f"{args.top_k}, {args.heads} heads (qk {hf['qk_nope_head_dim']}+{hf['qk_rope_head_dim']}, v "
            f"{hf['v_head_dim']}), kv_lora_rank {args.kv_lora_rank}; {args.tokens} decode steps; "
            f"{args.threads} thread(s); {platform.processor() or platform.machine()}"
        )
        print(
            f"KV bytes per token (all layers, float32): latent {kv_bytes['latent']}, per-head "
            f"{kv_bytes['per_head']} ({kv_bytes['per_head'] / kv_bytes['latent']:.1f}x)"
        )
        print(
            "| prompt | batch | latent decode tok/s | per-head decode tok/s | latent / per-head (min-max) |"
        )
        print("|---|---|---|---|---|")
        gen = torch.Generator().manual_seed(0)
        for prompt_len in args.prompt_lens:
            for batch in args.batches:
                prompts = torch.randint(2, 1024, (batch, prompt_len), generator=gen).tolist()
                for engine in engines.values():
                    decode_tok_s(engine, prompts, 2)
                pairs = [
                    tuple(decode_tok_s(engines[cache], prompts, args.tokens) for cache in CACHES)
                    for _ in range(args.repeats)
                ]
                ratios = sorted(latent / per_head for latent, per_head in pairs)
                print(
                    f"| {prompt_len} | {batch} | {max(p[0] for p in pairs):.0f} | {max(p[1] for p in pairs):.0f} "
                    f"| {ratios[len(ratios) // 2]:.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f}) |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
