"""Attention of both architectures over the paged KV cache.

`StepBatch` describes one forward's chunks (a prefill chunk or one decode token per sequence):
the cache row (slot), position and rotary factors of every token, and `AttentionRows`, the
chunks split into one-token chunks and longer ones. One-token chunks attend in one batched
scaled-dot-product call over keys gathered from their block tables ([B, L], padding masked).
A longer chunk attends alone, its queries in tiles of at most `SCORE_ELEMENTS` scores, each
against the keys it may see (a causal mask of the tile only), so attention's memory grows
linearly with the prompt: no [heads, L, L] score matrix and no dense mask for a padded batch.
On a GPU with FlashInfer or flash-attn installed their paged kernels could take the tables
directly; without them (and on the CPU) the gather is the path.

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

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .checkpoint import DenseWeights
from .config import MoEConfig
from .kv_cache import KVCache, KVShape
from .layers import Rotary, rms_norm

MLA_CACHES = ("latent", "per_head")
# Scores one prefill tile computes at most (heads x queries x keys): 16 MB in float32, whatever
# the prompt's length, where the whole chunk at once would be heads x L x L.
SCORE_ELEMENTS = 1 << 22

KVFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _token_layout(lengths: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk index [T] and index inside its chunk [T] of every token of chunks of `lengths` tokens."""
    lens = torch.tensor(lengths, dtype=torch.int64, device=device)
    token_chunk = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), lens, output_size=sum(lengths)
    )
    first_token = torch.cumsum(lens, 0) - lens
    return token_chunk, torch.arange(sum(lengths), device=device) - first_token[token_chunk]


def _padded_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    """Block tables as [C, max blocks] (short ones padded with block 0, never read unmasked)."""
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64, device=device)


def _table_slots(tables: torch.Tensor, block_size: int, length: int) -> torch.Tensor:
    """Cache rows of positions [0, length) of each table: tables [C, blocks] -> [C, length]."""
    offsets = torch.arange(block_size, device=tables.device)
    return (tables[:, :, None] * block_size + offsets).reshape(len(tables), -1)[:, :length]


