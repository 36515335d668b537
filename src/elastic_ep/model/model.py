"""The decoder of both architectures, everything except the routed experts.

`MoEForCausalLM.forward(chunks, kv, moe_fn)` runs one step over a batch of sequence chunks
(prefill chunks and single decode tokens mixed). Routed experts are computed by `moe_fn`,
which the single-process engine fills with `moe.local_moe_fn` and the EP runtime with its
dispatch / combine. The model calls `moe_fn` for every MoE layer in layer order even when
the batch is empty, so an EP rank with no requests still joins every collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elastic_ep.errors import ElasticEPError

from .attention import AttentionBatch, GQAttention, MLAttention
from .checkpoint import require_tensor
from .config import MoEConfig
from .kv_cache import KVCache
from .layers import Rotary, gated_mlp, rms_norm
from .moe import MoEFn
from .router import grouped_sigmoid_topk, softmax_topk


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence to run: a prefill chunk, or one decode token.

    The tokens occupy positions [start_pos, start_pos + len(token_ids)).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int


def _gate_up(
    state: dict[str, torch.Tensor], prefix: str, hidden: int, inter: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's weights: gate_up [2I, H] (gate rows then up rows), down [H, I]."""
    gate = require_tensor(state, f"{prefix}gate_proj.weight", (inter, hidden))
    up = require_tensor(state, f"{prefix}up_proj.weight", (inter, hidden))
    return torch.cat([gate, up]), require_tensor(state, f"{prefix}down_proj.weight", (hidden, inter))


class _DenseMLP:
    """The MLP of a layer without routed experts (DeepSeek's first layers, Qwen3's mlp_only_layers)."""

    def __init__(self, cfg: MoEConfig, state: dict[str, torch.Tensor], prefix: str):
        self.gate_up, self.down = _gate_up(state, prefix, cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, layer: int, x: torch.Tensor, moe_fn: MoEFn) -> torch.Tensor:
        return gated_mlp(x, self.gate_up, self.down)


@dataclass
class _DecoderLayer:
    input_norm: torch.Tensor
    attention: MLAttention | GQAttention
    post_attention_norm: torch.Tensor
    mlp: _MoEBlock | _DenseMLP


