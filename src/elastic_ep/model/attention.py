"""Attention of both architectures over the padded KV cache.

`StepBatch` describes one forward's chunks (a prefill chunk or one decode token per sequence):
the cache slot, position and rotary factors of every token, and `AttentionRows`, chunks laid
out as padded rows so that a set of them is attended in one scaled-dot-product call over keys
gathered from the cache, with a mask for causality and padding.

DeepSeek's MLA caches its compressed latent by default, as DeepSeek-V2/V3, vLLM and SGLang do:
per token and layer only the normed latent (kv_lora_rank) and the rotated rope key
(qk_rope_head_dim), shared by all heads. Decode tokens attend in the absorbed form: W_UK (the
key half of kv_b_proj) is folded into the query and W_UV (the value half) applied to the
output, so the history is read as it is stored and never up-projected. Prefill chunks
up-project their sequences' cached latents to per-head keys and values and attend per head:
the up-projection is shared by all the chunk's queries, and each query-key product is then
qk_nope + qk_rope long instead of kv_lora_rank + qk_rope (192 instead of 576 at full size).
`mla_cache="per_head"` keeps per-head keys and values instead (heads x (qk + v) numbers per
token and layer); benchmarks/mla_cache.py measures the two side by side.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checkpoint import DenseWeights
from .config import MoEConfig
from .kv_cache import KVCache, KVShape
from .layers import Rotary, rms_norm

MLA_CACHES = ("latent", "per_head")


def _token_layout(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk index [T] and index inside its chunk [T] of every token of chunks of `lengths` tokens."""
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    token_chunk = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), lens, output_size=sum(lengths)
    )
    first_token = torch.cumsum(lens, 0) - lens
    return token_chunk, torch.arange(sum(lengths), device=device) - first_token[token_chunk]


