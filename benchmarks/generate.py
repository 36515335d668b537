"""Decode throughput of elastic-ep's offline engine against transformers' generate(), side by side.

Both run the same random checkpoint (DeepSeek-V3 or `--arch qwen3_moe`; hidden 512, 8 layers,
64 routed experts, top-6 by default) in float32 on the CPU with the same thread count, greedy, no EOS stop.
Decode tokens/s = batch * (N - 1) / (time to generate N tokens - time to generate 1 token),
so the prefill is not counted. Throughputs are the best of `--repeats` runs; the ratio is the
median over repeats of ours / theirs measured back to back.

    .venv/bin/python benchmarks/generate.py [--tokens 32] [--batches 1 16] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM

from elastic_ep.model.engine import OfflineEngine, greedy
from elastic_ep.model.tiny import ARCHS, make_tiny


def time_s(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def ours_runner(engine: OfflineEngine, prompts: list[list[int]]):
    return lambda n: engine.generate(prompts, greedy(n, ignore_eos=True))


def hf_runner(model, prompts: list[list[int]]):
    input_ids = torch.tensor(prompts)

    def run(n: int):
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    return run


def decode_tok_s(run, batch: int, tokens: int) -> float:
    """Decode tokens/s of one measurement: generating `tokens` minus generating 1 (the prefill)."""
    return batch * (tokens - 1) / (time_s(lambda: run(tokens)) - time_s(lambda: run(1)))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes of the random benchmark checkpoint (`write_model`)."""
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=128)


def add_run_arguments(parser: argparse.ArgumentParser, tokens: int) -> None:
    """How much to measure: `tokens` per sequence by default, batch sizes, repeats, threads."""
    parser.add_argument("--tokens", type=int, default=tokens, help="generated tokens per sequence")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)


def write_model(arch: str, model_dir: str, args: argparse.Namespace, **config_overrides) -> None:
    """A random checkpoint of the sizes in `args` (vocabulary 1024) into `model_dir`."""
    make_tiny(
        arch,
        model_dir,
        hidden=args.hidden,
        layers=args.layers,
        experts=args.experts,
        top_k=args.top_k,
        heads=args.heads,
        moe_intermediate=args.moe_intermediate,
        vocab=1024,
        config_overrides=config_overrides,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=ARCHS, default="deepseek_v3")
    add_model_arguments(parser)
    parser.add_argument("--prompt-len", type=int, default=64)
    add_run_arguments(parser, tokens=64)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as model_dir:
        write_model(args.arch, model_dir, args)
        engine = OfflineEngine.from_pretrained(model_dir, max_batch=max(args.batches))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(0)
        print(
            f"model: {args.arch} hidden {args.hidden}, {args.layers} layers, {args.experts} experts, "
            f"top-{args.top_k}, moe_intermediate {args.moe_intermediate}; prompt {args.prompt_len} tokens, "
            f"{args.tokens} generated; {args.threads} thread(s); {platform.processor() or platform.machine()}"
        )
        print(
            "| batch | elastic-ep decode tok/s | transformers decode tok/s | ratio, median of pairs (min-max) |"
        )
        print("|---|---|---|---|")
        for batch in args.batches:
            prompts = torch.randint(2, 1024, (batch, args.prompt_len), generator=gen).tolist()
            ours_run, hf_run = ours_runner(engine, prompts), hf_runner(hf, prompts)
            ours_run(2)
            hf_run(2)
            # Paired, interleaved repeats: on a shared machine both sides see the same load.
            pairs = [
                (decode_tok_s(ours_run, batch, args.tokens), decode_tok_s(hf_run, batch, args.tokens))
                for _ in range(args.repeats)
            ]
            ours, theirs = max(p[0] for p in pairs), max(p[1] for p in pairs)
            ratios = sorted(p[0] / p[1] for p in pairs)
            print(
                f"| {batch} | {ours:.0f} | {theirs:.0f} | {ratios[len(ratios) // 2]:.2f}x "
                f"({ratios[0]:.2f}-{ratios[-1]:.2f}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