class _MoEBlock:
    """Router, shared experts and scaling of one MoE layer; routed experts go through moe_fn."""

    def __init__(self, cfg: MoEConfig, state: dict[str, torch.Tensor], prefix: str):
        hidden, e = cfg.hidden_size, cfg.num_experts
        self.cfg = cfg
        self.router = require_tensor(state, f"{prefix}gate.weight", (e, hidden))
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bias: torch.Tensor | None = None
        if cfg.arch == "deepseek_v3":
            self.bias = require_tensor(state, f"{prefix}gate.e_score_correction_bias", (e,))
            self.num_groups = int(cfg.hf["n_group"] or 1)
            self.topk_groups = int(cfg.hf["topk_group"] or 1)
            shared = int(cfg.hf["n_shared_experts"] or 0)
            if shared:
                self.shared = _gate_up(
                    state, f"{prefix}shared_experts.", hidden, cfg.moe_intermediate_size * shared
                )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> topk_ids [T, k], topk_weights [T, k]."""
        cfg, logits = self.cfg, F.linear(x, self.router)
        if self.bias is None:
            return softmax_topk(logits, cfg.top_k, cfg.norm_topk_prob)
        return grouped_sigmoid_topk(
            logits, self.bias, cfg.top_k, self.num_groups, self.topk_groups, cfg.norm_topk_prob
        )

    def __call__(self, layer: int, x: torch.Tensor, moe_fn: MoEFn) -> torch.Tensor:
        topk_ids, topk_weights = self.route(x)
        out = moe_fn(layer, x, topk_ids, topk_weights)
        if self.cfg.routed_scaling_factor != 1.0:
            out = out * self.cfg.routed_scaling_factor
        if self.shared is not None:
            out = out + gated_mlp(x, *self.shared)
        return out


class MoEForCausalLM:
    """Holds the dense weights (embeddings, attention, norms, dense and shared MLPs, head).

    dense_state: checkpoint name -> float32 tensor, as `CheckpointReader.dense_state()` gives.
    Raises CheckpointError naming any tensor that is missing or of the wrong shape.
    """

    def __init__(self, config: MoEConfig, dense_state: dict[str, torch.Tensor]):
        self.config = config
        cfg, hidden = config, config.hidden_size
        self.embed = require_tensor(dense_state, "model.embed_tokens.weight", (cfg.vocab_size, hidden))
        self.norm = require_tensor(dense_state, "model.norm.weight", (hidden,))
        if "lm_head.weight" in dense_state or not cfg.tie_word_embeddings:
            self.lm_head = require_tensor(dense_state, "lm_head.weight", (cfg.vocab_size, hidden))
        else:
            self.lm_head = self.embed
        self.rotary = rotary = Rotary(cfg.rope)
        attention_cls = MLAttention if cfg.arch == "deepseek_v3" else GQAttention
        self.kv_shape = attention_cls.kv_shape(cfg)
        moe_layers = set(cfg.moe_layers)
        self.layers: list[_DecoderLayer] = []
        for layer in range(cfg.num_layers):
            prefix = f"model.layers.{layer}."
            mlp_cls = _MoEBlock if layer in moe_layers else _DenseMLP
            self.layers.append(
                _DecoderLayer(
                    input_norm=require_tensor(dense_state, f"{prefix}input_layernorm.weight", (hidden,)),
                    attention=attention_cls(cfg, dense_state, f"{prefix}self_attn.", rotary),
                    post_attention_norm=require_tensor(
                        dense_state, f"{prefix}post_attention_layernorm.weight", (hidden,)
                    ),
                    mlp=mlp_cls(cfg, dense_state, f"{prefix}mlp."),
                )
            )

    def new_kv_cache(
        self, max_seqs: int, max_model_len: int | None = None, initial_capacity: int = 256
    ) -> KVCache:
        """A cache for this model; max_model_len defaults to max_position_embeddings.

        initial_capacity: positions allocated per sequence up front (the cache doubles as needed).
        """
        return KVCache(
            self.config.num_layers,
            self.kv_shape,
            max_seqs,
            max_model_len or self.config.max_position_embeddings,
            initial_capacity,
        )

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], kv: KVCache, moe_fn: MoEFn) -> torch.Tensor:
        """Run one step; returns logits [len(chunks), V] of each chunk's last position.

        Writes each chunk's KV at its positions (overwriting) and sets its sequence length to
        start_pos + len(token_ids). With no chunks it still calls moe_fn once per MoE layer.
        """
        cfg = self.config
        batch = self._prepare(chunks, kv)
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            if batch is not None:
                x = x + layer.attention(rms_norm(x, layer.input_norm, cfg.rms_norm_eps), batch, kv, i)
            x = x + layer.mlp(i, rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps), moe_fn)
        last = torch.cumsum(torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64), 0) - 1
        return F.linear(rms_norm(x[last], self.norm, cfg.rms_norm_eps), self.lm_head)

    def _prepare(self, chunks: list[SeqChunk], kv: KVCache) -> AttentionBatch | None:
        if not chunks:
            return None
        seen: set[int] = set()
        for c in chunks:
            if c.seq_id in seen:
                raise ValueError(f"sequence {c.seq_id} appears twice in one step")
            seen.add(c.seq_id)
            if not c.token_ids:
                raise ValueError(f"sequence {c.seq_id}: a chunk needs at least one token")
            bad = [t for t in c.token_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ElasticEPError(
                    f"token id {bad[0]} is outside the vocabulary (size {self.config.vocab_size}); "
                    "use token ids of this model's tokenizer"
                )
        for c in chunks:
            kv.begin_chunk(c.seq_id, c.start_pos, len(c.token_ids))
        return AttentionBatch.build(
            [kv.slot(c.seq_id) for c in chunks],
            [c.start_pos for c in chunks],
            [len(c.token_ids) for c in chunks],
            self.rotary,
        )
