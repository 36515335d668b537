"""Small random checkpoints in Hugging Face format, and the embedded model names.

`make_tiny` writes config.json (loadable by transformers), safetensors shards with the
standard per-expert tensor names plus an index, and a byte-level BPE tokenizer.json trained on
an embedded text; `write_checkpoint` does the same for a config.json given whole (the test
vectors of hand-written configs). Weights are random, deterministic for a seed, stored in the
dtype config.json declares, and scaled so that hidden states keep their size through the
layers and greedy decoding gives varied tokens.
`resolve_model("tiny-deepseek-v3")` builds such a checkpoint once into the cache directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from elastic_ep.errors import CheckpointError

from .checkpoint import DTYPES, INDEX_FILE, expert_key
from .config import MoEConfig

TINY_MODELS: dict[str, str] = {"tiny-deepseek-v3": "deepseek_v3", "tiny-qwen3-moe": "qwen3_moe"}
ARCHS = ("deepseek_v3", "qwen3_moe")
# Bump when the default tiny checkpoints change, so stale cached copies are not reused.
TINY_FORMAT_VERSION = 2
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>"]
BOS_ID, EOS_ID = 0, 1

CORPUS = """\
The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.
A mixture of experts model sends every token to a few experts chosen by a router.
When one rank fails, the others keep serving: the experts are placed again and the step runs again.
Elastic expert parallelism grows and shrinks the group of ranks without dropping a request.
Once upon a time there was a small model that wanted to speak like a large one.
It read books about rivers, mountains, cities, numbers and the stars at night.
One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April May June.
The weather today is cloudy with a chance of rain in the afternoon and clear skies at night.
Questions and answers: what is the capital of France? Paris. What color is the sky? Blue.
def add(a, b): return a + b  # code is text too, with brackets, colons and numbers 0 1 2 3 4 5 6 7 8 9
Hello world! How are you? I am fine, thank you. Good morning, good evening, good night.
"""


def default_config(
    arch: str,
    *,
    layers: int = 4,
    hidden: int = 64,
    experts: int = 16,
    top_k: int = 4,
    heads: int = 4,
    moe_intermediate: int | None = None,
    intermediate: int | None = None,
    vocab: int = 384,
    max_position_embeddings: int = 2048,
    dtype: str = "float32",
) -> dict[str, Any]:
    """The config.json dict of a tiny checkpoint of `arch` with the given sizes, weights in
    `dtype` (float32, bfloat16 or float16)."""
    if arch not in ARCHS:
        raise CheckpointError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHS)}")
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}")
    if top_k > experts:
        raise CheckpointError(f"top-k {top_k} exceeds the number of experts {experts}; lower --top-k")
    moe_intermediate = moe_intermediate or max(hidden // 2, 8)
    intermediate = intermediate or 2 * hidden
    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "moe_intermediate_size": moe_intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if arch == "deepseek_v3":
        n_group = 4 if experts % 4 == 0 and experts >= 8 else 1
        head_dim = max(hidden // heads, 8)
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **common,
            "num_key_value_heads": heads,
            "n_routed_experts": experts,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1 if layers > 1 else 0,
            "n_group": n_group,
            "topk_group": max(n_group // 2, 1) if top_k <= experts // 2 else n_group,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "q_lora_rank": max(hidden // 2, 8),
            "kv_lora_rank": max(hidden // 2, 8),
            "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": max(head_dim // 2, 4),
            "v_head_dim": head_dim,
            "rope_theta": 10000.0,
            "rope_interleave": True,
        }
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **common,
        "num_key_value_heads": max(heads // 2, 1),
        "head_dim": max(hidden // heads, 8),
        "num_experts": experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": layers,
        "router_aux_loss_coef": 0.001,
        "output_router_logits": False,
    }


def tensor_shapes(cfg: MoEConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the checkpoint and its shape, in a fixed order."""
    hf = cfg.hf
    h, inter, moe_i = cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update({p + "self_attn." + k: v for k, v in _attention_shapes(hf, cfg.arch).items()})
        if layer not in cfg.moe_layers:
            shapes.update(_mlp_shapes(p + "mlp.", h, inter))
            continue
        shapes[p + "mlp.gate.weight"] = (cfg.num_experts, h)
        if cfg.arch == "deepseek_v3":
            shapes[p + "mlp.gate.e_score_correction_bias"] = (cfg.num_experts,)
            shapes.update(_mlp_shapes(p + "mlp.shared_experts.", h, moe_i * int(hf["n_shared_experts"])))
        for e in range(cfg.num_experts):
            shapes[expert_key(layer, e, "gate_proj")] = (moe_i, h)
            shapes[expert_key(layer, e, "up_proj")] = (moe_i, h)
            shapes[expert_key(layer, e, "down_proj")] = (h, moe_i)
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inter: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inter, hidden),
        prefix + "up_proj.weight": (inter, hidden),
        prefix + "down_proj.weight": (hidden, inter),
    }


