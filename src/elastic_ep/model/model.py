"""The decoder of both architectures, everything except the routed experts.

`MoEForCausalLM.forward(chunks, kv, moe_fn)` runs one step over a batch of sequence chunks
(prefill chunks and single decode tokens mixed). Routed experts are computed by `moe_fn`,
which the single-process engine fills with `moe.local_moe_fn` and the EP runtime with its
dispatch / combine. The model calls `moe_fn` for every MoE layer in layer order even when
the batch is empty, so an EP rank with no requests still joins every collective.
`forward_stages` is the same forward as a generator that yields each MoE layer's `MoECall`
and takes its answer back, so a caller can interleave two micro-batches (runtime/overlap.py).

Weights, KV cache and every intermediate tensor live on the model's `device` in its `dtype`
(float32, bfloat16 or float16; transformers' choices where it computes in float32: RMSNorm,
rotary factors, DeepSeek's router, the softmax of routing). Logits come back as float32.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from elastic_ep.errors import ElasticEPError

from .attention import GQAttention, MLAttention, StepBatch
from .checkpoint import DenseWeights
from .config import MoEConfig
from .kv_cache import DEFAULT_BLOCK_SIZE, KVCache
from .layers import Rotary, gated_mlp, rms_norm
from .moe import MoEFn
from .router import grouped_sigmoid_topk, softmax_topk


def resolve_device(name: str | None) -> torch.device:
    """The torch device named `name` ("cpu", "cuda", "cuda:1", ...); None: cuda when present, else cpu.

    Raises ElasticEPError when it names an accelerator that this process cannot see.
    """
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ElasticEPError(f"--device {name!r} is not a torch device ({e}); use cpu, cuda or cuda:N") from e
    if device.type not in ("cpu", "cuda"):
        raise ElasticEPError(f"--device {name}: elastic-ep runs on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = device.index or 0
        if index >= count:
            raise ElasticEPError(
                f"--device {name}: this process sees {count} CUDA device(s); "
                "use --device cpu or a visible GPU"
            )
    return device


@dataclass(frozen=True)
class SeqChunk:
    """Tokens of one sequence to run: a prefill chunk, or one decode token.

    The tokens occupy positions [start_pos, start_pos + len(token_ids)).
    """

    seq_id: int
    token_ids: list[int]
    start_pos: int


@dataclass(frozen=True)
class MoECall:
    """The routed experts of one MoE layer, asked of the driver of `forward_stages`.

    hidden: [T, H] (normed) in the model's dtype; topk_ids: [T, k]; topk_weights: [T, k]
    float32. The answer is sum_k weight * expert_k(hidden): [T, H], as `MoEFn` returns.
    """

    layer: int
    hidden: torch.Tensor
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def _gate_up(w: DenseWeights, hidden: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A gated MLP's weights: gate_up [2I, H] (gate rows then up rows), down [H, I]."""
    gate, up = w.get("gate_proj.weight", (inter, hidden)), w.get("up_proj.weight", (inter, hidden))
    return torch.cat([gate, up]), w.get("down_proj.weight", (hidden, inter))


