"""One normalized view of the Hugging Face configs this project serves.

`MoEConfig.from_pretrained(dir)` reads `config.json` of a DeepSeek-V3 or Qwen3-MoE checkpoint and
gives the rest of the code the same names for both (`num_experts`, `top_k`, `moe_layers`, ...);
the raw dict stays available as `hf` for the architecture-specific fields.

Both generations of transformers' configs load: 4.x (the hub's checkpoints: `torch_dtype`,
`rope_theta` beside `rope_scaling`, Qwen3-MoE's `num_experts`) and 5.x (`save_pretrained` today:
`dtype`, `rope_parameters` holding `rope_theta`, Qwen3-MoE's `num_local_experts`). `hf` holds the
canonical spelling of each renamed field (the left side of `FIELD_ALIASES`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_ep.errors import CheckpointError

ARCHITECTURES: dict[str, str] = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
MODEL_TYPES: dict[str, str] = {"deepseek_v3": "deepseek_v3", "qwen3_moe": "qwen3_moe"}
SUPPORTED_ROPE_TYPES = ("default", "yarn")

# One field, two spellings: canonical -> the other one (transformers 5.x renamed these, or accepts
# both through its config's attribute_map).
FIELD_ALIASES: dict[str, dict[str, str]] = {
    "deepseek_v3": {"n_routed_experts": "num_local_experts", "dtype": "torch_dtype"},
    "qwen3_moe": {"num_experts": "num_local_experts", "dtype": "torch_dtype"},
}
# Fields that change the math but that this package (and transformers' own implementation of the
# architecture) computes only one way: the value it supports, checked when config.json has the field.
ONLY_SUPPORTED: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "hidden_act": "silu",
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "moe_layer_freq": 1,
    },
    "qwen3_moe": {"hidden_act": "silu", "use_sliding_window": False},
}

# transformers' defaults for the fields this package reads, so that a config.json that leaves
# one out means here what it means to transformers.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "first_k_dense_replace": 3,
        "n_shared_experts": 1,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,
        "max_position_embeddings": 4096,
        "eos_token_id": 1,
    },
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
    },
}
COMMON_DEFAULTS: dict[str, Any] = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings: `rope_type` is "default" or "yarn" (DeepSeek-V3's long-context scaling)."""

    dim: int
    theta: float
    rope_type: str = "default"
    interleave: bool = False
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class MoEConfig:
    """The fields every package needs, for both architectures.

    `moe_layers` are the layer ids with routed experts; the other layers have a dense MLP.
    `declared_dtype` is the dtype config.json declares for the weights ("bfloat16", ...), None if it
    declares none. `hf` is config.json as read, renamed fields under their canonical name
    (`FIELD_ALIASES`), with transformers' defaults filled in for absent fields.
    """

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int
    moe_layers: list[int]
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    num_attention_heads: int
    declared_dtype: str | None
    rms_norm_eps: float
    norm_topk_prob: bool
    routed_scaling_factor: float
    rope: RopeConfig
    tie_word_embeddings: bool
    hf: dict[str, Any] = field(repr=False, default_factory=dict)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> MoEConfig:
        """Read `model_dir/config.json`; raises CheckpointError naming what is missing or unsupported."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(
                f"model directory {model_dir} does not exist; pass a Hugging Face checkpoint directory "
                "or one of the embedded models tiny-deepseek-v3, tiny-qwen3-moe"
            )
        path = model_dir / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"checkpoint dir {model_dir} has no config.json; point --model at a Hugging Face checkpoint "
                "directory (config.json, *.safetensors, tokenizer.json)"
            )
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON ({e}); fix or re-download the file") from e
        return cls.from_dict(hf, source=str(path))

    @classmethod
    def from_dict(cls, hf: dict[str, Any], source: str = "config") -> MoEConfig:
        arch = _detect_arch(hf, source)
        hf = {**COMMON_DEFAULTS, **HF_DEFAULTS[arch], **_canonical_names(hf, arch, source)}
        _check_supported(hf, arch, source)
        if hf.get("quantization_config"):
            method = hf["quantization_config"].get("quant_method", "?")
            raise CheckpointError(
                f"{source}: quantized checkpoints ({method}) are not supported; "
                "use a bfloat16 or float32 conversion of the model"
            )
        try:
            return _build(arch, hf)
        except KeyError as e:
            name = e.args[0]
            other = FIELD_ALIASES[arch].get(name)
            spelling = f" (or {other!r})" if other else ""
            raise CheckpointError(
                f"{source} lacks the field {name!r}{spelling} that {arch} needs; add it to config.json"
            ) from e


def _detect_arch(hf: dict[str, Any], source: str) -> str:
    for name in hf.get("architectures") or []:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    if hf.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[hf["model_type"]]
    found = hf.get("architectures") or hf.get("model_type")
    raise CheckpointError(
        f"{source}: unsupported architecture {found!r}; supported: {', '.join(ARCHITECTURES)} "
        f"(model_type {', '.join(MODEL_TYPES)})"
    )


def _canonical_names(hf: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """hf with each aliased field under its canonical name; CheckpointError if both names disagree."""
    hf = dict(hf)
    for canonical, other in FIELD_ALIASES[arch].items():
        if other not in hf:
            continue
        value = hf.pop(other)
        if canonical in hf and hf[canonical] != value:
            raise CheckpointError(
                f"{source} sets both {canonical!r} ({hf[canonical]!r}) and {other!r} ({value!r}), two names "
                f"of one field; keep one of them"
            )
        hf[canonical] = value
    return hf


def _check_supported(hf: dict[str, Any], arch: str, source: str) -> None:
    for name, supported in ONLY_SUPPORTED[arch].items():
        if name in hf and hf[name] != supported:
            raise CheckpointError(
                f"{source}: {name}={hf[name]!r} is not supported for {arch} (only {supported!r}); "
                "elastic-ep cannot serve this checkpoint as it is"
            )


def _eos_ids(hf: dict[str, Any]) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope(hf: dict[str, Any], dim: int, interleave: bool, source_max_pos: int) -> RopeConfig:
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", hf["rope_theta"]))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(dim=dim, theta=theta, interleave=interleave)
    original = int(params.get("original_max_position_embeddings", source_max_pos))
    factor = params.get("factor")
    return RopeConfig(
        dim=dim,
        theta=theta,
        rope_type=rope_type,
        interleave=interleave,
        factor=float(factor) if factor is not None else source_max_pos / original,
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )


def _build(arch: str, hf: dict[str, Any]) -> MoEConfig:
    num_layers = int(hf["num_hidden_layers"])
    max_pos = int(hf["max_position_embeddings"])
    if arch == "deepseek_v3":
        first_dense = int(hf["first_k_dense_replace"])
        moe_layers = list(range(first_dense, num_layers))
        num_experts = int(hf["n_routed_experts"])
        rope = _rope(hf, int(hf["qk_rope_head_dim"]), bool(hf["rope_interleave"]), max_pos)
        routed_scaling_factor = float(hf["routed_scaling_factor"])
        norm_topk = bool(hf["norm_topk_prob"])
    else:
        step = int(hf["decoder_sparse_step"])
        mlp_only = set(hf["mlp_only_layers"] or [])
        num_experts = int(hf["num_experts"])
        moe_layers = [
            i for i in range(num_layers) if i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        ]
        # transformers' defaults that depend on other fields.
        hf["head_dim"] = int(hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
        hf["num_key_value_heads"] = int(hf["num_key_value_heads"] or hf["num_attention_heads"])
        rope = _rope(hf, hf["head_dim"], False, max_pos)
        routed_scaling_factor = 1.0
        norm_topk = bool(hf["norm_topk_prob"])
    return MoEConfig(
        arch=arch,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=int(hf["num_experts_per_tok"]),
        moe_intermediate_size=int(hf["moe_intermediate_size"]),
        intermediate_size=int(hf.get("intermediate_size", hf["moe_intermediate_size"])),
        moe_layers=moe_layers,
        eos_token_ids=_eos_ids(hf),
        max_position_embeddings=max_pos,
        num_attention_heads=int(hf["num_attention_heads"]),
        declared_dtype=hf.get("dtype"),
        rms_norm_eps=float(hf["rms_norm_eps"]),
        norm_topk_prob=norm_topk,
        routed_scaling_factor=routed_scaling_factor,
        rope=rope,
        tie_word_embeddings=bool(hf["tie_word_embeddings"]),
        hf=hf,
    )
