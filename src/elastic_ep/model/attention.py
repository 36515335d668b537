"""Attention of both architectures over the padded KV cache.

`AttentionBatch` describes one forward's chunks (a prefill chunk or one decode token per
sequence); every layer attends all chunks in a single scaled-dot-product call over keys
gathered from the cache and padded to the longest sequence, with a mask for causality and
padding. The cache holds per-head keys and values (for MLA: after the kv_b up-projection), so
decode does not recompute the history's projection each step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checkpoint import require_tensor
from .config import MoEConfig
from .kv_cache import KVCache, KVShape
from .layers import Rotary, rms_norm


@dataclass
class AttentionBatch:
    """Where each token of a forward goes.

    Rows of the padded batch are the chunks sorted by cache slot, so that the usual case
    (consecutive slots) reads keys and values as a view of the cache.
    slots: the B cache rows, ascending; token_row, token_offset: [T] row and index inside the
    chunk of every token; chunk_of_row: [B] chunk index of each row, None when rows are in
    chunk order; positions: [T] absolute positions; cos, sin: [T, 1, d/2] rotary factors at
    those positions; mask: [B, 1, N, L] additive, 0 where query i of row b may see key j and
    -inf elsewhere (N the longest chunk, L the longest sequence). Mask and rotary factors are
    built once per step rather than in every layer.
    """

    slots: list[int]
    token_row: torch.Tensor
    token_offset: torch.Tensor
    token_slots: torch.Tensor
    chunk_of_row: torch.Tensor | None
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor
    max_chunk: int
    max_len: int

    @classmethod
    def build(cls, slots: list[int], starts: list[int], lengths: list[int], rotary: Rotary) -> AttentionBatch:
        """slots, starts, lengths: cache row, first position and token count of each chunk;
        rotary: the model's (every layer shares it)."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        chunk_of_row = torch.tensor(order, dtype=torch.int64)
        row_of_chunk = torch.argsort(chunk_of_row)
        lens = torch.tensor(lengths, dtype=torch.int64)
        start = torch.tensor(starts, dtype=torch.int64)
        token_chunk = torch.repeat_interleave(torch.arange(len(lengths)), lens)
        first_token = torch.cumsum(lens, 0) - lens
        token_offset = torch.arange(int(lens.sum())) - first_token[token_chunk]
        max_chunk = int(lens.max())
        max_len = int((start + lens).max())
        row_lens, row_start = lens[chunk_of_row], start[chunk_of_row]
        # A padded query row repeats the chunk's last row so that no row is fully masked.
        query_pos = row_start[:, None] + torch.minimum(
            torch.arange(max_chunk)[None, :], row_lens[:, None] - 1
        )
        visible = torch.arange(max_len)[None, None, :] <= query_pos[:, :, None]
        mask = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
        positions = start[token_chunk] + token_offset
        cos, sin = rotary.cos_sin(positions)
        return cls(
            slots=[slots[i] for i in order],
            token_row=row_of_chunk[token_chunk],
            token_offset=token_offset,
            token_slots=torch.tensor(slots, dtype=torch.int64)[token_chunk],
            chunk_of_row=None if order == sorted(order) else chunk_of_row,
            positions=positions,
            cos=cos,
            sin=sin,
            mask=mask[:, None],
            max_chunk=max_chunk,
            max_len=max_len,
        )

    def attend(self, cache: KVCache, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, heads, k_dim] -> [T, heads, v_dim], attending each token's own sequence."""
        keys, values = cache.gather(layer, self.slots, self.max_len)
        if self.max_chunk == 1 and self.chunk_of_row is None:
            q_pad = q[:, None]
        else:
            q_pad = q.new_zeros(len(self.slots), self.max_chunk, *q.shape[1:])
            q_pad[self.token_row, self.token_offset] = q
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=self.mask,
            scale=scale,
            enable_gqa=keys.shape[1] != q.shape[1],
        ).transpose(1, 2)
        if self.max_chunk == 1 and self.chunk_of_row is None:
            return out[:, 0]
        return out[self.token_row, self.token_offset]

    def write(self, cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        cache.write(layer, self.token_slots, self.positions, k, v)


class _Weights:
    """Reads one attention module's tensors from the dense state, checking shapes."""

    def __init__(self, state: dict[str, torch.Tensor], prefix: str):
        self.state, self.prefix = state, prefix

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return require_tensor(self.state, f"{self.prefix}{name}", shape)

    def bias(self, name: str, size: int) -> torch.Tensor | None:
        key = f"{self.prefix}{name}"
        return self.get(name, (size,)) if key in self.state else None


class MLAttention:
    """DeepSeek multi-head latent attention (q_lora_rank may be None: a plain q_proj)."""

    def __init__(self, cfg: MoEConfig, state: dict[str, torch.Tensor], prefix: str, rotary: Rotary):
        hf, hidden = cfg.hf, cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.nope, self.rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        self.v_dim, self.kv_rank = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        self.q_rank = hf["q_lora_rank"]
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        qk = self.nope + self.rope
        self.scale = qk**-0.5 * rotary.softmax_scale_factor
        w = _Weights(state, prefix)
        if self.q_rank is None:
            self.q_proj = w.get("q_proj.weight", (self.heads * qk, hidden))
        else:
            self.q_a = w.get("q_a_proj.weight", (self.q_rank, hidden))
            self.q_a_bias = w.bias("q_a_proj.bias", self.q_rank)
            self.q_a_norm = w.get("q_a_layernorm.weight", (self.q_rank,))
            self.q_b = w.get("q_b_proj.weight", (self.heads * qk, self.q_rank))
        self.kv_a = w.get("kv_a_proj_with_mqa.weight", (self.kv_rank + self.rope, hidden))
        self.kv_a_bias = w.bias("kv_a_proj_with_mqa.bias", self.kv_rank + self.rope)
        self.kv_a_norm = w.get("kv_a_layernorm.weight", (self.kv_rank,))
        self.kv_b = w.get("kv_b_proj.weight", (self.heads * (self.nope + self.v_dim), self.kv_rank))
        self.o_proj = w.get("o_proj.weight", (hidden, self.heads * self.v_dim))
        self.o_bias = w.bias("o_proj.bias", hidden)

    @staticmethod
    def kv_shape(cfg: MoEConfig) -> KVShape:
        hf = cfg.hf
        return KVShape(
            kv_heads=cfg.num_attention_heads,
            k_dim=int(hf["qk_nope_head_dim"]) + int(hf["qk_rope_head_dim"]),
            v_dim=int(hf["v_head_dim"]),
        )

    def __call__(self, x: torch.Tensor, batch: AttentionBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """x: [T, H] normed hidden states -> [T, H]."""
        tokens = x.shape[0]
        if self.q_rank is None:
            q = F.linear(x, self.q_proj)
        else:
            q = F.linear(rms_norm(F.linear(x, self.q_a, self.q_a_bias), self.q_a_norm, self.eps), self.q_b)
        q_nope, q_rot = q.view(tokens, self.heads, -1).split([self.nope, self.rope], dim=-1)
        kv_latent, k_rot = F.linear(x, self.kv_a, self.kv_a_bias).split([self.kv_rank, self.rope], dim=-1)
        kv = F.linear(rms_norm(kv_latent, self.kv_a_norm, self.eps), self.kv_b).view(tokens, self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot = self.rotary.apply(q_rot, batch.cos, batch.sin)
        k_rot = self.rotary.apply(k_rot.view(tokens, 1, self.rope), batch.cos, batch.sin)
        k = torch.cat([k_nope, k_rot.expand(tokens, self.heads, self.rope)], dim=-1)
        batch.write(cache, layer, k, v)
        out = batch.attend(cache, layer, torch.cat([q_nope, q_rot], dim=-1), self.scale)
        return F.linear(out.reshape(tokens, -1), self.o_proj, self.o_bias)


class GQAttention:
    """Qwen3 grouped-query attention with per-head RMSNorm on queries and keys."""

    def __init__(self, cfg: MoEConfig, state: dict[str, torch.Tensor], prefix: str, rotary: Rotary):
        hidden = cfg.hidden_size
        shape = self.kv_shape(cfg)
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, shape.kv_heads, shape.k_dim
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        w = _Weights(state, prefix)
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj, self.q_bias = w.get("q_proj.weight", (q_out, hidden)), w.bias("q_proj.bias", q_out)
        self.k_proj, self.k_bias = w.get("k_proj.weight", (kv_out, hidden)), w.bias("k_proj.bias", kv_out)
        self.v_proj, self.v_bias = w.get("v_proj.weight", (kv_out, hidden)), w.bias("v_proj.bias", kv_out)
        self.o_proj, self.o_bias = w.get("o_proj.weight", (hidden, q_out)), w.bias("o_proj.bias", hidden)
        self.q_norm = w.get("q_norm.weight", (self.head_dim,))
        self.k_norm = w.get("k_norm.weight", (self.head_dim,))

    @staticmethod
    def kv_shape(cfg: MoEConfig) -> KVShape:
        hf = cfg.hf
        head_dim = int(hf.get("head_dim") or cfg.hidden_size // cfg.num_attention_heads)
        kv_heads = int(hf["num_key_value_heads"] or cfg.num_attention_heads)
        return KVShape(kv_heads=kv_heads, k_dim=head_dim, v_dim=head_dim)

    def __call__(self, x: torch.Tensor, batch: AttentionBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """x: [T, H] normed hidden states -> [T, H]."""
        tokens = x.shape[0]
        q = rms_norm(
            F.linear(x, self.q_proj, self.q_bias).view(tokens, self.heads, -1), self.q_norm, self.eps
        )
        k = rms_norm(
            F.linear(x, self.k_proj, self.k_bias).view(tokens, self.kv_heads, -1), self.k_norm, self.eps
        )
        v = F.linear(x, self.v_proj, self.v_bias).view(tokens, self.kv_heads, -1)
        q, k = self.rotary.apply(q, batch.cos, batch.sin), self.rotary.apply(k, batch.cos, batch.sin)
        batch.write(cache, layer, k, v)
        out = batch.attend(cache, layer, q, self.scale)
        return F.linear(out.reshape(tokens, -1), self.o_proj, self.o_bias)