@dataclass
class AttentionRows:
    """A set of chunks laid out as the rows of one padded attention call.

    Rows are the chunks sorted by cache slot, so that the usual case (consecutive slots) reads
    keys and values as a view of the cache. slots: the B cache rows, ascending; tokens: [n]
    indices into the step's tokens of the n tokens of these chunks, None when the set is every
    chunk of the step; token_row, token_offset: [n] row and index inside the chunk of each of
    those tokens; chunk_of_row: [B] index (in the set) of the chunk of each row, None when rows
    are in chunk order; mask: [B, 1, N, L] additive, 0 where query i of row b may see key j and
    -inf elsewhere (N the longest chunk, L the longest sequence).
    """

    slots: list[int]
    tokens: torch.Tensor | None
    token_row: torch.Tensor
    token_offset: torch.Tensor
    chunk_of_row: torch.Tensor | None
    mask: torch.Tensor
    max_chunk: int
    max_len: int

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        dtype: torch.dtype,
        device: torch.device,
        tokens: torch.Tensor | None = None,
    ) -> AttentionRows:
        """slots, starts, lengths: cache row, first position and token count of each chunk;
        dtype: the queries' (the mask's)."""
        order = sorted(range(len(slots)), key=slots.__getitem__)
        chunk_of_row = torch.tensor(order, dtype=torch.int64, device=device)
        row_of_chunk = torch.argsort(chunk_of_row)
        token_chunk, token_offset = _token_layout(lengths, device)
        max_chunk = max(lengths)
        max_len = max(s + n for s, n in zip(starts, lengths, strict=True))
        row_lens = torch.tensor([lengths[i] for i in order], dtype=torch.int64, device=device)
        row_start = torch.tensor([starts[i] for i in order], dtype=torch.int64, device=device)
        # A padded query row repeats the chunk's last row so that no row is fully masked.
        query_pos = row_start[:, None] + torch.minimum(
            torch.arange(max_chunk, device=device)[None, :], row_lens[:, None] - 1
        )
        visible = torch.arange(max_len, device=device)[None, None, :] <= query_pos[:, :, None]
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
        return cls(
            slots=[slots[i] for i in order],
            tokens=tokens,
            token_row=row_of_chunk[token_chunk],
            token_offset=token_offset,
            chunk_of_row=None if order == sorted(order) else chunk_of_row,
            mask=mask[:, None],
            max_chunk=max_chunk,
            max_len=max_len,
        )

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of these chunks' tokens of x: [T, ...] (every token of the step) -> [n, ...]."""
        return x if self.tokens is None else x[self.tokens]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [n, heads, k_dim], keys: [B, kv_heads, L, k_dim], values: [B, kv_heads, L, v_dim]
        -> [n, heads, v_dim], each token attending its own sequence.

        One-token rows put the heads sharing a kv head in the query-length axis ([B, kv_heads,
        heads / kv_heads, k_dim]): a plain batched product, where SDPA's enable_gqa would copy
        the keys once per query head (MLA's absorbed form has one kv head for all heads).
        """
        tokens, heads = q.shape[:2]
        kv_heads = keys.shape[1]
        if self.max_chunk == 1:
            rows = q if self.chunk_of_row is None else q[self.chunk_of_row]
            out = F.scaled_dot_product_attention(
                rows.reshape(tokens, kv_heads, heads // kv_heads, -1),
                keys,
                values,
                attn_mask=self.mask,
                scale=scale,
            ).reshape(tokens, heads, -1)
            return out if self.chunk_of_row is None else out[self.token_row]
        q_pad = q.new_zeros(len(self.slots), self.max_chunk, *q.shape[1:])
        q_pad[self.token_row, self.token_offset] = q
        out = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys,
            values,
            attn_mask=self.mask,
            scale=scale,
            enable_gqa=kv_heads != heads,
        ).transpose(1, 2)
        return out[self.token_row, self.token_offset]


@dataclass
class StepBatch:
    """Where each token of a forward goes; built once per step, shared by every layer.

    token_slots, positions: [T] cache row and absolute position of every token; cos, sin:
    [T, 1, d/2] rotary factors at those positions in the model's dtype; groups: the chunks as
    padded rows, all in one group, or split into one-token chunks and longer ones (MLA's latent
    cache attends them in different forms).
    """

    token_slots: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    groups: list[AttentionRows]

    @classmethod
    def build(
        cls,
        slots: list[int],
        starts: list[int],
        lengths: list[int],
        rotary: Rotary,
        dtype: torch.dtype,
        device: torch.device,
        split_decode: bool = False,
    ) -> StepBatch:
        """slots, starts, lengths: cache row, first position and token count of each chunk;
        rotary: the model's (every layer shares it); split_decode: one group for the one-token
        chunks, one for the others."""
        token_chunk, token_offset = _token_layout(lengths, device)
        positions = torch.tensor(starts, dtype=torch.int64, device=device)[token_chunk] + token_offset
        cos, sin = rotary.cos_sin(positions, dtype)
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        if split_decode and decode and prefill:
            firsts = list(itertools.accumulate(lengths, initial=0))
            groups = [
                AttentionRows.build(
                    [slots[c] for c in chunks],
                    [starts[c] for c in chunks],
                    [lengths[c] for c in chunks],
                    dtype,
                    device,
                    torch.tensor([t for c in chunks for t in range(firsts[c], firsts[c + 1])], device=device),
                )
                for chunks in (decode, prefill)
            ]
        else:
            groups = [AttentionRows.build(slots, starts, lengths, dtype, device)]
        return cls(
            token_slots=torch.tensor(slots, dtype=torch.int64, device=device)[token_chunk],
            positions=positions,
            cos=cos,
            sin=sin,
            groups=groups,
        )

    def attend(self, attend_rows: Callable[[AttentionRows], torch.Tensor]) -> torch.Tensor:
        """attend_rows(rows) -> [n, heads, d] for the n tokens of each group, as [T, heads, d]."""
        if len(self.groups) == 1:
            return attend_rows(self.groups[0])
        parts = [(rows, attend_rows(rows)) for rows in self.groups]
        out = parts[0][1].new_empty(len(self.positions), *parts[0][1].shape[1:])
        for rows, part in parts:
            out[rows.tokens] = part
        return out

    def attend_cached(self, cache: KVCache, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """q: [T, heads, k_dim] against the keys and values cached for `layer` -> [T, heads, v_dim]."""
        return self.attend(
            lambda rows: rows.attend(rows.take(q), *cache.gather(layer, rows.slots, rows.max_len), scale)
        )


class MLAttention:
    """DeepSeek multi-head latent attention (q_lora_rank may be None: a plain q_proj).

    cache: "latent" (the compressed latent and rope key per token) or "per_head" (per-head keys
    and values); see the module docstring.
    """

    def __init__(self, cfg: MoEConfig, w: DenseWeights, rotary: Rotary, cache: str = "latent"):
        if cache not in MLA_CACHES:
            raise ValueError(f"MLA cache {cache!r} is unknown; choose one of {', '.join(MLA_CACHES)}")
        hf, hidden = cfg.hf, cfg.hidden_size
        self.heads = cfg.num_attention_heads
        self.nope, self.rope = int(hf["qk_nope_head_dim"]), int(hf["qk_rope_head_dim"])
        self.v_dim, self.kv_rank = int(hf["v_head_dim"]), int(hf["kv_lora_rank"])
        self.q_rank = hf["q_lora_rank"]
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        self.latent_cache = cache == "latent"
        self.split_decode = self.latent_cache  # its decode and prefill chunks attend in different forms
        qk = self.nope + self.rope
        self.scale = qk**-0.5 * rotary.softmax_scale_factor
        if self.q_rank is None:
            self.q_proj = w.get("q_proj.weight", (self.heads * qk, hidden))
        else:
            self.q_a = w.get("q_a_proj.weight", (self.q_rank, hidden))
            self.q_a_bias = w.optional("q_a_proj.bias", (self.q_rank,))
            self.q_a_norm = w.get("q_a_layernorm.weight", (self.q_rank,))
            self.q_b = w.get("q_b_proj.weight", (self.heads * qk, self.q_rank))
        self.kv_a = w.get("kv_a_proj_with_mqa.weight", (self.kv_rank + self.rope, hidden))
        self.kv_a_bias = w.optional("kv_a_proj_with_mqa.bias", (self.kv_rank + self.rope,))
        self.kv_a_norm = w.get("kv_a_layernorm.weight", (self.kv_rank,))
        self.kv_b = w.get("kv_b_proj.weight", (self.heads * (self.nope + self.v_dim), self.kv_rank))
        # The absorbed form's halves of kv_b: w_uk [heads, nope, kv_rank], w_uv_t [heads, kv_rank, v].
        w_uk, w_uv = self.kv_b.view(self.heads, self.nope + self.v_dim, self.kv_rank).split(
            [self.nope, self.v_dim], dim=1
        )
        self.w_uk, self.w_uv_t = w_uk, w_uv.transpose(1, 2)
        self.o_proj = w.get("o_proj.weight", (hidden, self.heads * self.v_dim))
        self.o_bias = w.optional("o_proj.bias", (hidden,))
        self.kv_shape = (
            KVShape(kv_heads=1, k_dim=self.kv_rank + self.rope, v_dim=self.kv_rank, values_in_keys=True)
            if self.latent_cache
            else KVShape(kv_heads=self.heads, k_dim=qk, v_dim=self.v_dim)
        )

    def __call__(self, x: torch.Tensor, batch: StepBatch, cache: KVCache, layer: int) -> torch.Tensor:
        """x: [T, H] normed hidden states -> [T, H]."""
        tokens = x.shape[0]
        if self.q_rank is None:
            q = F.linear(x, self.q_proj)
        else:
            q = F.linear(rms_norm(F.linear(x, self.q_a, self.q_a_bias), self.q_a_norm, self.eps), self.q_b)
        q_nope, q_rot = q.view(tokens, self.heads, -1).split([self.nope, self.rope], dim=-1)
        q_rot = self.rotary.apply(q_rot, batch.cos, batch.sin)
        latent, k_rot = F.linear(x, self.kv_a, self.kv_a_bias).split([self.kv_rank, self.rope], dim=-1)
        latent = rms_norm(latent, self.kv_a_norm, self.eps)
        k_rot = self.rotary.apply(k_rot.view(tokens, 1, self.rope), batch.cos, batch.sin)
        if self.latent_cache:
            cache.write(
                layer, batch.token_slots, batch.positions, torch.cat([latent[:, None], k_rot], dim=-1)
            )
            out = batch.attend(
                lambda rows: (self._attend_absorbed if rows.max_chunk == 1 else self._attend_expanded)(
                    rows, cache, layer, rows.take(q_nope), rows.take(q_rot)
                )
            )
        else:
            cache.write(layer, batch.token_slots, batch.positions, *self._expand(latent, k_rot))
            out = batch.attend_cached(cache, layer, torch.cat([q_nope, q_rot], dim=-1), self.scale)
        return F.linear(out.reshape(tokens, -1), self.o_proj, self.o_bias)

    def _expand(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head keys and values of cached latents (kv_b_proj applied).

        latent: [..., kv_rank], k_rot: [..., 1, rope] -> keys [..., heads, nope + rope],
        values [..., heads, v].
        """
        kv = F.linear(latent, self.kv_b).view(*latent.shape[:-1], self.heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        return torch.cat([k_nope, k_rot.expand(*k_nope.shape[:-1], self.rope)], dim=-1), v

    def _attend_absorbed(
        self, rows: AttentionRows, cache: KVCache, layer: int, q_nope: torch.Tensor, q_rot: torch.Tensor
    ) -> torch.Tensor:
        """One-token chunks against the latent cache: q_nope [n, heads, nope], q_rot [n, heads,
        rope] -> [n, heads, v]. Scores are q_nope . (W_UK c) + q_rot . k_rot = (W_UK^T q_nope) . c
        + q_rot . k_rot, the output W_UV (sum_j p_j c_j)."""
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        keys, latents = cache.gather(layer, rows.slots, rows.max_len)
        out_latent = rows.attend(torch.cat([q_latent, q_rot], dim=-1), keys, latents, self.scale)
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def _attend_expanded(
        self, rows: AttentionRows, cache: KVCache, layer: int, q_nope: torch.Tensor, q_rot: torch.Tensor
    ) -> torch.Tensor:
        """Prefill chunks against the latent cache, per head: the cached latents of their
        sequences up-projected to keys and values. Same shapes as `_attend_absorbed`."""
        keys, _ = cache.gather(layer, rows.slots, rows.max_len)
        latent, k_rot = keys.split([self.kv_rank, self.rope], dim=-1)
        k, v = self._expand(latent[:, 0], k_rot[:, 0, :, None])
        return rows.attend(
            torch.cat([q_nope, q_rot], dim=-1), k.transpose(1, 2), v.transpose(1, 2), self.scale
        )


class GQAttention:
    """Qwen3 grouped-query attention with per-head RMSNorm on queries and keys."""

    def __init__(self, cfg: MoEConfig, w: DenseWeights, rotary: Rotary):
        hidden, hf = cfg.hidden_size, cfg.hf
        self.heads = cfg.num_attention_heads
        self.head_dim, self.kv_heads = hf["head_dim"], hf["num_key_value_heads"]
        self.kv_shape = KVShape(kv_heads=self.kv_heads, k_dim=self.head_dim, v_dim=self.head_dim)
        self.split_decode = False
        self.eps = cfg.rms_norm_eps
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        self.q_proj = w.get("q_proj.weight", (q_out, hidden))
        self.k_proj = w.get("k_proj.weight", (kv_out, hidden))
        self.v_proj = w.get("v_proj.weight", (kv_out, hidden))
        self.o_proj = w.get("o_proj.weight", (hidden, q_out))
        self.q_bias, self.k_bias = w.optional("q_proj.bias", (q_out,)), w.optional("k_proj.bias", (kv_out,))
        self.v_bias, self.o_bias = w.optional("v_proj.bias", (kv_out,)), w.optional("o_proj.bias", (hidden,))
        self.q_norm = w.get("q_norm.weight", (self.head_dim,))
        self.k_norm = w.get("k_norm.weight", (self.head_dim,))

    def __call__(self, x: torch.Tensor, batch: StepBatch, cache: KVCache, layer: int) -> torch.Tensor:
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
        cache.write(layer, batch.token_slots, batch.positions, k, v)
        out = batch.attend_cached(cache, layer, q, self.scale)
        return F.linear(out.reshape(tokens, -1), self.o_proj, self.o_bias)