class _DenseMLP:
    """The MLP of a layer without routed experts (DeepSeek's first layers, Qwen3's mlp_only_layers)."""

    def __init__(self, cfg: MoEConfig, w: DenseWeights):
        self.gate_up, self.down = _gate_up(w, cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return gated_mlp(x, self.gate_up, self.down)


@dataclass
class _DecoderLayer:
    input_norm: torch.Tensor
    attention: MLAttention | GQAttention
    post_attention_norm: torch.Tensor
    mlp: _MoEBlock | _DenseMLP


class _MoEBlock:
    """Router, shared experts and scaling of one MoE layer; routed experts go through moe_fn."""

    def __init__(self, cfg: MoEConfig, w: DenseWeights):
        hidden, e = cfg.hidden_size, cfg.num_experts
        self.cfg = cfg
        self.router = w.get("gate.weight", (e, hidden))
        self.shared: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bias: torch.Tensor | None = None
        if cfg.arch == "deepseek_v3":
            self.bias = w.get("gate.e_score_correction_bias", (e,))
            self.num_groups = int(cfg.hf["n_group"] or 1)
            self.topk_groups = int(cfg.hf["topk_group"] or 1)
            shared = int(cfg.hf["n_shared_experts"] or 0)
            if shared:
                self.shared = _gate_up(w.scope("shared_experts."), hidden, cfg.moe_intermediate_size * shared)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> topk_ids [T, k], topk_weights [T, k] float32."""
        cfg = self.cfg
        if self.bias is None:
            return softmax_topk(F.linear(x, self.router), cfg.top_k, cfg.norm_topk_prob)
        # DeepSeek's router is float32 (see checkpoint.held_dtype), its input too.
        return grouped_sigmoid_topk(
            F.linear(x.float(), self.router),
            self.bias,
            cfg.top_k,
            self.num_groups,
            self.topk_groups,
            cfg.norm_topk_prob,
        )

    def finish(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The layer's output from its input x [T, H] and the routed experts' sum [T, H]."""
        out = routed
        if self.cfg.routed_scaling_factor != 1.0:
            out = out * self.cfg.routed_scaling_factor
        if self.shared is not None:
            out = out + gated_mlp(x, *self.shared)
        return out


class MoEForCausalLM:
    """Holds the dense weights (embeddings, attention, norms, dense and shared MLPs, head).

    dense_state: checkpoint name -> tensor, as `CheckpointReader.dense_state()` gives (any dtype,
    any device: each tensor is placed on `device` in `dtype`). dtype: float32, bfloat16 or
    float16, for weights, KV cache and compute. mla_cache: DeepSeek-V3's KV cache, "latent" or
    "per_head" (see `attention`); Qwen3-MoE always caches per head.
    Raises CheckpointError naming any tensor that is missing or of the wrong shape.
    """

    def __init__(
        self,
        config: MoEConfig,
        dense_state: dict[str, torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        mla_cache: str = "latent",
    ):
        self.config = config
        self.dtype, self.device = dtype, torch.device(device)
        cfg, hidden = config, config.hidden_size
        w = DenseWeights(cfg, dense_state, dtype, self.device)
        self.embed = w.get("model.embed_tokens.weight", (cfg.vocab_size, hidden))
        self.norm = w.get("model.norm.weight", (hidden,))
        if "lm_head.weight" in w or not cfg.tie_word_embeddings:
            self.lm_head = w.get("lm_head.weight", (cfg.vocab_size, hidden))
        else:
            self.lm_head = self.embed
        self.rotary = rotary = Rotary(cfg.rope, self.device)
        moe_layers = set(cfg.moe_layers)
        self.layers: list[_DecoderLayer] = []
        for layer in range(cfg.num_layers):
            lw = w.scope(f"model.layers.{layer}.")
            attention = (
                MLAttention(cfg, lw.scope("self_attn."), rotary, mla_cache)
                if cfg.arch == "deepseek_v3"
                else GQAttention(cfg, lw.scope("self_attn."), rotary)
            )
            mlp_cls = _MoEBlock if layer in moe_layers else _DenseMLP
            self.layers.append(
                _DecoderLayer(
                    input_norm=lw.get("input_layernorm.weight", (hidden,)),
                    attention=attention,
                    post_attention_norm=lw.get("post_attention_layernorm.weight", (hidden,)),
                    mlp=mlp_cls(cfg, lw.scope("mlp.")),
                )
            )
        self.kv_shape = self.layers[0].attention.kv_shape

    def new_kv_cache(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> KVCache:
        """A pool of num_blocks KV blocks of block_size positions for this model, in its dtype
        on its device."""
        return KVCache(self.config.num_layers, self.kv_shape, num_blocks, block_size, dtype=self.dtype,
                       device=self.device)

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], kv: KVCache, moe_fn: MoEFn) -> torch.Tensor:
        """Run one step; returns logits [len(chunks), V] of each chunk's last position.

        Writes each chunk's KV at its positions (overwriting) and sets its sequence length to
        start_pos + len(token_ids). With no chunks it still calls moe_fn once per MoE layer.
        """
        stages = self.forward_stages(chunks, kv)
        routed = None
        while True:
            try:
                call = stages.send(routed)
            except StopIteration as done:
                return done.value
            routed = moe_fn(call.layer, call.hidden, call.topk_ids, call.topk_weights)

    @torch.inference_mode()
    def forward_stages(self, chunks: list[SeqChunk], kv: KVCache) -> Generator[MoECall, torch.Tensor, torch.Tensor]:
        """`forward` as a generator: yields one `MoECall` per MoE layer in layer order (even with
        no chunks), takes the routed experts' output [T, H] back, returns the logits [len(chunks), V].
        The chunks' KV rows are declared before the first yield."""
        cfg = self.config
        batch = self._prepare(chunks, kv)
        token_ids = torch.tensor(
            [t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device
        )
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            if batch is not None:
                x = x + layer.attention(rms_norm(x, layer.input_norm, cfg.rms_norm_eps), batch, kv, i)
            h = rms_norm(x, layer.post_attention_norm, cfg.rms_norm_eps)
            if isinstance(layer.mlp, _MoEBlock):
                topk_ids, topk_weights = layer.mlp.route(h)
                routed = yield MoECall(i, h, topk_ids, topk_weights)
                x = x + layer.mlp.finish(h, routed)
            else:
                x = x + layer.mlp(h)
        ends = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int64, device=self.device)
        last = torch.cumsum(ends, 0) - 1
        return F.linear(rms_norm(x[last], self.norm, cfg.rms_norm_eps), self.lm_head).float()

    def _prepare(self, chunks: list[SeqChunk], kv: KVCache) -> StepBatch | None:
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
        return StepBatch.build(
            [kv.block_table(c.seq_id) for c in chunks],
            [c.start_pos for c in chunks],
            [len(c.token_ids) for c in chunks],
            kv.block_size,
            self.rotary,
            self.dtype,
            self.device,
        )