@dataclass
class AttentionRows:
    """One kind of chunk of a step: all one-token chunks (decode), or all longer ones.

    tokens: [n] indices into the step's tokens of these chunks' tokens, None when they are every
    token of the step; starts, lengths: first position and token count of each chunk;
    key_slots: decode: one [B, L] tensor, the cache rows of each sequence's positions [0, L)
    (L the longest; padding masked by `mask` [B, 1, 1, L], True where a key is seen); prefill:
    per chunk the cache rows [start + n] of the positions it sees.
    """

    tokens: torch.Tensor | None
    starts: list[int]
    lengths: list[int]
    key_slots: list[torch.Tensor]
    mask: torch.Tensor | None

    @property
    def max_chunk(self) -> int:
        return max(self.lengths)

    @classmethod
    def build(cls, tables: list[list[int]], starts: list[int], lengths: list[int], block_size: int,
              device: torch.device, tokens: torch.Tensor | None = None) -> AttentionRows:
        """tables, starts, lengths: block table, first position and token count of each chunk."""
        ends = [s + n for s, n in zip(starts, lengths, strict=True)]
        padded = _padded_tables(tables, device)
        if max(lengths) == 1:
            longest = max(ends)
            seen = torch.arange(longest, device=device) < torch.tensor(ends, device=device)[:, None]
            return cls(tokens, starts, lengths, [_table_slots(padded, block_size, longest)], seen[:, None, None])
        key_slots = [_table_slots(padded[i:i + 1], block_size, end)[0] for i, end in enumerate(ends)]
        return cls(tokens, starts, lengths, key_slots, None)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of these chunks' tokens of x: [T, ...] (every token of the step) -> [n, ...]."""
        return x if self.tokens is None else x[self.tokens]

    def attend(self, q: torch.Tensor, kv: KVFn, scale: float) -> torch.Tensor:
        """q: [n, heads, k_dim] -> [n, heads, v_dim], each token attending its own sequence;
        kv(slots [..., L]) -> keys [..., kv_heads, L, k_dim], values [..., kv_heads, L, v_dim].

        One-token rows put the heads sharing a kv head in the query-length axis ([B, kv_heads,
        heads / kv_heads, k_dim]): a plain batched product, where SDPA's enable_gqa would copy
        the keys once per query head (MLA's absorbed form has one kv head for all heads).
        """
        tokens, heads = q.shape[:2]
        if self.mask is not None:
            keys, values = kv(self.key_slots[0])
            kv_heads = keys.shape[1]
            return F.scaled_dot_product_attention(
                q.reshape(tokens, kv_heads, heads // kv_heads, -1), keys, values, attn_mask=self.mask, scale=scale
            ).reshape(tokens, heads, -1)
        parts, first = [], 0
        for start, n, slots in zip(self.starts, self.lengths, self.key_slots, strict=True):
            keys, values = kv(slots)
            parts.append(_attend_chunk(q[first:first + n].transpose(0, 1), keys, values, start, scale))
            first += n
        return torch.cat(parts, dim=1).transpose(0, 1)


def _attend_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """One chunk's causal attention: q [heads, n, k_dim] at positions [start, start + n), keys
    [kv_heads, start + n, k_dim], values [kv_heads, start + n, v_dim] -> [heads, n, v_dim].
    Queries go in tiles of at most SCORE_ELEMENTS scores, each against the keys up to its last."""
    heads, n = q.shape[:2]
    gqa = keys.shape[0] != heads
    if start == 0 and heads * n * n <= SCORE_ELEMENTS:
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
    tile = max(SCORE_ELEMENTS // (heads * (start + n)), 1)
    out = []
    for q0 in range(0, n, tile):
        q1 = min(q0 + tile, n)
        end = start + q1
        seen = torch.arange(end, device=q.device) <= torch.arange(start + q0, end, device=q.device)[:, None]
        out.append(F.scaled_dot_product_attention(
            q[:, q0:q1], keys[:, :end], values[:, :end], attn_mask=seen, scale=scale, enable_gqa=gqa
        ))
    return torch.cat(out, dim=1)


@dataclass
class StepBatch:
    """Where each token of a forward goes; built once per step, shared by every layer.

    token_slots, positions: [T] cache row and absolute position of every token; cos, sin:
    [T, 1, d/2] rotary factors at those positions in the model's dtype; groups: the one-token
    chunks and the longer ones (`AttentionRows`), one group when all are of one kind.
    """

    token_slots: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    groups: list[AttentionRows]

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        starts: list[int],
        lengths: list[int],
        block_size: int,
        rotary: Rotary,
        dtype: torch.dtype,
        device: torch.device,
    ) -> StepBatch:
        """tables, starts, lengths: block table, first position and token count of each chunk;
        rotary: the model's (every layer shares it)."""
        token_chunk, token_offset = _token_layout(lengths, device)
        positions = torch.tensor(starts, dtype=torch.int64, device=device)[token_chunk] + token_offset
        cos, sin = rotary.cos_sin(positions, dtype)
        token_slots = (_padded_tables(tables, device)[token_chunk, positions // block_size] * block_size
                       + positions % block_size)
        decode = [i for i, n in enumerate(lengths) if n == 1]
        prefill = [i for i, n in enumerate(lengths) if n > 1]
        if decode and prefill:
            is_decode = torch.tensor(lengths, device=device)[token_chunk] == 1
            groups = [
                AttentionRows.build(
                    [tables[c] for c in chunks], [starts[c] for c in chunks], [lengths[c] for c in chunks],
                    block_size, device, torch.nonzero(mask)[:, 0],
                )
                for chunks, mask in ((decode, is_decode), (prefill, ~is_decode))
            ]
        else:
            groups = [AttentionRows.build(tables, starts, lengths, block_size, device)]
        return cls(token_slots=token_slots, positions=positions, cos=cos, sin=sin, groups=groups)

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
        return self.attend(lambda rows: rows.attend(rows.take(q), lambda s: cache.gather(layer, s), scale))


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
            cache.write(layer, batch.token_slots, torch.cat([latent[:, None], k_rot], dim=-1))
            out = batch.attend(
                lambda rows: (self._attend_absorbed if rows.max_chunk == 1 else self._attend_expanded)(
                    rows, cache, layer, rows.take(q_nope), rows.take(q_rot)
                )
            )
        else:
            cache.write(layer, batch.token_slots, *self._expand(latent, k_rot))
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
        out_latent = rows.attend(torch.cat([q_latent, q_rot], dim=-1), lambda s: cache.gather(layer, s), self.scale)
        return torch.bmm(out_latent.transpose(0, 1), self.w_uv_t).transpose(0, 1)

    def _attend_expanded(
        self, rows: AttentionRows, cache: KVCache, layer: int, q_nope: torch.Tensor, q_rot: torch.Tensor
    ) -> torch.Tensor:
        """Prefill chunks against the latent cache, per head: the cached latents of each
        sequence up-projected to keys and values. Same shapes as `_attend_absorbed`."""

        def expanded(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            latent, k_rot = cache.gather(layer, slots)[0][0].split([self.kv_rank, self.rope], dim=-1)
            k, v = self._expand(latent, k_rot[:, None])
            return k.transpose(0, 1), v.transpose(0, 1)

        return rows.attend(torch.cat([q_nope, q_rot], dim=-1), expanded, self.scale)


class GQAttention:
    """Qwen3 grouped-query attention with per-head RMSNorm on queries and keys."""

    def __init__(self, cfg: MoEConfig, w: DenseWeights, rotary: Rotary):
        hidden, hf = cfg.hidden_size, cfg.hf
        self.heads = cfg.num_attention_heads
        self.head_dim, self.kv_heads = hf["head_dim"], hf["num_key_value_heads"]
        self.kv_shape = KVShape(kv_heads=self.kv_heads, k_dim=self.head_dim, v_dim=self.head_dim)
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
        cache.write(layer, batch.token_slots, k, v)
        out = batch.attend_cached(cache, layer, q, self.scale)
        return F.linear(out.reshape(tokens, -1), self.o_proj, self.o_bias)
