"""`elastic-ep generate`: offline batched generation in one process."""

from __future__ import annotations

import argparse
import json

import torch

from elastic_ep.model.checkpoint import DTYPES
from elastic_ep.model.engine import OfflineEngine
from elastic_ep.model.kv_cache import pool_num_blocks
from elastic_ep.model.model import resolve_device
from elastic_ep.model.sampling import SamplingParams
from elastic_ep.model.tiny import resolve_model
from elastic_ep.model.tokenizer import decode, encode, load_tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="tiny-deepseek-v3", help="checkpoint dir, or tiny-deepseek-v3 / tiny-qwen3-moe"
    )
    parser.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    parser.add_argument(
        "--top-k", type=int, default=0, help="sample among the k best tokens, 0 = off (default 0)"
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability"
    )
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="[-2, 2], over output tokens")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="[-2, 2], over output tokens")
    parser.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="(0, 2], over prompt and output tokens"
    )
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: the prompt's index)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at an EOS token")
    parser.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=[],
        help="a token id that ends generation; repeatable",
    )
    parser.add_argument(
        "--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens"
    )
    parser.add_argument(
        "--logprobs", type=int, default=None, help="with --json: each token's raw logprob and the top N"
    )
    parser.add_argument("--max-batch", type=int, default=16, help="sequences in flight at once (default 16)")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads; raise for large models (default 1)"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="weights, KV cache and compute; auto = the checkpoint's (config.json's dtype / torch_dtype, "
        "else the stored weights') (default auto)",
    )
    parser.add_argument(
        "--device",
        default=None,
        help="torch device to run on, e.g. cpu, cuda, cuda:1 (default: cuda if present)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per prompt")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    parser.add_argument(
        "--kv-cache-memory", type=int, default=0,
        help="bytes of the KV pool (default 0: on a GPU --gpu-memory-utilization, else room for the batch)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9,
        help="on a GPU, the fraction of its memory in use: the KV pool gets what the weights leave (default 0.9)",
    )
    parser.add_argument(
        "--num-gpu-blocks-override", type=int, default=0, help="blocks of the KV pool, whatever the budget"
    )
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="share the KV blocks of a common token prefix between prompts (default on)",
    )


def pool_blocks(args: argparse.Namespace, engine: OfflineEngine) -> int | None:
    """The KV pool's blocks from the flags; None: sized to the prompts given."""
    device = engine.model.device
    measure = device.type == "cuda" and not args.kv_cache_memory
    if not (args.num_gpu_blocks_override or args.kv_cache_memory or measure):
        return None
    budget = args.kv_cache_memory
    if measure:
        budget = int(torch.cuda.mem_get_info(device)[1] * args.gpu_memory_utilization) - torch.cuda.memory_allocated(
            device)
    bytes_per_block = engine.model.new_kv_cache(1, args.block_size).bytes_per_token * args.block_size
    return pool_num_blocks(bytes_per_block, override=args.num_gpu_blocks_override, budget_bytes=budget)


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        stop_token_ids=tuple(args.stop_token_id),
        logprobs=args.logprobs,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    params.validate()
    model_dir = resolve_model(args.model)
    engine = OfflineEngine.from_pretrained(
        model_dir,
        max_batch=args.max_batch,
        dtype=args.dtype,
        device=resolve_device(args.device),
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    engine.num_blocks = pool_blocks(args, engine)
    tokenizer = load_tokenizer(model_dir)
    prompts = [encode(tokenizer, text) for text in args.prompt]
    results = engine.generate(prompts, params)
    for text, result in zip(args.prompt, results, strict=True):
        completion = decode(tokenizer, result.token_ids)
        if args.json:
            record = {
                "prompt": text,
                "prompt_token_ids": result.prompt_token_ids,
                "token_ids": result.token_ids,
                "text": completion,
                "finish_reason": result.finish_reason,
            }
            if args.logprobs is not None:
                record["logprobs"] = [{"logprob": lp.logprob, "top": lp.top} for lp in result.logprobs]
            print(json.dumps(record))
        else:
            print(f"prompt: {text!r}\ncompletion: {completion!r} ({result.finish_reason})\n")
    return 0
