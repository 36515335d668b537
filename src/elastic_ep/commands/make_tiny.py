"""`elastic-ep make-tiny`: write a small random checkpoint in Hugging Face format."""

from __future__ import annotations

import argparse

from elastic_ep.model.checkpoint import DTYPES
from elastic_ep.model.tiny import ARCHS, make_tiny


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", required=True, choices=ARCHS, help="model architecture")
    parser.add_argument("--out", required=True, help="output directory (created if missing)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE layer (default 16)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token (default 4)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument(
        "--moe-intermediate", type=int, default=None, help="expert MLP width (default hidden/2)"
    )
    parser.add_argument("--vocab", type=int, default=384, help="vocabulary size, >= 258 (default 384)")
    parser.add_argument(
        "--shards", type=int, default=2, help="safetensors files; 1 writes no index (default 2)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed; same seed, same bytes (default 0)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="float32",
        help="dtype of the stored weights (default float32)",
    )


def run(args: argparse.Namespace) -> int:
    out = make_tiny(
        args.arch,
        args.out,
        seed=args.seed,
        num_shards=args.shards,
        layers=args.layers,
        hidden=args.hidden,
        experts=args.experts,
        top_k=args.top_k,
        heads=args.heads,
        moe_intermediate=args.moe_intermediate,
        vocab=args.vocab,
        dtype=args.dtype,
    )
    print(f"wrote {args.arch} checkpoint to {out}")
    return 0
