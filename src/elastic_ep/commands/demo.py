"""`elastic-ep demo`: generate text with the embedded tiny DeepSeek-V3 model and print it.

The model is random, so the text is not meaningful; the demo shows the pipeline end to end.
"""

from __future__ import annotations

import argparse
import time

import torch

from elastic_ep.model.engine import OfflineEngine
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.model.tiny import resolve_model
from elastic_ep.model.tokenizer import decode, encode, load_tokenizer

PROMPTS = ["Hello world!", "Once upon a time", "The weather today is"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny-deepseek-v3", help="checkpoint dir or embedded model name")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads; raise for large models (default 1)"
    )
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per prompt (default 24)")


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    print(f"model: {args.model} ({model_dir})")
    engine = OfflineEngine.from_pretrained(model_dir)
    tokenizer = load_tokenizer(model_dir)
    started = time.perf_counter()
    results = engine.generate(
        [encode(tokenizer, p) for p in PROMPTS], SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    )
    elapsed_s = time.perf_counter() - started
    for prompt, result in zip(PROMPTS, results, strict=True):
        print(
            f"\n> {prompt}\n  tokens: {result.token_ids}\n  text:   {decode(tokenizer, result.token_ids)!r}"
        )
    total = sum(len(r.token_ids) for r in results)
    print(
        f"\n{total} tokens for {len(PROMPTS)} prompts in {elapsed_s:.2f} s (random weights: the text is noise)"
    )
    return 0