def _attention_shapes(hf: dict[str, Any], arch: str) -> dict[str, tuple[int, ...]]:
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    if arch == "qwen3_moe":
        d, kvh = hf["head_dim"], hf["num_key_value_heads"]
        return {
            "q_proj.weight": (heads * d, h),
            "k_proj.weight": (kvh * d, h),
            "v_proj.weight": (kvh * d, h),
            "o_proj.weight": (h, heads * d),
            "q_norm.weight": (d,),
            "k_norm.weight": (d,),
        }
    qk = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]
    q_rank, kv_rank = hf.get("q_lora_rank"), hf["kv_lora_rank"]
    shapes: dict[str, tuple[int, ...]] = (
        {"q_proj.weight": (heads * qk, h)}
        if q_rank is None
        else {
            "q_a_proj.weight": (q_rank, h),
            "q_a_layernorm.weight": (q_rank,),
            "q_b_proj.weight": (heads * qk, q_rank),
        }
    )
    shapes["kv_a_proj_with_mqa.weight"] = (kv_rank + hf["qk_rope_head_dim"], h)
    shapes["kv_a_layernorm.weight"] = (kv_rank,)
    shapes["kv_b_proj.weight"] = (heads * (hf["qk_nope_head_dim"] + hf["v_head_dim"]), kv_rank)
    shapes["o_proj.weight"] = (h, heads * hf["v_head_dim"])
    return shapes


def _random_tensor(
    name: str, shape: tuple[int, ...], gen: torch.Generator, quiet_ids: list[int]
) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=gen)
    if name == "model.embed_tokens.weight":
        return torch.randn(shape, generator=gen)
    weight = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
    if name == "lm_head.weight":
        # Wide logits give varied greedy output; quiet tokens (special, unprintable, unused) get
        # logit 0, far below the best of the others, so random weights neither stop at once nor
        # print garbage bytes.
        weight = weight * 4.0
        weight[quiet_ids] = 0.0
    return weight


def _quiet_token_ids(tokenizer: Tokenizer, vocab: int) -> list[int]:
    def readable(text: str) -> bool:
        return bool(text) and text.isprintable() and "\ufffd" not in text

    size = tokenizer.get_vocab_size()
    special = set(range(len(SPECIAL_TOKENS)))
    return [i for i in range(vocab) if i >= size or i in special or not readable(tokenizer.decode([i]))]


def _train_tokenizer(vocab: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    return tokenizer


def make_tiny(
    arch: str,
    out_dir: str | Path,
    *,
    seed: int = 0,
    num_shards: int = 2,
    config_overrides: dict[str, Any] | None = None,
    **sizes: Any,
) -> Path:
    """Write a random checkpoint of `arch` into `out_dir` and return its path.

    sizes: keyword arguments of `default_config` (layers, hidden, experts, top_k, heads, dtype, ...).
    config_overrides: fields replaced in config.json after the defaults (e.g. q_lora_rank None,
    rope_scaling) before the tensors are shaped. num_shards 1 writes a single model.safetensors
    without an index. The same arguments always give the same bytes.
    """
    hf = default_config(arch, **sizes)
    hf.update(config_overrides or {})
    return write_checkpoint(hf, out_dir, seed=seed, num_shards=num_shards)


def write_checkpoint(hf: dict[str, Any], out_dir: str | Path, *, seed: int = 0, num_shards: int = 2) -> Path:
    """Write config.json exactly as `hf`, random weights of the shapes it implies (in the dtype it
    declares, float32 if none) and the tokenizer into `out_dir`; return its path."""
    config = MoEConfig.from_dict(hf)
    dtype = DTYPES[config.declared_dtype or "float32"]
    tokenizer = _train_tokenizer(config.vocab_size)
    if tokenizer.get_vocab_size() > config.vocab_size:
        raise CheckpointError(f"vocab {config.vocab_size} is smaller than the tokenizer's; raise --vocab")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    quiet_ids = _quiet_token_ids(tokenizer, config.vocab_size)
    tensors = {
        name: _random_tensor(name, shape, gen, quiet_ids).to(dtype)
        for name, shape in tensor_shapes(config).items()
    }
    _write_shards(tensors, out, num_shards)
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[BOS_ID],
                "eos_token": SPECIAL_TOKENS[EOS_ID],
                "model_max_length": config.max_position_embeddings,
            },
            indent=2,
        )
        + "\n"
    )
    return out


def _write_shards(tensors: dict[str, torch.Tensor], out: Path, num_shards: int) -> None:
    names = list(tensors)
    if num_shards <= 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    per_shard = -(-len(names) // num_shards)
    weight_map: dict[str, str] = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i * per_shard : (i + 1) * per_shard]}
        save_file(part, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def cache_dir() -> Path:
    """Where embedded models are generated: $ELASTIC_EP_CACHE, else ~/.cache/elastic-ep."""
    return Path(os.environ.get("ELASTIC_EP_CACHE") or Path.home() / ".cache" / "elastic-ep")


def resolve_model(name_or_path: str | Path) -> Path:
    """A checkpoint directory for an embedded model name or a path.

    "tiny-deepseek-v3" / "tiny-qwen3-moe" are generated on first use; concurrent first uses are
    safe (each builds in its own temp dir, one atomic rename wins). A path must be a directory.
    """
    name = str(name_or_path)
    if name in TINY_MODELS:
        final = cache_dir() / f"{name}-v{TINY_FORMAT_VERSION}"
        if not (final / "config.json").is_file():
            final.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=final.parent))
            make_tiny(TINY_MODELS[name], tmp)
            try:
                os.rename(tmp, final)
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)
                if not (final / "config.json").is_file():
                    raise
        return final
    path = Path(name).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"model {name!r} is neither a directory nor an embedded model; pass a Hugging Face "
            f"checkpoint directory or one of {', '.join(TINY_MODELS)}"
        )
    return path
